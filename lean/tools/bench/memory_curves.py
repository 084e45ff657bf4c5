"""Memory per selected step (LeanGRPO, arXiv 2609.03528, Fig. 6) from a ``lean bench schedules`` result: each
schedule's resident memory after every SDE step of the rollout and the peaks of its update and optimizer stage
(``lean.observe.memory_trace``), beside ``lean plan``'s terms:

    slope        Retain's growth per kept step (the median within a rollout micro-batch) / the plan's per-step term
                 (one tracked step's saved activations at one rollout micro-batch): the paper's linear climb
    optimizer    the optimizer stage's measured peak / the plan's (its gradient, the sync's flat copy or AdamW's
                 temporaries, the moments): what sets Native's peak when the activations are small

    python -m lean.tools.bench.memory_curves OUT/schedules.json [--out memory.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lean.schedules import BASELINE, LEAN_SCHEDULES, RETAIN

SCHEDULE_ORDER = (BASELINE, *LEAN_SCHEDULES)


def curve_rows(result: dict) -> list[dict]:
    """Per schedule: MiB above the iteration's start after each SDE step, the phases' peaks, the plan's figures."""
    rows = []
    for s in (s for s in SCHEDULE_ORDER if "memory_curve" in result.get(s, {})):
        entry, curve = result[s], result[s]["memory_curve"]
        start = curve["start_mb"]
        rows.append(
            {
                "schedule": s,
                "start_mb": start,
                "steps_mb": [p["mb"] - start for p in curve["steps"]],
                "tracked": [p["tracked"] for p in curve["steps"]],
                **{f"{phase}_peak_mb": mb for phase, mb in curve["phases"].items()},
                "slope_mb": curve["slope_mb"],
                "plan_slope_mb": entry.get("plan_memory_slope_mb"),
                "plan_optimizer_peak_mb": entry.get("plan_optimizer_peak_mb"),
            }
        )
    return rows


def format_curves(result: dict) -> str:
    """A markdown table: one row per schedule, the climb through the rollout (MiB above the start at each step; *: a
    tracked step), the phases' peaks, Retain's slope and every optimizer stage against the plan."""
    lines = [
        "| schedule | MiB above the start after each SDE step (* tracked) | rollout peak | update peak "
        "| optimizer peak (plan) | slope / step (plan) |",
        "|---|---|---|---|---|---|",
    ]
    for r in curve_rows(result):
        climb = " ".join(f"{mb:.0f}{'*' if t else ''}" for mb, t in zip(r["steps_mb"], r["tracked"]))
        planned = r["plan_optimizer_peak_mb"]
        optimizer = f"{r.get('optimizer_peak_mb', float('nan')):.0f}" + (f" ({planned:.0f})" if planned else "")
        slope = f"{r['slope_mb']:.1f}" + (f" ({r['plan_slope_mb']:.1f})" if r["schedule"] == RETAIN else "")
        peaks = [f"{r.get(f'{p}_peak_mb', float('nan')):.0f}" for p in ("rollout", "update")]
        lines.append(f"| {r['schedule']} | {climb} | {peaks[0]} | {peaks[1]} | {optimizer} | {slope} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lean.tools.bench.memory_curves", description=__doc__)
    parser.add_argument("schedules_json", help="a lean bench schedules result (OUT/schedules.json)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    table = format_curves(json.loads(Path(args.schedules_json).read_text()))
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
