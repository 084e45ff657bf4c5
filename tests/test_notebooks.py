"""The notebooks: each .ipynb is in sync with its reviewed py:percent source, has a papermill `parameters` cell, and
runs top to bottom through papermill on the smoke pipeline's outputs, logging its metrics and figures to MLflow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ("speedup", "equivalence", "training", "overlap")
REQUIRED = {
    "speedup": (
        "speedup_retain",
        "speedup_reweight",
        "speedup_bound_retain",
        "mfu_recompute",
        "mfu_retain",
        "mfu_reweight",
        "hfu_retain",
        "peak_memory_mb_reweight",
    ),
    "equivalence": (
        "max_rel_grad_diff_retain",
        "max_rel_grad_diff_reweight",
        "equivalence_passes",
        "bf16_passes",
        "bf16_rel_l2_retain",
        "bf16_clipped_fraction",
    ),
    "training": ("reward_final_recompute", "reward_gain_retain", "max_reward_curve_diff"),
    "overlap": ("overlap_hidden_fraction_flash", "overlap_hidden_fraction_collective"),
}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_paired_with_its_source(name):
    import jupytext
    import nbformat

    source = jupytext.read(ROOT / "notebooks" / f"{name}.py")
    notebook = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    assert [(c.cell_type, c.source) for c in source.cells] == [(c.cell_type, c.source) for c in notebook.cells], (
        f"notebooks/{name}.ipynb is out of sync: run `jupytext --sync notebooks/{name}.py`"
    )
    assert notebook.metadata["jupytext"]["formats"] == "ipynb,py:percent"
    tagged = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and "outputs =" in tagged[0].source
    assert not any(c.get("outputs") for c in notebook.cells if c.cell_type == "code"), "commit notebooks stripped"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_through_papermill(name, tmp_path, tmp_path_factory):
    import papermill
    from mlflow.tracking import MlflowClient
    from test_workbench import smoke_repo

    outputs = smoke_repo(tmp_path_factory.mktemp("smoke"))["outputs"]
    summary_path = tmp_path / f"{name}.json"
    papermill.execute_notebook(
        str(ROOT / "notebooks" / f"{name}.ipynb"),
        str(tmp_path / f"{name}.ipynb"),
        cwd=str(ROOT / "notebooks"),
        progress_bar=False,
        parameters={"outputs": str(outputs), "track": True, "summary_path": str(summary_path)},
    )
    summary = json.loads(summary_path.read_text())
    missing = [k for k in REQUIRED[name] if k not in summary["metrics"]]
    assert not missing
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])  # the test's own store (tests/conftest.py)
    run = client.get_run(summary["run_id"])
    assert run.data.tags["lean.notebook"] == name and set(REQUIRED[name]) <= set(run.data.metrics)
    assert [a.path for a in client.list_artifacts(summary["run_id"], "figures")]
