"""BranchGRPO's updates per tree rollout (``lean/schedules/edge_updates.py``): the trained edges shuffled and split
into optimizer steps of G = ``train.edges_per_update`` edges plus one for the remainder, as the tree script does
(Fredreic1849/BranchGRPO@19fbb9f, fastvideo/train_branchgrpo_flux.py:1481, :1592-1610); Retain and Reweight run them
as exact hybrids (``lean.schedules.hybrid.EdgeUpdates``) and end every iteration with Recompute's weights."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_preset

from lean.configure import load_config
from lean.sampling.tree import TreeShape, edge_cells
from lean.schedules.edge_updates import edge_chunks, update_count

PRESET = "branchgrpo-flux"
# the preset's tree, SDE, clip, G = 12 and optimizer on 4 steps: b = 2 at steps 0 and 1, 4 leaves a tree, 2 trees;
# LoRA (Reweight splits its backward by row) and a sync per update (Reweight corrects before it)
TINY = ["model.dtype=float64", "sample.num_steps=4", "sample.tree.branch_points=[0, 1]", "train.group_size=4"]
TINY += ["model.full_finetune=false", "parallel.grad_sync=per_update"]
PRUNED = ["algorithm.branch_grpo.width_pruning=best_and_worst", "algorithm.branch_grpo.width_pruning_ratio=0.5"]
KL = ["algorithm.beta=0.04"]  # Reweight's one KL buffer, at the first update's edges' weights


def _edges(num_steps: int, points: list[int], steps: list[int]) -> int:
    """A tree's edges at ``steps`` counted the tree script's way: 2^|{q in P : q <= i}| at step i (two children at a
    split, :404-405; every edge collected, :1199-1220)."""
    assert all(i < num_steps for i in steps)
    return sum(2 ** sum(q <= i for q in points) for i in steps)


def _source_steps(edges: int, g: int) -> int:
    """The tree script's optimizer steps over a process's ``edges``: after every g-th edge, and once more when edges
    remain (:1592-1610)."""
    steps = 0
    for i in range(edges):
        steps += (i + 1) % g == 0
    return steps + (edges % g != 0)


def _trained(cfg, iterations: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(the trainable weights before, after ``iterations`` iterations of ``cfg``'s schedule, the optimizer steps)."""
    from lean.train import Trainer

    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.params]
    for it in range(iterations):
        trainer.iteration(it, cfg.train.schedule)
    return start, [p.detach().clone() for p in trainer.params], trainer.state.steps


