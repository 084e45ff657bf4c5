"""The notebooks: each .ipynb is in sync with its reviewed py:percent source, has a papermill `parameters` cell, and
runs top to bottom through papermill on the smoke pipeline's outputs, logging its metrics and figures to MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ("speedup", "equivalence", "training", "overlap", "paper")
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
    "training": (
        "reward_final_recompute",
        "reward_gain_retain",
        "max_reward_curve_diff",
        "eval_reward_gain_recompute",
        "eval_reward_first_retain",
        "eval_reward_last_reweight",
        "eval_reward_noise_std",
        "eval_learning_passes",
        "time_to_reward_recipe_recompute",  # the recipe (2 updates per rollout), its exact hybrid, the on-policy form
        "time_to_reward_recipe_retain",
        "time_to_reward_retain",
        "time_to_reward_reweight",
        "time_to_reward_branch_grpo",  # the algorithms side by side, the tree's and the clean-sample update's too
        "eval_reward_gain_awm",
    ),
    "overlap": ("overlap_exposed_ms_flash", "overlap_exposed_ms_collective", "sp_exposed_ms_reweight_collective"),
    "paper": (
        "ablation_vs_paper_lora_retain",  # Table 1's rows beside the paper's
        "ablation_vs_paper_full_finetune_reweight",
        "sweep_speedup_retain_1.0",  # Fig. 3
        "memory_slope_vs_plan_retain",  # Fig. 6
        "optimizer_peak_vs_plan_recompute",
        "alignment_flux-bfloat16_retain_bitwise",  # App. E
        "alignment_wan-float32_reweight_gradient_rel_l2",
    ),
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


@pytest.mark.xdist_group("smoke")  # the session's smoke pipeline (tests/test_workbench.py), built once
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_through_papermill_in_the_report_stage(name, tmp_path_factory):
    """The smoke pipeline's report stage executed the notebook with papermill on the stages' outputs: the executed
    copy has every cell run without an error, its summary holds the notebook's metrics, and its MLflow run in the
    smoke server carries them with its figures and the executed notebook."""
    import nbformat
    from test_workbench import smoke_repo

    smoke = smoke_repo(tmp_path_factory.mktemp("smoke"))
    executed = smoke["outputs"] / "report" / "notebooks"
    notebook = nbformat.read(executed / f"{name}.ipynb", as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code)
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    summary = json.loads((executed / f"{name}.json").read_text())
    assert [k for k in REQUIRED[name] if k not in summary["metrics"]] == []
    run = smoke["notebook_runs"][name]
    assert set(REQUIRED[name]) <= set(run["metrics"]) and run["run_id"] == summary["run_id"]
    assert any(a.startswith("figures/") for a in run["artifacts"]) and f"notebook/{name}.ipynb" in run["artifacts"]
