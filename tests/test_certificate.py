"""The certificate in half precision: every schedule against the float64 on-policy gradient of its own
trajectories, and what rounding does to the baseline's clipped surrogate."""

from __future__ import annotations

import pytest
from helpers import reference_gap, tiny

from lean.config import ConfigError
from lean.schedules import BASELINE, LEAN_SCHEDULES
from lean.tools.equivalence import half_tolerance, passes, run_equivalence


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_bfloat16_lean_schedules_match_the_float64_reference(family):
    cfg = tiny(f"model.family={family}", "model.dtype=bfloat16")
    report = run_equivalence(cfg)
    rel_tol, cos_tol = half_tolerance(report["rounding"]["forward_error"])
    for s in LEAN_SCHEDULES:
        assert report["reference"][s]["rel_norm_diff"] <= rel_tol and report["reference"][s]["cosine"] >= 1 - cos_tol
    assert passes(report, cfg.model.torch_dtype)
    if family == "flux":  # rounding alone moves the baseline's ratio out of the clip range, and the clip drops terms
        rounding = report["rounding"]
        assert rounding["ratio_max_dev"] > cfg.algorithm.clip_range and rounding["rounding_clipped_fraction"] > 0
        assert rounding["clipped_gradient_norm_fraction"] > 0.1
        assert report["reference"][BASELINE]["rel_norm_diff"] > rel_tol  # the baseline is off the objective


@pytest.mark.timeout(120)
def test_in_float64_every_schedule_is_the_reference():
    report = run_equivalence(tiny("model.dtype=float64", "algorithm.beta=0.04"))
    assert reference_gap(report) < 1e-10
    assert report["rounding"]["ratio_max_dev"] < 1e-12 and report["rounding"]["rounding_clipped_fraction"] == 0


@pytest.mark.timeout(240)
def test_recomputing_like_the_rollout_removes_the_drift():
    """The same micro-batches and CFG batch as the rollout: on a CPU the recomputed log-probs are the rollout's to
    the last bit, so the ratio is exactly 1 and the baseline lands on the reference too."""
    cfg = tiny("model.dtype=bfloat16", "train.recompute_batching=rollout")
    report = run_equivalence(cfg)
    assert report["rounding"]["ratio_max_dev"] == 0 and report["rounding"]["rounding_clipped_fraction"] == 0
    assert report["reference"][BASELINE]["rel_norm_diff"] <= half_tolerance(report["rounding"]["forward_error"])[0]


def test_recomputing_like_the_rollout_is_on_policy_only():
    with pytest.raises(ConfigError, match="train.recompute_batching.*optimizer_steps_per_iteration"):
        tiny("train.recompute_batching=rollout", "train.optimizer_steps_per_iteration=2")
