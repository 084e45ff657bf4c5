"""``lean plan`` on a tree rollout (docs/design/tree-rollouts.md, sections 4 and 7.5): it counts nodes, not leaves x
steps; Retain keeps one graph per trained node, so a tree's measured peak is the plan's and below the flat rollout's
with as many leaves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny

from lean.plan.cost import rollout_rows, tree_rows
from lean.sampling.sde import StepSelection
from lean.schedules import IterationCosts, Recompute, Retain, RowCounts

# b = 2 over 4 branch points on 6 steps, one tree of 16 leaves, every trainable step trained (lean never trains the
# last): 1 + 2 + 4 + 8 + 16 + 16 = 47 node forwards, 31 trained nodes, 46 trained edges, against 96 forwards and 80
# trained for 16 flat trajectories. 128 px and CFG's unconditional half tracked (uncond_grad), so that the kept graphs
# (31 x ~1.9 MiB) outweigh the decode of the 16 leaves (~50 MiB) and stand well above the allocator's noise
SHAPE = ["model.resolution=128", "model.text_max_length=8", "sample.num_steps=6", "sample.timestep_fraction=1.0"]
SHAPE += ["train.group_size=16", "train.prompts_per_iteration=1", "train.rollout_batch_size=16"]
SHAPE += ["train.train_batch_size=16", "sample.uncond_grad=true"]
TREE = ["algorithm.name=branch_grpo", "sample.tree.branch_points=[0, 1, 2, 3]"]

COSTS = IterationCosts(
    n=6, k=5, local=16, f=1.0, fb=3.0, fb_one=0.5, ref=0.0, score=2.0, base_mb=100, act_mb=16, act_one_mb=1,
    transient_mb=10, decode_mb=20, trainable_mb=1, train_rows_fraction=1.0, kl=False, per_row_grads=True,
)  # fmt: skip


def _selection(cfg, trained_steps: int) -> StepSelection:
    """Every trained cell of a tree of ``cfg``'s shape, as ``lean.run.iteration.on_tree`` marks them."""
    from lean.run.iteration import on_tree

    n, local = cfg.sample.num_steps, cfg.train.group_size * cfg.train.prompts_per_iteration
    trained = torch.zeros(local, n, dtype=torch.bool)
    trained[:, :trained_steps] = True
    return on_tree(cfg, StepSelection(stochastic=torch.ones(n, dtype=torch.bool), trained=trained), 0)


def _rows(cfg, trained_steps: int) -> RowCounts | None:
    steps = _selection(cfg, trained_steps)
    return tree_rows(cfg, steps, len(steps.trained))


def test_the_plan_counts_a_trees_nodes_and_edges():
    assert _rows(tiny(*SHAPE, *TREE), 5) == RowCounts(47, 31, 46, 16)
    two = tiny(*SHAPE, *TREE, "train.prompts_per_iteration=2", "sample.timestep_fraction=0.5")  # steps 0-2 trained
    assert _rows(two, 3) == RowCounts(2 * 47, 2 * (1 + 2 + 4), 2 * (2 + 4 + 8), 32)
    # BranchGRPO's launch script, every edge trained (section 1.1)
    recipe = tiny("sample.num_steps=20", "sample.tree.branch_points=[0, 3, 6, 9]", "train.group_size=16", *TREE[:1])
    assert _rows(dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, prompts_per_iteration=1)), 20) == (
        RowCounts(203, 203, 218, 16)
    )
    assert _rows(tiny(*SHAPE), 5) is None  # flat: B n and B K, as before
    # the probe measures a rollout micro-batch: whole trees on a tree
    assert rollout_rows(tiny(*SHAPE, *TREE, "train.rollout_batch_size=4"), 32) == 16
    assert rollout_rows(tiny(*SHAPE, "train.rollout_batch_size=4"), 32) == 4


def test_a_trees_predictions_scale_with_its_nodes_and_the_flat_ones_do_not_move():
    tree = dataclasses.replace(COSTS, rows=RowCounts(47, 31, 46, 16))
    flat = dataclasses.replace(COSTS, rows=RowCounts(96, 80, 80, 16))  # the flat counts, spelled out
    for schedule in (Retain, Recompute):
        assert schedule.predict(flat) == schedule.predict(COSTS)  # rows=None is the flat rollout, to the bit
    retain = Retain.predict(tree)
    assert retain.peak_memory_mb == 100 + 31 / 16 * 16 + 20  # one graph per trained node: 31 rows of act / 16
    assert retain.time_iteration_s == pytest.approx((47 - 31) / 16 * 1.0 + 31 / 16 * 3.0 + 2.0)
    # Recompute: every node's forward in the rollout, every trained edge recomputed (recompute_terms)
    assert Recompute.predict(tree).time_iteration_s == pytest.approx(47 / 16 * 1.0 + 2.0 + 46 / 16 * 3.0)


