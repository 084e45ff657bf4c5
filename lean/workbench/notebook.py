"""What a workbench notebook logs: its own MLflow run (nested under the report stage's), figures and metrics."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from lean.observe import tracking
from lean.observe.outputs import write_json


class NotebookLog:
    """A notebook's MLflow run (nested under the report stage's run when that passes ``parent_run_id``), its figures
    and metrics, and the JSON summary (``{"notebook", "run_id", "metrics"}``) the report stage collects."""

    def __init__(self, name: str, track: bool = True, parent_run_id: str | None = None):
        tracking.configure(enabled=track)
        self.name, self.metrics = name, {}
        parent = tracking.attach(parent_run_id) if parent_run_id else None
        self.run = tracking.start_run(f"notebook[{name}]", stage="report", parent=parent, tags={"lean.notebook": name})
        self.run_id = self.run.run_id

    def figure(self, figure, filename: str) -> None:
        self.run.log_figure(figure, filename)

    def log(self, metrics: Mapping[str, float]) -> None:
        self.metrics.update({k: float(v) for k, v in metrics.items()})
        self.run.log_metrics(metrics)

    def close(self, summary_path: str | Path | None = None) -> dict:
        summary = {"notebook": self.name, "run_id": self.run_id, "metrics": self.metrics}
        if summary_path:
            write_json(summary_path, summary)
        self.run.finish()
        return summary