def _rel(weights: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(((w - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for w, r in zip(weights, reference))


def test_the_preset_takes_the_tree_scripts_optimizer_steps_per_rollout():
    """At the published shape (P = 0, 3, 6, 9 of 20 steps, 2 trees a process of 8, G = 12): the tree script's 37 steps
    over its 218 edges a tree, and lean's 34 over the 202 it trains (the last step never, the preset's header), as
    lean's own chunks of a process's trained cells count them."""
    from lean.run.iteration import local_batch

    cfg = load_config(None, [], preset=PRESET)
    g, t = cfg.train.edges_per_update, cfg.train
    shape = TreeShape(20, (0, 3, 6, 9), 2)
    assert g == 12 and shape.total_edges == 218
    assert 2 * _edges(20, [0, 3, 6, 9], list(range(20))) == 436 and update_count(436, g) == _source_steps(436, g) == 37
    assert 2 * _edges(20, [0, 3, 6, 9], list(range(19))) == 404 and update_count(404, g) == _source_steps(404, g) == 34
    trained = local_batch(cfg, 0, rank=0, world_size=8).steps.trained
    assert int(trained.sum()) == 404 and len(edge_chunks(cfg, 0, trained)) == 34
    assert (
        t.on_policy is False
        and load_config(None, ["train.on_policy=true"], preset=PRESET).train.edges_per_update is None
    )


def test_the_chunks_split_every_edge_once_the_same_way_every_time():
    cfg = tiny_preset(PRESET, *TINY)
    cells = torch.rand(8, 4, generator=torch.Generator().manual_seed(0)) < 0.6
    chunks, edges = edge_chunks(cfg, 3, cells), int(cells.sum())
    assert [int(c.sum()) for c in chunks] == [12] * (edges // 12) + ([edges % 12] if edges % 12 else [])
    assert torch.equal(torch.stack(chunks).sum(0), cells.long())
    assert all(torch.equal(a, b) for a, b in zip(chunks, edge_chunks(cfg, 3, cells)))
    assert not torch.equal(chunks[0], edge_chunks(cfg, 4, cells)[0])  # another iteration, another order


HYBRID_CASES = {  # (overrides, the process's trained edges: 2 trees, as the tree script counts them)
    "first-edges-before-the-rollout": (KL, 2 * _edges(4, [0, 1], [0, 1, 2])),  # 20 edges: 12 + 8
    "width-pruned-after-rewards": (PRUNED, 2 * (_edges(4, [0, 1], [0, 1]) + 2)),  # step 2's best and worst kept
    "full-finetune": (["model.full_finetune=true", *KL], 20),  # Reweight backpropagates one edge at a time
    # depth 2 pruned (step 1's edges), G = 3: 4 steps; the trees finished at the end in the group layout
    "group-layout-depth-pruned": (
        [
            "parallel.layout=group",
            "train.rollout_batch_size=4",
            "sample.tree.depth_pruning=[2]",
            "train.edges_per_update=3",
        ],
        2 * _edges(4, [0, 1], [0, 2]),
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_hybrids_take_the_tree_scripts_steps_and_end_with_recomputes_weights(case):
    """Tiny branchgrpo-flux, two iterations: Recompute takes the tree script's optimizer steps per rollout for the
    edges it trains, and Retain's and Reweight's weights (the first update from the kept graphs / the provisional
    buffers, the later ones recomputed) are Recompute's to 1e-10 in float64, with C_1 drawn before the rollout, or
    among the kept edges after the rewards (width pruning)."""
    extra, edges = HYBRID_CASES[case]
    cfg = tiny_preset(PRESET, *TINY, *extra)
    per_rollout = _source_steps(edges, cfg.train.edges_per_update)
    start, reference, steps = _trained(cfg)
    assert per_rollout > 1 and steps == 2 * per_rollout and _rel(start, reference) > 1e-6
    for schedule in ("retain", "reweight"):
        _, weights, steps = _trained(tiny_preset(PRESET, *TINY, *extra, f"train.schedule={schedule}"))
        assert steps == 2 * per_rollout and _rel(weights, reference) < 1e-10, schedule


def test_the_rollout_tracks_only_the_first_updates_nodes():
    """Without width pruning C_1 is drawn before the rollout: Retain's rollout tracks the nodes with an edge in C_1
    (their edges, C_1's and their siblings', in a transition of their own), every other node without autograd, and
    Reweight keeps a buffer for C_1's 12 edges alone, not the rollout's 20."""
    from lean.schedules import Retain, Reweight
    from lean.train import Trainer

    trainer = Trainer(tiny_preset(PRESET, *TINY))
    tracked, untracked = torch.zeros(8, 4, dtype=torch.bool), torch.zeros(8, 4, dtype=torch.bool)

    def record(step):
        (tracked if step.log_prob.requires_grad else untracked)[step.rows, step.index] = True

    rolled = trainer.pipeline.roll_out(0, Retain, on_step=record)
    first, trained = rolled.schedule.later.cells, rolled.ctx.steps.trained.cpu()
    assert int(first.sum()) == 12 and int(trained.sum()) == 20
    every_edge = edge_cells(TreeShape(4, (0, 1), 2), 8)  # each handed over once, tracked or not
    assert not (tracked & untracked).any() and torch.equal(tracked | untracked, every_edge)
    assert (first <= tracked).all() and tracked.sum() < trained.sum()
    siblings = tracked & ~first  # each the other child of a node C_1 branches from (steps 0 and 1 branch)
    assert all(i in (0, 1) for i in torch.nonzero(siblings)[:, 1].tolist())
    assert trainer.pipeline.roll_out(0, Reweight).schedule.edges.count == 12


def test_the_certificate_compares_the_first_updates_edges():
    """``lean equivalence`` on the preset's updates: every schedule's first optimizer step (C_1's edges) against the
    float64 twin's gradient of C_1 at the tree script's normaliser, KL on."""
    from lean.tools.equivalence import passes, run_equivalence

    cfg = tiny_preset(PRESET, *TINY, *KL)
    report = run_equivalence(cfg, reference=True)
    assert passes(report, cfg.model.torch_dtype) and not report.get("not_run")
    for schedule in ("recompute", "retain", "reweight"):
        assert report["reference"][schedule]["max_rel_grad_diff"] < 1e-10, schedule


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_updates_on_two_sharded_processes_pass_the_certificate(tmp_path):
    """Sharded passes in lockstep (FSDP, a tree a process, 4 edges a step: 3 steps): every process draws the same
    C_1..C_S cells (shape-only without width pruning), so Recompute's chunks, Retain's tracked nodes and Reweight's
    rounds match across processes, and the first update's gradient is the twin's."""
    import json

    from helpers import lean_ranks, tiny_preset_sets

    sets = [*tiny_preset_sets(PRESET), *TINY, *KL, "parallel.shard=fsdp", "train.edges_per_update=4"]
    lean_ranks(2, "equivalence", "--preset", PRESET, *[a for v in sets for a in ("--set", v)], "--out", str(tmp_path))
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["world_size"] == 2 and report["passes"] and not report.get("not_run")
    for schedule in ("retain", "reweight"):
        assert report[schedule]["max_rel_grad_diff"] < 1e-10, schedule


def test_the_plan_predicts_a_tree_hybrid_between_its_one_update_and_recompute():
    """``lean plan`` on the preset's updates (s = G / E of the trained edges): Retain's graphs and Reweight's buffers
    for C_1's share alone, Recompute's later updates on top; every update recomputed under Recompute either way."""
    from lean.plan.cost import first_share
    from lean.run.iteration import local_batch
    from lean.schedules import IterationCosts, Recompute, Retain, Reweight, RowCounts

    cfg = tiny_preset(PRESET, *TINY)
    assert first_share(cfg, local_batch(cfg, 0).steps, 8) == 12 / 20
    assert first_share(tiny_preset(PRESET, *TINY, "train.on_policy=true"), local_batch(cfg, 0).steps, 8) == 1.0
    one = IterationCosts(
        n=4, k=3, local=8, f=1.0, fb=3.0, fb_one=0.5, ref=0.0, score=2.0, base_mb=100, act_mb=8, act_one_mb=1,
        transient_mb=1, decode_mb=5, trainable_mb=1, train_rows_fraction=1.0, kl=False, per_row_grads=True,
        rows=RowCounts(forwards=14, trained_forwards=10, trained_edges=20, leaves=8),
    )  # fmt: skip
    hybrid = IterationCosts(**{**vars(one), "first_share": 12 / 20})
    assert Recompute.predict(hybrid) == Recompute.predict(one)
    for schedule in (Retain, Reweight):
        full, part = schedule.predict(one), schedule.predict(hybrid)
        assert full.time_iteration_s < part.time_iteration_s < Recompute.predict(hybrid).time_iteration_s
        assert part.held_mb < full.held_mb
    assert Reweight.predict(hybrid).held_mb == 12 * 1  # a buffer per first-update edge
