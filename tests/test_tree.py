"""Tree rollouts' shape (``lean.sampling.tree``) and targets (``lean.algorithms.tree_targets``), against BranchGRPO's
counts and hand arithmetic (docs/design/tree-rollouts.md, sections 1 and 2)."""

from __future__ import annotations

import math

import pytest
import torch

from lean.algorithms.tree_targets import depthwise_advantages, edge_targets, fused_rewards
from lean.config import ConfigError
from lean.configure import load_config
from lean.sampling.tree import TreeShape

BRANCHGRPO = TreeShape(num_steps=20, branch_points=(0, 3, 6, 9), branching=2)  # its launch script's tree


def test_branchgrpos_tree_has_203_forwards_218_edges_and_16_leaves():
    s = BRANCHGRPO
    assert (s.forwards, s.total_edges, s.leaves) == (203, 218, 16)
    assert [s.live(i) for i in (0, 1, 3, 4, 6, 7, 9, 10, 20)] == [1, 2, 2, 4, 4, 8, 8, 16, 16]
    flat = TreeShape(num_steps=20)
    assert (flat.forwards, flat.total_edges, flat.leaves, flat.is_flat) == (20, 20, 1, True)
    assert 16 * flat.forwards == 320


def test_parents_and_leaves_under_a_node_agree():
    s = TreeShape(num_steps=5, branch_points=(1, 2), branching=3)
    assert s.parent(0).tolist() == [0] and s.parent(1).tolist() == [0, 0, 0]
    assert s.parent(2).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and s.parent(3).tolist() == list(range(9))
    for i in range(s.num_steps):  # walking each leaf up: its node at step i is leaf // leaves_under(i)
        for leaf in range(s.leaves):
            row = leaf
            for j in reversed(range(i, s.num_steps)):
                row = int(s.parent(j)[row])
            assert row == leaf // s.leaves_under(i)


def test_mean_fusion_and_depthwise_advantages_by_hand():
    s = TreeShape(num_steps=3, branch_points=(0, 1), branching=2)  # root -> 2 -> 4 -> 4 leaves
    leaves = torch.tensor([[1.0, 3.0, 5.0, 11.0], [2.0, 2.0, 2.0, 2.0]])  # two trees; the second all equal
    rewards = fused_rewards(s, leaves)
    assert [r.shape[1] for r in rewards] == [1, 2, 4, 4]
    assert rewards[0].tolist() == [[5.0], [2.0]] and rewards[1].tolist() == [[2.0, 8.0], [2.0, 2.0]]
    advantages = depthwise_advantages(rewards)
    assert advantages[0].tolist() == [[0.0], [0.0]]  # one node at the root
    half = 1 / math.sqrt(2)  # two nodes: +-1/sqrt(2) whatever the gap (Bessel's std of two is |a - b| / sqrt(2))
    assert advantages[1][0].tolist() == pytest.approx([-half, half], rel=1e-7)
    std = torch.tensor([1.0, 3.0, 5.0, 11.0], dtype=torch.float64).std()
    assert advantages[3][0].tolist() == pytest.approx(((leaves[0].double() - 5) / (std + 1e-8)).tolist())
    assert advantages[3][1].tolist() == [0.0] * 4  # std below the floor
    targets = edge_targets(s, advantages, clip=0.5)
    assert [t.shape[1] for t in targets] == [2, 4, 4] and targets[0][0].tolist() == [-0.5, 0.5]


def test_log_prob_softmax_fusion_weighs_children_by_their_edges():
    s = TreeShape(num_steps=2, branch_points=(0,), branching=2)
    leaves = torch.tensor([[1.0, 4.0]])
    log_probs = [torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[-5.0, -1.0]])]  # step 1: no branch, unused
    rewards = fused_rewards(s, leaves, "log_prob_softmax", log_probs)
    assert rewards[1].tolist() == [[1.0, 4.0]] and rewards[0].tolist() == [[pytest.approx(0.25 * 1 + 0.75 * 4)]]


