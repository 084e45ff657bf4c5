"""TreeGRPO (``lean/algorithms/tree_grpo.py``): its tree advantages against a float64 transcription of the source's
recursion (zh-ding/TreeGRPO train.py, RLTrainer.sample and update_advantages, as the code index stores it), its SDE
steps and normaliser, its rollout, the float64 certificate, the preset and its plan (one iteration on flux, sd3 and
wan: tests/test_algorithms.py)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import preset_value_lines, tiny, uncited

from lean.algorithms import build_algorithm
from lean.config import ConfigError
from lean.configure import load_config

PRESET = "treegrpo-sd3"
# b = 3 at steps 0, 1 and 3 of 5 (ODE at 2 and 4): 27 leaves a tree
TREE = ["algorithm.name=tree_grpo", "sample.num_steps=5", "sample.tree.branch_points=[0, 1, 3]"]
TREE += ["sample.tree.branching=3", "train.group_size=27", "algorithm.adv_std=population", "algorithm.adv_eps=1e-8"]
# b = 2 at steps 0 and 1 of 4: 4 leaves, the tiny runs' tree
SMALL = ["algorithm.name=tree_grpo", "sample.num_steps=4", "sample.tree.branch_points=[0, 1]", "train.group_size=4"]


class Node:
    """A node of the source's tree (train.py's TreeOutput as ``sample`` fills it): its children, a leaf's reward."""

    def __init__(self, children: list[Node], reward: float | None = None):
        self.children, self.reward, self.advantage = children, reward, None


def source_tree(rewards: list[float], step: int, steps: int, points: set[int], k: int) -> Node:
    """The tree the source's pipeline grows below a node of ``step`` over the leaves ``rewards``: k children at a tree
    step, one (an ODE step) elsewhere; the leaves in the order their noises were drawn, each child's subtree next."""
    if step == steps:
        return Node([], rewards[0])
    if step not in points:
        return Node([source_tree(rewards, step + 1, steps, points, k)])
    size = len(rewards) // k
    return Node([source_tree(rewards[j * size : (j + 1) * size], step + 1, steps, points, k) for j in range(k)])


def source_update_advantages(node: Node, mean: float, std: float) -> float:
    """train.py update_advantages: a leaf's (r - mean) / std; a node keeps its children's values as its list and
    hands up their mean."""
    if not node.children:
        node.advantage = [(node.reward - mean) / std]
        return node.advantage[0]
    node.advantage = [source_update_advantages(child, mean, std) for child in node.children]
    return sum(node.advantage) / len(node.advantage)