def _retain_peak(cfg, plan: bool) -> dict:
    """One Retain iteration's measured peak (live bytes, as the bench and ``lean plan``'s probe measure on a CPU) and,
    with ``plan``, ``lean plan``'s prediction of it (probed after the iteration: its lazily loaded parts are base)."""
    from lean.observe.metrics import live_bytes_heap
    from lean.plan.cost import iteration_costs, predict, probe
    from lean.train import Trainer

    trainer = Trainer(cfg)
    with live_bytes_heap():
        measured = trainer.iteration(0, "retain").metrics
    result = {k: measured[k] for k in ("peak_memory_mb", "peak_memory_delta_mb")}
    if plan:
        inp = trainer.plan_input()
        costs = iteration_costs(inp, probe(inp))
        result.update(predicted=predict(costs)["retain"].peak_memory_mb, rows=costs.rows)
    return result


@pytest.mark.timeout(300)
def test_a_trees_retain_peak_is_the_plans_and_below_the_flat_rollouts():
    """The issue's check: b = 2 over 4 branch points, Retain, every trainable step trained: the measured peak within
    10% of ``lean plan``'s, and below the flat Retain rollout's with as many leaves (16) and the same trained steps
    (compared by what each iteration added: both are a fresh trainer's first)."""
    tree = _retain_peak(tiny(*SHAPE, *TREE), plan=True)
    assert tree["rows"] == RowCounts(47, 31, 46, 16)
    assert abs(tree["predicted"] / tree["peak_memory_mb"] - 1) <= 0.10, tree
    flat = _retain_peak(tiny(*SHAPE), plan=False)
    assert tree["peak_memory_delta_mb"] < flat["peak_memory_delta_mb"], (tree, flat)


def test_bench_schedules_on_a_tree_bounds_retain_by_its_nodes_and_times_the_flat_rollout():
    """A tiny smoke of ``lean bench schedules`` on the branch_grpo shape (b = 2 at steps 0 and 1 of 4: 11 node
    forwards, 7 trained nodes, 10 trained edges for 4 leaves): Retain's bound removes the recompute forward and the
    3/10 of the update backward a node's shared graph saves; the flat rollout of 4 samples is timed beside it."""
    from lean.tools.bench.schedules import FLAT, add_speedups, bench_config, bench_schedules, speedup_bound

    base = {"time_iteration_s": 10.0, "time_recompute_forward_s": 3.0, "time_backward_s": 4.0, "cpu_iteration_s": 1}
    rows = {"recompute": [base], "retain": [{"time_iteration_s": 6.0, "cpu_iteration_s": 1}]}
    result = {"retain": {}}
    add_speedups(result, rows, {"retain": 1.0}, {"retain": 0.3})
    assert result["retain"]["speedup_bound"] == speedup_bound(10.0, 3.0, 1.0, 0.3 * 4.0) == 10.0 / (10.0 - 3.0 - 1.2)
    overrides = ["model.size=tiny", "model.resolution=32", "model.text_max_length=8", "sample.num_steps=4"]
    overrides += ["algorithm.name=branch_grpo", "sample.tree.branch_points=[0, 1]", "train.group_size=4"]
    cfg, options = bench_config(
        None, [*overrides, "train.prompts_per_iteration=1"], repeats=1, warmup=0, cores=0, flops=False
    )
    result = bench_schedules(cfg, options=options)
    assert result["config"]["rows"] == {"forwards": 11, "trained_forwards": 7, "trained_edges": 10, "leaves": 4}
    assert result["reweight"]["time_iteration_s"] > 0  # a buffer per trained edge (lean.schedules.edge_buffers)
    assert result["retain"]["removed_backward_share"] == pytest.approx(0.3)
    assert result[FLAT]["algorithm"] == "grpo" and result[FLAT]["time_iteration_s"] > 0
    assert {"tree_speedup_recompute", "tree_speedup_retain"} <= set(result[FLAT])
