"""Stage ``bench_presets@<preset>`` (frozen: ``make bench`` measures it): one published recipe, shrunk to a CPU, as
``lean bench schedules --preset <preset>`` measures it (``lean.tools.bench.schedules.bench_recipe``): Recompute and
the exact hybrids on the recipe (2 updates per rollout), and the three schedules on its on-policy form, interleaved,
on one core, each Lean schedule against its own bound.

    python -m pipelines.bench_preset --preset flowgrpo-sd3 [--params params.yaml] [--out outputs/bench/presets/P]

The config is the preset alone (not params.yaml's run sections), then ``bench_presets.set`` (the CPU size shared by
every preset) and ``bench_presets.runs.<preset>`` (its own shrink). Writes OUT/recipe.json (both forms' medians and
the per-sample table, ``lean.tools.bench.schedules.recipe_rows``), OUT/{recipe,on_policy}/schedules.json and
OUT/metrics.json (flat: ``speedup_<form>_<schedule>``, ``speedup_vs_bound_<form>_<schedule>``, ...).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lean.observe import tracking
from lean.observe.outputs import write_json
from lean.tools.bench.schedules import bench_config, bench_recipe, recipe_metrics
from lean.workbench.stage import begin_stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--preset", required=True)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    section = begin_stage(args.params)["bench_presets"]
    out = Path(args.out or f"outputs/bench/presets/{args.preset}")
    sets = [*section.get("set", []), *(section["runs"][args.preset] or [])]
    options = {k: section[k] for k in ("repeats", "warmup", "threads", "cores", "flops") if k in section}
    cfg, options = bench_config(None, sets, preset=args.preset, **options)
    with tracking.start_run(f"bench_presets[{args.preset}]", params=cfg.to_dict()) as run:
        report = bench_recipe(cfg, out=str(out), options=options)
        metrics = recipe_metrics(report)
        run.log_metrics(metrics)
        run.set_tags({f"lean.measured_on.{k}": v for k, v in report["measured_on"].items()})
    write_json(out / "metrics.json", {**metrics, "measured_on": report["measured_on"]})


if __name__ == "__main__":
    main()
