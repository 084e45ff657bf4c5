"""Stage ``bench_schedules``: the schedules timed interleaved (``lean.tools.bench.schedules.bench_schedules``), with the
analytic prediction of ``lean.plan.cost`` from the same process.

    python -m pipelines.bench [--params params.yaml] [--out outputs/bench]

The config is ``lean bench schedules``' own (``lean.tools.bench.schedules.bench_config``: the run sections, then the
``bench`` section's ``run:``), with random weights: timing does not depend on them, and the bench's model size need
not be the base's.

Writes OUT/schedules.json (per-phase medians, peak memory, FLOPs, MFU/HFU, speedup and its bound), OUT/plan.json,
OUT/metrics.json (flat: speedup_<s>, speedup_bound_<s>, mfu_<s>, hfu_<s>, peak_memory_mb_<s>; and ``measured_on``, the
machine the figures were measured on: ``lean.observe.provenance``) and OUT/phases.csv.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lean.observe import tracking
from lean.observe.outputs import numbers, write_csv, write_json
from lean.schedules import SCHEDULES
from lean.tools.bench.schedules import PHASES, bench_config, bench_schedules, flat_metrics
from lean.workbench.stage import begin_stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default="outputs/bench")
    args = p.parse_args()
    begin_stage(args.params)
    cfg, options = bench_config(args.params)
    out = Path(args.out)
    with tracking.start_run("bench_schedules", params=cfg.to_dict()) as run:
        result = bench_schedules(cfg, out=str(out), options=options)
        metrics = flat_metrics(result)
        run.log_metrics(metrics)
        run.set_tags({f"lean.measured_on.{k}": v for k, v in result["measured_on"].items()})
        for s in SCHEDULES:
            with run.child(f"bench[{s}]", schedule=s) as child:
                child.log_metrics(numbers(result[s]))
                child.log_metrics({f"predicted_{k}": v for k, v in result["plan"]["prediction"][s].items()})
    write_json(out / "plan.json", result["plan"])
    write_json(out / "metrics.json", {**metrics, "measured_on": result["measured_on"]})
    write_csv(out / "phases.csv", [{"schedule": s, **{k: result[s].get(k, 0.0) for k in PHASES}} for s in SCHEDULES])


if __name__ == "__main__":
    main()
