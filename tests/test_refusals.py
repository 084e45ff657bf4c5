"""What a refusal suggests runs (issue #60): every refusal that names values carries them as overrides
(``ConfigError.fix``), and the refused config with them applied is not refused on that key again; every registered
algorithm runs on params.yaml's defaults, or its one-line refusal holds a whole ``lean train`` command that runs."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from helpers import lean_here

from lean.algorithms import ALGORITHMS
from lean.config import ConfigError, read_config
from lean.configure import validate

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
TREE = ["algorithm.name=branch_grpo", "sample.timestep_selection=first"]
# (overrides on params.yaml, processes): each is refused with a suggestion
REFUSED = {
    "a misspelt choice": (["train.schedule=retian"], 1),
    "BranchGRPO without a tree": (["algorithm.name=branch_grpo"], 1),
    "BranchGRPO's published points on 10 steps": ([*TREE, "sample.tree.branch_points=[0,3,6,9]"], 1),
    "a tree's leaves": ([*TREE, "sample.tree.branch_points=[0,3]", "train.group_size=8"], 1),
    "GARDO's rewards": (["algorithm.name=gardo"], 1),
    "FlowGRPO's filter order under a hybrid": (
        [
            "train.schedule=retain",
            "train.optimizer_steps_per_iteration=2",
            "algorithm.skip_zero_advantage=true",
            "algorithm.zero_advantage_order=filter_then_split",
        ],
        1,
    ),
    "Reweight under a sharded full fine-tune": (
        ["parallel.shard=fsdp", "model.full_finetune=true", "train.schedule=reweight"],
        2,
    ),
    "Reweight with a sync per backward": (["parallel.grad_sync=per_backward", "train.schedule=reweight"], 2),
    "Retain's keys under another schedule": (["train.schedule=recompute", "train.retain.offload=host"], 1),
    "edges per update on a flat rollout": (["train.edges_per_update=12"], 1),
    "a tree in the shared layout": (
        [*TREE, "sample.tree.branch_points=[0,3]", "parallel.layout=shared"],
        1,
    ),
}


def refusal(overrides: list[str], processes: int) -> ConfigError | None:
    try:
        validate(read_config(PARAMS, overrides), world_size=processes)
    except ConfigError as err:
        return err
    return None


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refusals_suggestion_passes_on_its_key(case):
    overrides, processes = REFUSED[case]
    err = refusal(overrides, processes)
    assert err is not None and err.fix, (case, err)
    again = refusal([*overrides, *err.fix], processes)
    assert again is None or again.key != err.key, (case, str(err), str(again))


def test_every_algorithm_runs_on_the_defaults_or_says_the_whole_command():
    commands = {}
    for name in ALGORITHMS:
        err = refusal([f"algorithm.name={name}"], 1)
        if err is None:
            continue
        line = str(err)
        assert "\n" not in line and "lean train --set" in line, line
        words = shlex.split(line.split("it runs with: ", 1)[1].rsplit(" (algorithm.name=", 1)[0])
        sets = [w for prev, w in zip(words, words[1:]) if prev == "--set"]
        assert f"algorithm.name={name}" in sets and refusal(sets, 1) is None, (name, sets)
        commands[name] = sets
    assert set(commands) == {"branch_grpo", "gardo", "tempflow_grpo", "tree_grpo"}  # defaults: their own recipe's


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["branch_grpo", "gardo", "tempflow_grpo", "tree_grpo"])
def test_the_refusals_command_trains(name, tmp_path, monkeypatch):
    monkeypatch.chdir(PARAMS.parent)  # lean train reads ./params.yaml, as a user's does
    line = str(refusal([f"algorithm.name={name}"], 1))
    words = shlex.split(line.split("it runs with: ", 1)[1].rsplit(" (algorithm.name=", 1)[0])
    assert words[:2] == ["lean", "train"]
    lean_here(*words[1:], "--set", "train.iterations=1", "--set", "eval.every=0", "--out", str(tmp_path))
    assert (tmp_path / "metrics.csv").exists()


@pytest.mark.parametrize(
    "args,key",
    [
        (["bench", "memory", "--layouts", "group,sharde"], "--layouts"),  # checked before anything is built
        (["equivalence", "--against", "no/such/gradients.safetensors"], "--against"),
        (["train", "--set", "parallel.grad_sync=per_step"], "parallel.grad_sync"),
        (["train", "--set", "parallel.replicas=0"], "parallel.replicas"),
    ],
)
def test_the_new_options_refuse_nonsense_in_one_line(args, key, capsys):
    from lean.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err
