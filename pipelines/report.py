"""Stage ``report``: papermill executes the notebooks on the pipeline's outputs; each notebook logs its figures and
metrics to its own MLflow run (nested under this stage's run), and the executed copy is added to that run.

    python -m pipelines.report [--params params.yaml] [--outputs outputs] [--out outputs/report]

Writes OUT/notebooks/<name>.ipynb (executed), OUT/notebooks/<name>.json (the notebook's metrics and run id) and
OUT/metrics.json (every notebook's metrics, flat).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lean import tracking
from lean.outputs import write_json
from lean.workbench.stage import begin_stage

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--outputs", default="outputs", help="the pipeline's outputs, which the notebooks read")
    p.add_argument("--out", default="outputs/report")
    args = p.parse_args()
    import papermill

    params = begin_stage(args.params)
    section = params.get("report") or {}
    out = Path(args.out) / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    with tracking.start_run("report", params={"report": section}) as run:
        for name in section.get("notebooks", []):
            executed, summary_path = out / f"{name}.ipynb", out / f"{name}.json"
            papermill.execute_notebook(
                str(NOTEBOOKS / f"{name}.ipynb"),
                str(executed),
                cwd=str(NOTEBOOKS),
                progress_bar=False,
                parameters={
                    "outputs": str(Path(args.outputs).resolve()),
                    "track": tracking.enabled(),
                    "parent_run_id": run.run_id,
                    "summary_path": str(summary_path.resolve()),
                },
            )
            summary = json.loads(summary_path.read_text())
            tracking.attach(summary["run_id"]).log_artifact(executed, "notebook")
            metrics.update(summary["metrics"])
            print(f"report: {name}: {len(summary['metrics'])} metrics", flush=True)
        run.log_metrics(metrics)
    write_json(Path(args.out) / "metrics.json", metrics)


if __name__ == "__main__":
    main()
