"""``lean bench schedules --sweep KEY=V1,V2,...``: the schedule benchmark at each value of one config key, so a speedup
is read against what it depends on (LeanGRPO Fig. 3: the speedup against the timestep fraction, which rises as the
recomputed share of an iteration does).

Each value is benchmarked on its own (:func:`lean.tools.bench.schedules.bench_schedules`; a recipe of several updates
per rollout in its on-policy form, ``train.on_policy``, where the schedules are exact) into ``out/<KEY>=<V>/``; the
sweep collects, per value and Lean schedule, the speedup over Recompute, its bound and their ratio, and the trained
steps per sample, into ``out/sweep.json``, one table, and ``out/sweep.png`` (speedup and bound against the value).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lean.config import ConfigError, RunConfig
from lean.observe.outputs import write_json
from lean.schedules import BASELINE, LEAN_SCHEDULES, RETAIN, REWEIGHT

# LeanGRPO's Fig. 3 (arXiv 2609.03528): each schedule's speedup range over timestep fractions 0.25-1.0, per setting
PAPER_FIG3 = {
    "DanceGRPO FLUX full fine-tune": {REWEIGHT: (1.44, 1.81), RETAIN: (1.18, 1.29)},
    "DanceGRPO FLUX LoRA (bf16)": {REWEIGHT: (1.26, 1.43), RETAIN: (1.27, 1.42)},
    "DanceGRPO Wan 1.3B/5B/14B": {REWEIGHT: (1.24, 1.49), RETAIN: (1.22, 1.46)},
    "FlowGRPO-Fast": {REWEIGHT: (1.25, 1.67), RETAIN: (1.19, 1.30)},
    "MixGRPO-Flash": {REWEIGHT: (1.22, 1.47), RETAIN: (1.15, 1.29)},
    "FlowGRPO SD3.5-M": {REWEIGHT: (1.43, 1.83), RETAIN: (1.12, 1.21)},
}


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2,...`` -> (KEY, [V1, V2, ...]); refused in one line unless a key and two or more values."""
    key, _, values = text.partition("=")
    parts = [v.strip() for v in values.split(",") if v.strip()]
    if not key or len(parts) < 2:
        raise ConfigError("--sweep", text, "takes KEY=V1,V2,... with two or more values")
    return key.strip(), parts


def sweep_point(result: dict, value: str) -> dict:
    """One value's row: its Lean schedules' speedup, bound and ratio (from ``bench_schedules``' result)."""
    point = {"value": value, "trained_steps_per_sample": result["config"]["trained_steps_per_sample"]}
    for s in (s for s in LEAN_SCHEDULES if s in result and "speedup" in result[s]):
        e = result[s]
        point[s] = {k: e[k] for k in ("speedup", "speedup_bound", "speedup_vs_bound", "time_iteration_s")}
    point["baseline_time_iteration_s"] = result[BASELINE]["time_iteration_s"]
    return point


def bench_sweep(
    key: str,
    values: list[str],
    config_at: Callable[[str], RunConfig],
    run: Callable[[RunConfig, str | None], dict],
    out: str | None = None,
    is_main: bool = True,
) -> dict:
    """The benchmark ``run(cfg, folder)`` at each of ``values`` of ``key`` (``config_at(value)``: the config with
    ``key=value``); on the main process writes ``out/sweep.json`` and ``out/sweep.png``; returns the report."""
    points = []
    for value in values:
        cfg = config_at(value)
        folder = str(Path(out) / f"{key}={value}") if out else None
        points.append(sweep_point(run(cfg, folder), value))
    report = {"key": key, "points": points}
    if is_main:
        print(format_sweep(report))
        if out:
            write_json(Path(out) / "sweep.json", report)
            plot_sweep(report, Path(out) / "sweep.png")
    return report


def format_sweep(report: dict) -> str:
    lines = [
        f"lean bench schedules --sweep {report['key']}: speedup over Recompute / its bound (ratio), per value",
        f"{report['key']:>28} {'K':>4} {BASELINE + ' s':>12} "
        + " ".join(f"{s + ' speedup':>16} {'bound':>6} {'of bound':>8}" for s in LEAN_SCHEDULES),
    ]
    for p in report["points"]:
        cells = [
            f"{p[s]['speedup']:16.3f} {p[s]['speedup_bound']:6.3f} {p[s]['speedup_vs_bound']:8.3f}"
            if s in p
            else f"{'-':>16} {'':6} {'':8}"
            for s in LEAN_SCHEDULES
        ]
        lines.append(
            f"{p['value']:>28} {p['trained_steps_per_sample']:4d} {p['baseline_time_iteration_s']:12.3f} "
            + " ".join(cells)
        )
    return "\n".join(lines)


def plot_sweep(report: dict, path: Path) -> None:
    """Speedup (solid) and bound (dashed) of each Lean schedule against the swept value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    try:
        x = [float(p["value"]) for p in points]
    except ValueError:  # a categorical key: the values in order
        x = list(range(len(points)))
    figure, axes = plt.subplots(figsize=(5.5, 3.6))
    for s in LEAN_SCHEDULES:
        at = [(xi, p[s]) for xi, p in zip(x, points) if s in p]
        if at:
            line = axes.plot([a for a, _ in at], [e["speedup"] for _, e in at], marker="o", label=f"{s} speedup")[0]
            axes.plot([a for a, _ in at], [e["speedup_bound"] for _, e in at], ls="--", color=line.get_color(),
                      label=f"{s} bound")  # fmt: skip
    axes.axhline(1.0, color="grey", lw=0.8)
    axes.set_xlabel(report["key"])
    axes.set_ylabel("speedup over Recompute")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
