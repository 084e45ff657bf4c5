"""Stage ``overlap``: FlashOverlap's ops, collective vs sliced vs flash, measured on ``overlap.nproc`` processes under
Accelerate (``lean bench overlap``), next to the timeline model and its GPU projection; then one GRPO iteration of
every schedule under sequence parallelism over those processes, with each method and compute-only (``lean bench
schedules`` with ``parallel.sequence_parallel``, ``lean.tools.bench.sequence_parallel``).

    python -m pipelines.overlap [--params params.yaml] [--out outputs/overlap]

Writes OUT/bench/ (overlap.json, projection.json, gantt*.png from ``lean bench overlap``), OUT/sequence_parallel/
(sequence_parallel.json, measured.jsonl) and OUT/metrics.json (overlap_exposed_ms_<method>: median latency -
compute-only in ms, overlap_latency_ms_<method>, overlap_model_mean_abs_error; sp_exposed_ms_<schedule>_<method> and
sp_time_iteration_s_<schedule>_<method>; ``measured_on``: the machine both were measured on,
``lean.observe.provenance``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lean.cli import main as lean_main
from lean.observe import tracking
from lean.observe.outputs import write_json
from lean.tools.bench.overlap_report import flat_metrics
from lean.tools.bench.sequence_parallel import flat_metrics as sequence_parallel_metrics
from lean.workbench.stage import begin_stage


def run_lean(argv: list[str]) -> None:
    code = lean_main(argv)
    if code:
        raise SystemExit(f"overlap: `lean {' '.join(argv)}` exited with status {code}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default="outputs/overlap")
    args = p.parse_args()
    params = begin_stage(args.params)
    section = params.get("overlap") or {}
    nproc = str(section.get("nproc", 2))
    sp = section.get("sequence_parallel") or {}
    out = Path(args.out)
    ops = ["bench", "overlap", "--nproc", nproc, "--out", str(out / "bench"), *map(str, section.get("args", []))]
    iteration = ["launch", "-n", nproc, "--", "bench", "schedules", "--params", "none"]  # defaults + sp.set only
    iteration += ["--repeats", str(sp.get("repeats", 3)), "--warmup", str(sp.get("warmup", 1)), "--threads", "1"]
    iteration += [a for value in [f"parallel.sequence_parallel={nproc}", *sp.get("set", [])] for a in ("--set", value)]
    iteration += ["--out", str(out / "sequence_parallel")]
    with tracking.start_run("overlap", params={"overlap": section}) as run:
        run_lean(ops)
        run_lean(iteration)
        summary = json.loads((out / "bench" / "overlap.json").read_text())
        iterations = json.loads((out / "sequence_parallel" / "sequence_parallel.json").read_text())
        metrics = flat_metrics(summary) | sequence_parallel_metrics(iterations)
        run.log_metrics(metrics)
        measured_on = iterations.get("measured_on") or summary.get("measured_on") or {}
        run.set_tags({f"lean.measured_on.{k}": v for k, v in measured_on.items()})
        run.log_artifact(out / "bench", "overlap")
        run.log_artifact(out / "sequence_parallel", "sequence_parallel")
    write_json(out / "metrics.json", {**metrics, "measured_on": measured_on})


if __name__ == "__main__":
    main()