def source_edge_targets(rewards: list[float], steps: int, points: set[int], k: int, clip: float) -> dict:
    """{(step, child's first leaf): the clamped advantage the edge trains with} of one tree, as train.py's
    ``sample`` (mean, population std + 1e-8 over the prompt's leaves) and ``treegrpo_update`` (the clamp) give it."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) + 1e-8
    root = source_tree(rewards, 0, steps, points, k)
    source_update_advantages(root, mean, std)
    out, stack = {}, [(root, 0, 0, len(rewards))]
    while stack:
        node, step, first, width = stack.pop()
        if not node.children:
            continue
        size = width // len(node.children)
        for j, (child, value) in enumerate(zip(node.children, node.advantage)):
            if step in points:  # a tree step's node: the one the update trains (its output latents, its log-probs)
                out[(step, first + j * size)] = max(-clip, min(clip, value))
            stack.append((child, step + 1, first + j * size, size))
    return out


def test_tree_advantages_are_the_sources_recursion():
    """Two trees of 27 leaves (b = 3 at steps 0, 1, 3), random rewards, a clamp that binds on some edges: every
    trained edge's target is the transcription's, and no other cell holds one."""
    clip = 0.9
    sets = ["model.size=tiny", *TREE, "train.prompts_per_iteration=2", f"algorithm.adv_clip_max={clip}"]
    cfg = load_config(None, sets)
    rewards = torch.rand(54, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grid = build_algorithm(cfg, None).targets(rewards, torch.arange(54) // 27)
    expected = torch.zeros_like(grid)
    clamped = 0
    for tree in range(2):
        edges = source_edge_targets(rewards[27 * tree : 27 * (tree + 1)].tolist(), 5, {0, 1, 3}, 3, clip)
        assert len(edges) == 3 + 9 + 27
        for (step, leaf), value in edges.items():
            expected[27 * tree + leaf, step] = value
            clamped += abs(value) == clip
    trained = torch.zeros_like(grid, dtype=torch.bool)
    trained[:, [0, 1, 3]] = True
    assert 0 < clamped < 78
    torch.testing.assert_close(grid[trained], expected[trained], rtol=0, atol=1e-12)
    assert expected[~trained].abs().sum() == 0


def test_its_sde_steps_are_the_branch_points_and_each_edge_weighs_one_over_half_the_nodes():
    """The rollout's SDE (and trained) steps are the tree's branch points, the others ODE steps; each trained edge
    weighs 1 / max(1, floor(N_u / 2)) with N_u the process's trained nodes (train.py ``train``'s accumulation)."""
    from lean.run.iteration import select_local_steps

    cfg = load_config(None, ["model.size=tiny", *TREE, "train.prompts_per_iteration=2"])
    samples = [(g, g, k) for g in range(2) for k in range(27)]
    steps = select_local_steps(cfg, 0, samples, None)
    assert steps.stochastic.tolist() == [True, True, False, True, False]
    assert int(steps.trained.sum()) == 2 * (3 + 9 + 27)  # every edge of the branch points, once
    algorithm = build_algorithm(cfg, None)
    kept, n = algorithm.kept_terms(torch.zeros(54, 5, dtype=torch.float64), steps.trained, 0)
    nodes = 2 * (1 + 3 + 9)
    assert kept is None and n * int(steps.trained[0].sum()) == nodes // 2  # 1/(N K) = 1/13


@pytest.mark.timeout(120)
def test_the_rollout_branches_on_its_sde_steps_only():
    """A tiny rollout (b = 2 at steps 0 and 1 of 4, two trees): SDE transitions at those steps only, 2 and 4 edges a
    tree, steps 2 and 3 ODE steps (the source's ``use_ode``). The training on flux, sd3 and wan:
    tests/test_algorithms.py, which runs every algorithm on each family."""
    from collections import Counter

    from lean.schedules import SCHEDULES
    from lean.tools.equivalence import StepRecorder
    from lean.train import Trainer

    recorder = StepRecorder()
    Trainer(tiny(*SMALL)).pipeline.roll_out(0, SCHEDULES["retain"], on_step=recorder)
    edges = Counter()
    for step in recorder.steps:
        edges[step.index] += len(step.rows)
    assert edges == {0: 2 * 2, 1: 2 * 4}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "family,sets",
    [("sd3", ["parallel.layout=group", "train.rollout_batch_size=4"]), ("flux", ["train.edges_per_update=3"])],
)
def test_the_certificate_passes_under_retain_and_reweight(family, sets):
    """float64: Retain's graph per trained node and Reweight's buffer per edge give Recompute's gradient (one tree a
    finishing unit on sd3; the first of the source's chunked updates, an exact hybrid, on flux), KL on."""
    from lean.tools.equivalence import passes, run_equivalence

    base = [f"model.family={family}", "model.size=tiny", "model.dtype=float64", *SMALL, "algorithm.beta=0.04"]
    cfg = load_config(None, [*base, "train.prompts_per_iteration=2", *sets])
    report = run_equivalence(cfg, reference=True)
    assert passes(report, cfg.model.torch_dtype) and not report.get("not_run")
    for schedule in ("retain", "reweight"):
        assert report[schedule]["max_rel_grad_diff"] < 1e-10
        assert report["reference"][schedule]["max_rel_grad_diff"] < 1e-10


@pytest.mark.parametrize(
    "sets,key",
    [
        (["algorithm.name=tree_grpo"], "sample.tree.branch_points"),
        ([*SMALL, "sample.sde_window=2"], "sample.sde_window"),
        ([*SMALL, "algorithm.reward_combination=per_reward"], "algorithm.reward_combination"),
        ([*SMALL, "train.group_size=8"], "train.group_size"),
    ],
)
def test_what_it_cannot_run_is_one_config_line(sets, key):
    with pytest.raises(ConfigError, match=re.escape(key)) as err:
        load_config(None, ["model.size=tiny", *sets])
    assert "\n" not in str(err.value)


def test_the_preset_cites_every_value_and_is_the_readmes_run():
    from lean.sampling.tree import tree_shape

    values = preset_value_lines(PRESET)
    assert len(values) >= 40
    assert not uncited(values, "sde_window_max_start: null")
    cfg = load_config(None, [], preset=PRESET)
    m, s, a, t, o = cfg.model, cfg.sample, cfg.algorithm, cfg.train, cfg.optimizer
    assert (m.family, m.resolution, m.full_finetune, s.num_steps, s.noise_level, s.guidance_scale) == (
        "sd3", 512, True, 10, 0.7, 4.5
    )  # fmt: skip
    assert (a.name, a.clip_range, a.adv_clip_max, a.adv_std, a.adv_eps, a.beta) == (
        "tree_grpo", 1e-4, 5.0, "population", 1e-8, 0.0
    )  # fmt: skip
    assert (t.iterations, t.prompts_per_iteration, t.group_size, t.edges_per_update) == (300, 16, 16, 30)
    assert (o.lr, o.weight_decay, o.max_grad_norm) == (1e-5, 1e-4, 1.0)
    shape = tree_shape(s)  # README: k^w = 16 images, (k^w - 1)/(k - 1) = 15 training samples a tree
    assert shape.leaves == 16 and sum(shape.live(i) for i in shape.branch_points) == 15


@pytest.mark.timeout(120)
def test_lean_plan_on_the_preset_counts_its_tree(capsys, tmp_path):
    from lean.cli import main

    shrink = ["model.size=tiny", "model.resolution=32", "model.text_max_length=8", "train.prompts_per_iteration=1"]
    assert main(["plan", "--preset", PRESET, *(a for s in shrink for a in ("--set", s)), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "111 node forwards, 15 trained nodes (retain's kept graphs), 30 trained edges" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["recompute"], ["retain"], ["reweight"])]
    assert {r[0] for r in rows} == {"recompute", "retain", "reweight"} and len(rows) >= 6
