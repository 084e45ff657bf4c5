"""Stage ``overlap``: FlashOverlap's ops, collective vs sliced vs flash, measured on ``overlap.nproc`` processes under
Accelerate (``lean bench overlap``), next to the timeline model and its GPU projection.

    python -m pipelines.overlap [--params params.yaml] [--out outputs/overlap]

Writes OUT/bench/ (overlap.json, projection.json, gantt*.png from ``lean bench overlap``) and OUT/metrics.json
(overlap_exposed_ms_<method>: median latency - compute-only in ms, overlap_latency_ms_<method>,
overlap_model_mean_abs_error).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lean import tracking
from lean.bench.overlap_report import flat_metrics
from lean.cli import main as lean_main
from lean.outputs import write_json
from lean.workbench.stage import begin_stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default="outputs/overlap")
    args = p.parse_args()
    params = begin_stage(args.params)
    section = params.get("overlap") or {}
    out = Path(args.out)
    argv = [
        "bench",
        "overlap",
        "--nproc",
        str(section.get("nproc", 2)),
        "--out",
        str(out / "bench"),
        *[str(a) for a in section.get("args", [])],
    ]
    with tracking.start_run("overlap", params={"overlap": section}) as run:
        code = lean_main(argv)
        if code:
            raise SystemExit(f"overlap: `lean {' '.join(argv)}` exited with status {code}")
        summary = json.loads((out / "bench" / "overlap.json").read_text())
        metrics = flat_metrics(summary)
        run.log_metrics(metrics)
        run.log_artifact(out / "bench", "overlap")
    write_json(out / "metrics.json", metrics)


if __name__ == "__main__":
    main()
