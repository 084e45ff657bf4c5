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

# the schedules that compute each algorithm's gradient exactly (the others: all three)
EXACT = {"nft": ["recompute"], "dpo": ["recompute"], "awm": ["recompute"]}
# what an algorithm needs of the run: TempFlow-GRPO a shared x_T per group; BranchGRPO and TreeGRPO a tree (b = 2
# at step 0 of FAST's steps: two leaves a group); GARDO the rewards its advantage, gate and diversity read (the tiny
# run's own in the script's roles), and its KL term on
OWN_ROLLOUT = {
    "tempflow_grpo": ["sample.init_same_noise=true"],  # a group's branches leave one trunk: one x_T per group
    "branch_grpo": ["sample.tree.branch_points=[0]", "train.group_size=2", "sample.timestep_selection=first"],
    "e_grpo": ["algorithm.e_grpo.steps=[1,2]"],  # its source's [1, 2, 3] needs 5 steps; FAST has 4
    "tree_grpo": ["sample.tree.branch_points=[0]", "train.group_size=2"],  # TreeGRPO: its SDE step is the branch
    "gardo": [
        "reward.weights={color_match: 1.0, jpeg_compressibility: 0.1, position_match: 0.1, diversity: 0.0}",
        "algorithm.gardo.main_reward=color_match",
        "algorithm.gardo.gate_rewards=[jpeg_compressibility, position_match]",
        "algorithm.beta=0.04",
    ],
}


FAMILIES = ("flux", "sd3", "wan")


def every_algorithm_on_every_family() -> list:
    """(algorithm, family) for every pair: each algorithm on one family in `make test` (the families in turn, so each
    trains four or five of them), its other two families `matrix` cases (`make test-full`)."""
    return [
        pytest.param(algorithm, family, marks=() if j == i % len(FAMILIES) else pytest.mark.matrix)
        for i, algorithm in enumerate(ALGORITHMS)
        for j, family in enumerate(FAMILIES)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm,family", every_algorithm_on_every_family())
def test_lean_train_runs_every_algorithm_on_every_family(algorithm, family, tmp_path):
    sets = [*FAST, f"model.family={family}", f"algorithm.name={algorithm}", "train.iterations=2"]
    sets += OWN_ROLLOUT.get(algorithm, [])
    schedules = algorithm_schedules(load_config(None, sets))
    assert schedules == EXACT.get(algorithm, ["recompute", "retain", "reweight"])
    for schedule in schedules[:2]:  # the baseline and, where one is exact, a Lean schedule
        out = tmp_path / schedule
        args = ["train", *(a for s in [*sets, f"train.schedule={schedule}"] for a in ("--set", s)), "--out", str(out)]
        assert main(args) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["schedule"] == schedule and all(math.isfinite(r) for r in metrics["reward_mean"])
        assert json.loads((out / "config.json").read_text())["algorithm"]["name"] == algorithm
