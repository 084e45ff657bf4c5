"""Stage ``bench_schedules``: Recompute vs Retain vs Reweight timed interleaved (``lean.bench.bench_schedules``), and
the analytic prediction of ``lean.plan`` from the same trainer.

    python -m pipelines.bench [--params params.yaml] [--out outputs/bench]

The config is ``lean bench schedules``' own (``lean.bench.bench_config``: the run sections, then the ``bench`` section's
``run:``), with random weights: timing does not depend on them, and the bench's model size need not be the base's.

Writes OUT/schedules.json (per-phase medians, peak memory, FLOPs, MFU/HFU, speedup and its bound), OUT/plan.json,
OUT/metrics.json (flat: speedup_<s>, speedup_bound_<s>, mfu_<s>, hfu_<s>, peak_memory_mb_<s>) and OUT/phases.csv.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lean import tracking, workbench
from lean.bench import PHASES, SCHEDULE_ORDER, bench_config, bench_schedules
from lean.plan import predict, probe
from lean.train import Trainer


def flat_metrics(result: dict) -> dict[str, float]:
    """The numbers a comparison needs, one flat key each."""
    out = {}
    for s in SCHEDULE_ORDER:
        e = result[s]
        out.update({f"mfu_{s}": e["mfu"], f"hfu_{s}": e["hfu"], f"peak_memory_mb_{s}": e["peak_memory_mb"],
                    f"time_iteration_s_{s}": e["time_iteration_s"]})
        if "speedup" in e:
            out.update({f"speedup_{s}": e["speedup"], f"speedup_bound_{s}": e["speedup_bound"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default="outputs/bench")
    args = p.parse_args()
    workbench.begin_stage(args.params)
    cfg, opts = bench_config(args.params)
    out = Path(args.out)
    trainer = Trainer(cfg)
    with tracking.start_run("bench_schedules", params=cfg.to_dict()) as run:
        result = bench_schedules(cfg, out=str(out), repeats=opts.repeats, warmup=opts.warmup, trainer=trainer,
                                 threads=opts.threads)
        measured = probe(trainer)
        plan = {"probe": measured, "prediction": predict(trainer, measured)}
        metrics = flat_metrics(result)
        run.log_metrics(metrics)
        for s in SCHEDULE_ORDER:
            with run.child(f"bench[{s}]", schedule=s) as child:
                child.log_metrics(workbench.numbers(result[s]))
                child.log_metrics({f"predicted_{k}": v for k, v in plan["prediction"][s].items()})
    workbench.write_json(out / "plan.json", plan)
    workbench.write_json(out / "metrics.json", metrics)
    workbench.write_csv(out / "phases.csv", [{"schedule": s, **{k: result[s].get(k, 0.0) for k in PHASES}}
                                             for s in SCHEDULE_ORDER])


if __name__ == "__main__":
    main()
