"""Every algorithm trains on every family from the command line, with each schedule that computes its gradient."""

from __future__ import annotations

import json
import math

import pytest
from helpers import FAST

from lean.algorithms import ALGORITHMS
from lean.cli import main
from lean.configure import load_config
from lean.schedules import algorithm_schedules


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_lean_train_runs_every_algorithm_on_every_family(algorithm, family, tmp_path):
    sets = [*FAST, f"model.family={family}", f"algorithm.name={algorithm}", "train.iterations=2"]
    schedules = algorithm_schedules(load_config(None, sets))
    assert schedules == (["recompute"] if algorithm in ("nft", "dpo") else ["recompute", "retain", "reweight"])
    for schedule in schedules[:2]:  # the baseline and, where one is exact, a Lean schedule
        out = tmp_path / schedule
        args = ["train", *(a for s in [*sets, f"train.schedule={schedule}"] for a in ("--set", s)), "--out", str(out)]
        assert main(args) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["schedule"] == schedule and all(math.isfinite(r) for r in metrics["reward_mean"])
        assert json.loads((out / "config.json").read_text())["algorithm"]["name"] == algorithm