def test_tree_options_resolve_and_refuse():
    cfg = load_config(None, ["sample.num_steps=6", "sample.tree.branch_points=[0, 2]", "algorithm.name=branch_grpo"])
    assert cfg.sample.tree.shape(6) == TreeShape(6, (0, 2), 2) and load_config(None, []).sample.tree.branch_points == []
    for bad, match in [
        ("sample.tree.branch_points=[2, 2]", "must be increasing steps from 0"),
        ("sample.tree.branching=1", "must be >= 2"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="at most sample.num_steps - 2 = 4"):
        cfg.sample.tree.__class__(branch_points=[0, 5]).shape(6)


def _rollout_of(pipeline, shape: TreeShape | None, hooks=None, kappa: float = 1.0, micro_batch: int | None = None):
    """The pipeline's iteration-0 batch rolled out flat (``shape`` None) or as trees, from fresh random streams."""
    from lean.sampling.rollout import RolloutPlan, Sampler, rollout
    from lean.sampling.tree import tree_rollout

    batch = pipeline.local_batch(0)
    sampler = Sampler(pipeline.cfg.sample, pipeline.sigmas)
    plan = RolloutPlan(sampler=sampler, emb=pipeline.embed(batch), generators=batch.generators, steps=batch.steps)
    plan.micro_batch = micro_batch
    with torch.no_grad():
        if shape is None:
            return rollout(pipeline.policy, plan, hooks)
        return tree_rollout(pipeline.policy, plan, shape, hooks, kappa)


@pytest.fixture(scope="module")
def flux_pipeline():
    from helpers import tiny_preset

    from lean.train import Trainer

    # DanceGRPO's x0-prediction decode and shared initial noise; its steps not drawn per sample (trees share nodes)
    sets = ["model.dtype=float64", "sample.num_steps=6", "parallel.shard=none", "sample.timestep_selection=first"]
    sets += ["train.group_size=4"]  # two groups of 4: two trees of 4 leaves below
    return Trainer(tiny_preset("dancegrpo-flux", *sets)).pipeline


def test_a_tree_without_branches_is_the_flat_rollout_draw_for_draw(flux_pipeline):
    """Every leaf its own tree: the same forwards, noise and x0-prediction as the flat rollout, to the bit, in the
    same micro-batches."""
    for micro_batch in (None, 2):
        flat = _rollout_of(flux_pipeline, None, micro_batch=micro_batch)
        assert torch.equal(_rollout_of(flux_pipeline, TreeShape(6), micro_batch=micro_batch), flat)


def test_a_tree_shares_its_prefix_and_runs_one_forward_per_node(flux_pipeline):
    """Two trees of 4 leaves (b = 2 at steps 1 and 3): the leaves of a tree share x_0..x_1 and pairs share x_2..x_3;
    the policy runs one forward per node (1 + 1 + 2 + 2 + 4 + 4 = 14 per tree, against 24 for 4 flat trajectories), and
    each step's transitions are its edges, named by their first leaves."""
    from lean.sampling.rollout import RolloutHooks

    shape = TreeShape(6, (1, 3), 2)
    policy = flux_pipeline.policy
    forwards, seen = [], []
    original = policy.velocity

    def counted(x, *args, **kwargs):
        forwards.append(x.shape[0])
        return original(x, *args, **kwargs)

    policy.velocity = counted
    try:
        final = _rollout_of(flux_pipeline, shape, RolloutHooks(on_step=seen.append), kappa=4.0)
    finally:
        del policy.velocity
    trees = len(flux_pipeline.local_batch(0).prompts) // shape.leaves
    assert trees == 2 and final.shape[0] == 8 and torch.isfinite(final).all()
    assert sum(forwards) == trees * shape.forwards == 2 * (1 + 1 + 2 + 2 + 4 + 4)
    by_step = {s.index: s for s in seen}
    assert by_step[0].rows.tolist() == [0, 4] and by_step[1].rows.tolist() == [0, 2, 4, 6]
    assert by_step[3].rows.tolist() == list(range(8))
    siblings = by_step[1]
    assert torch.equal(siblings.sample[0], siblings.sample[1]) and not torch.equal(
        siblings.next_sample[0], siblings.next_sample[1]
    )
    assert not torch.equal(final[0], final[4])  # two trees, two roots


TREE = ["algorithm.name=branch_grpo", "sample.num_steps=6", "sample.tree.branch_points=[0, 2]", "train.group_size=4"]
TREE += ["train.prompts_per_iteration=2", "sample.timestep_selection=first"]


TREE_CASES = {  # one family each: Reweight's two backward paths and the two layouts
    "flux": ["model.full_finetune=true"],  # norms trained too: Reweight backpropagates one edge at a time
    "sd3": ["parallel.layout=group", "train.rollout_batch_size=4"],  # one tree per unit, folded as it is scored
    "wan": [],  # LoRA: each backward split by node, the siblings of a branch in rounds
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(TREE_CASES))
def test_branch_grpo_on_a_tree_passes_the_certificate(family):
    """BranchGRPO's depth-wise edge targets on a tree (b = 2 at steps 0 and 2: 4 leaves a tree), KL on: Retain's one
    graph per node and Reweight's buffer per edge give Recompute's gradient, all three the float64 twin's."""
    from lean.tools.equivalence import passes, run_equivalence

    sets = [f"model.family={family}", "model.size=tiny", "model.dtype=float64", *TREE, "algorithm.beta=0.04"]
    cfg = load_config(None, [*sets, *TREE_CASES[family]])
    report = run_equivalence(cfg, reference=True)
    assert passes(report, cfg.model.torch_dtype) and not report.get("not_run")
    for schedule in ("retain", "reweight"):
        assert report[schedule]["max_rel_grad_diff"] < 1e-10
        assert report["reference"][schedule]["max_rel_grad_diff"] < 1e-10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reweight_on_trees_on_two_sharded_processes_passes_the_certificate(tmp_path):
    """Sharded passes in lockstep (FSDP, a tree per process): Reweight's rounds per step are fixed by the tree's
    shape, so every process runs the same backwards, and its gradient is Recompute's."""
    import json

    from helpers import lean_ranks

    cfg = ["model.size=tiny", "model.dtype=float64", *TREE, "algorithm.beta=0.04", "parallel.shard=fsdp"]
    lean_ranks(2, "equivalence", *[a for v in cfg for a in ("--set", v)], "--out", str(tmp_path))
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["world_size"] == 2 and report["passes"] and report["reweight"]["max_rel_grad_diff"] < 1e-10


def test_reweights_edge_slots_name_each_trained_edge_of_a_unit_once():
    """A buffer per trained edge of a finishing unit: the tree's 20 edges (b = 2 at steps 0 and 2 over 6 steps), the
    unit's rows sharing their slots with the next unit's; a branch step's edges backpropagated in b rounds of one
    child per node (every node's k-th child), other steps in one."""
    from lean.sampling.tree import edge_cells
    from lean.schedules.edge_buffers import EdgeSlots

    shape = TreeShape(6, (0, 2), 2)
    trained = edge_cells(shape, 8)  # two trees, every step trained
    for unit, count in ((8, 40), (4, 20)):
        slots = EdgeSlots(trained, unit, shape, torch.device("cpu"))
        assert slots.count == count == unit // 4 * shape.total_edges
        assert sorted(slots.slots[:unit][trained[:unit]].tolist()) == list(range(count))
    assert torch.equal(slots.slots[4:], slots.slots[:4])  # one tree a unit: the second tree reuses the first's
    assert slots.rounds(0, 2, split_by_row=True) == [slice(0, None, 2), slice(1, None, 2)]
    assert slots.rounds(1, 2, split_by_row=True) == [slice(0, None, 1)]
    assert slots.rounds(0, 2, split_by_row=False) == [slice(0, 1), slice(1, 2)]


def test_branch_grpos_targets_sit_on_each_edges_first_leaf():
    from lean.algorithms import build_algorithm

    cfg = load_config(None, ["model.size=tiny", *TREE, "algorithm.adv_clip_max=5"])
    rewards = torch.tensor([1.0, 3.0, 5.0, 11.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    grid = build_algorithm(cfg, None).targets(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    half = 1 / math.sqrt(2)
    assert grid[[0, 2], 0].tolist() == pytest.approx([-half, half])  # step 0 branches: two edges, depth 1
    assert grid[[1, 3], 0].abs().sum() == 0  # no edge there
    std = torch.tensor([1.0, 3.0, 5.0, 11.0], dtype=torch.float64).std()
    assert grid[:4, 5].tolist() == pytest.approx(((rewards[:4] - 5) / (std + 1e-8)).tolist())  # the leaves' depth


def test_trees_are_refused_where_they_do_not_apply():
    for sets, match in [
        (
            ["sample.tree.branch_points=[0, 2]", "sample.num_steps=6"],
            "has one target per sample; a tree's are per edge",
        ),
        (["algorithm.name=branch_grpo"], "BranchGRPO rolls out trees"),
        ([*TREE, "train.group_size=8"], "a tree of this shape has 4 leaves"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, ["model.size=tiny", *sets])


def _branchgrpo_depths(options, sampling_steps: int, current_step: int) -> set[int]:
    """The tree script's pruned depths at its 1-based ``current_step`` (train_branchgrpo_flux.py:1272-1300)."""
    base_depths = sorted(options.depth_pruning)
    active = base_depths
    if options.depth_pruning_slide_interval is not None:
        stop_depth = max(options.branch_points) if options.branch_points else 0
        if options.depth_pruning_stop_depth is not None:
            stop_depth = options.depth_pruning_stop_depth
        shift_now = max(0, int(current_step // max(1, options.depth_pruning_slide_interval)))
        shift_now = min(shift_now, max(0, base_depths[0] - stop_depth))
        active = [d - shift_now for d in base_depths]
    return set(active)


def test_depth_pruning_slides_as_the_tree_script_does():
    from lean.sampling.tree import TreeOptions

    for interval, stop in [(None, None), (30, 9), (1, None), (2, 0)]:
        options = TreeOptions([0, 3, 6, 9], depth_pruning=[15, 16, 17, 18])
        options.depth_pruning_slide_interval, options.depth_pruning_stop_depth = interval, stop
        for iteration in (0, 1, 2, 28, 29, 30, 59, 150, 299):
            steps = options.pruned_steps(20, iteration).nonzero().flatten().tolist()
            depths = {d for d in _branchgrpo_depths(options, 20, iteration + 1) if d >= 1}
            assert {i + 1 for i in steps} == depths, (interval, stop, iteration)
    assert TreeOptions([0, 3, 6, 9], depth_pruning=[15, 16], depth_pruning_slide_interval=30).pruned_steps(
        20, 29
    ).tolist() == [i in (13, 14) for i in range(20)]  # step 30 = iteration 29 slides once: depths 14, 15 = steps 13, 14
    for bad, match in [
        (["sample.tree.depth_pruning=[3]"], "prunes a tree's edges: set branch_points"),
        ([*TREE, "sample.tree.depth_pruning=[7]"], "distinct depths in \\[1, sample.num_steps = 6\\]"),
        ([*TREE, "sample.tree.depth_pruning=[1, 2, 3, 4, 5]"], "fewer than 5"),
        ([*TREE, "algorithm.branch_grpo.width_pruning=best"], "must be one of none, best_per_branch, best_and_worst"),
        ([*TREE, "algorithm.branch_grpo.width_pruning_ratio=0"], "must be in \\(0, 1\\]"),
    ]:
        with pytest.raises(ConfigError, match=match):
            from lean.algorithms import check_config

            check_config(load_config(None, ["model.size=tiny", *bad]))
            tree_cfg = load_config(None, ["model.size=tiny", *bad])
            tree_cfg.sample.tree.shape(tree_cfg.sample.num_steps)


def test_depth_pruning_leaves_the_trained_mask_while_the_algorithm_prunes():
    from lean.run.iteration import local_batch

    sets = ["model.size=tiny", *TREE, "sample.tree.depth_pruning=[2, 5]", "train.iterations=4"]
    for until, pruned_at in [(1.0, [True] * 4), (0.5, [True, True, False, False])]:
        cfg = load_config(None, [*sets, f"algorithm.branch_grpo.pruning_until={until}"])
        for iteration, pruned in enumerate(pruned_at):
            trained = local_batch(cfg, iteration).steps.trained
            assert trained[0].tolist() == [True, not pruned, True, True, not pruned, False]  # the last never trains
            assert trained[1].tolist() == [False, False, True, True, not pruned, False]  # leaf 1: edges from step 2


def _branchgrpo_width(advantages: dict, last_split: int, mode: int, ratio: float) -> set:
    """The tree script's kept last-layer edges (:1340-1456) of one tree's ``advantages`` {(leaf, step): A}, the edges
    in its depth-first order (each leaf's chain, steps ascending: ``collect_all_transitions``, :1199-1220)."""
    layer = [{"leaf": leaf, "step": step, "advantage": a} for (leaf, step), a in sorted(advantages.items())]
    layer = [s for s in layer if s["step"] > last_split]
    if mode == 1:
        kept = []
        for leaf in sorted({s["leaf"] for s in layer}):
            group = [s for s in layer if s["leaf"] == leaf]
            keep_count = max(1, int(len(group) * ratio))
            kept += sorted(group, key=lambda x: x["advantage"], reverse=True)[:keep_count]
    else:
        ranked = sorted(layer, key=lambda x: x["advantage"], reverse=True)
        keep_count = max(2, int(len(ranked) * ratio))
        best_count = keep_count // 2
        worst_count = keep_count - best_count
        kept = ranked[:best_count] + (ranked[-worst_count:] if worst_count > 0 else [])
    return {(s["leaf"], s["step"]) for s in kept}


@pytest.mark.parametrize("ties", [False, True])
def test_width_pruning_keeps_the_tree_scripts_edges(ties):
    """Against a transcription of the tree script, on two trees of 4 leaves with a pruned depth: random targets, and
    targets equal along each chain (as depth-wise advantages below the last branch are) so the ties' order counts."""
    from lean.algorithms.branch_grpo import width_pruned

    shape = TreeShape(9, (0, 2), 2)
    generator = torch.Generator().manual_seed(0)
    targets = torch.randn(8, 9, generator=generator, dtype=torch.float64)
    if ties:
        targets = torch.randn(8, 1, generator=generator, dtype=torch.float64).round(decimals=0).expand(8, 9).clone()
    trained = torch.ones(8, 9, dtype=torch.bool)
    trained[:, 8] = False  # lean never trains the last step
    trained[:, 5] = False  # a pruned depth (6)
    for mode, name in [(1, "best_per_branch"), (2, "best_and_worst")]:
        for ratio in (0.5, 0.3, 1.0, 0.01):
            kept = width_pruned(shape, targets, trained, name, ratio)
            assert torch.equal(kept[:, :3], trained[:, :3])  # up to the last branch point: untouched
            for tree in range(2):
                cells = {(leaf, i): float(targets[tree * 4 + leaf, i]) for leaf in range(4) for i in range(9)}
                expected = _branchgrpo_width(
                    {c: a for c, a in cells.items() if trained[tree * 4 + c[0], c[1]]}, 2, mode, ratio
                )
                got = {(leaf, i) for leaf in range(4) for i in range(3, 9) if kept[tree * 4 + leaf, i]}
                assert got == expected, (mode, ratio, tree)


def test_width_pruning_keeps_cells_and_counts_them_in_the_normaliser_while_it_applies():
    from lean.algorithms import build_algorithm

    sets = ["model.size=tiny", *TREE, "train.iterations=4", "algorithm.branch_grpo.width_pruning=best_per_branch"]
    cfg = load_config(None, [*sets, "algorithm.branch_grpo.pruning_until=0.5"])
    algorithm = build_algorithm(cfg, None)
    rewards = torch.tensor([1.0, 3.0, 5.0, 11.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    grid = algorithm.targets(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    from lean.run.iteration import local_batch

    trained = local_batch(cfg, 0).steps.trained  # steps 0..4; below the last branch (step 2): steps 3 and 4
    kept, n = algorithm.kept_terms(grid, trained, iteration=1)
    assert torch.equal(kept[:, :3], trained[:, :3]) and kept[:, 3].all() and not kept[:, 4].any()  # ties: earlier
    assert n == pytest.approx(8 * int(kept.sum()) / int(trained.sum()))  # 1/(n K): kept edges weigh more
    assert algorithm.kept_terms(grid, trained, iteration=2) == (None, 8)  # iteration 3 > int(4 x 0.5): no pruning


@pytest.mark.timeout(240)
def test_branch_grpo_with_pruning_passes_the_certificate():
    """Depth and width pruning on tiny flux (b = 2 at steps 0 and 2, depth 2 pruned, the best and worst of each
    tree's last layer kept): Retain backpropagates the kept edges of its candidates' graphs, Reweight folds only the
    kept edges' buffers, Recompute recomputes the kept edges; all three give the float64 twin's gradient at 1e-10."""
    from lean.tools.equivalence import passes, run_equivalence

    pruning = ["algorithm.branch_grpo.width_pruning=best_and_worst", "algorithm.branch_grpo.width_pruning_ratio=0.3"]
    pruning += ["sample.tree.depth_pruning=[2]"]
    layout = ["parallel.layout=group", "train.rollout_batch_size=4"]  # Reweight folds each tree's kept edges as scored
    cfg = load_config(None, ["model.size=tiny", "model.dtype=float64", *TREE, "algorithm.beta=0.04", *pruning, *layout])
    report = run_equivalence(cfg, reference=True)
    assert passes(report, cfg.model.torch_dtype)
    for schedule in ("recompute", "retain", "reweight"):  # Reweight folds the pruned edges' buffers with weight 0
        assert report["reference"][schedule]["max_rel_grad_diff"] < 1e-10
