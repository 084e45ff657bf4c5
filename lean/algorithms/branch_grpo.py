"""BranchGRPO (Fredreic1849/BranchGRPO@19fbb9f, ``fastvideo/train_branchgrpo_flux.py``): DanceGRPO's clipped
surrogate on a tree rollout (``lean.sampling.tree``), each edge with the depth-wise advantage of the node it leads to
(``lean.algorithms.tree_targets``; docs/design/tree-rollouts.md, section 1).

One tree per group of ``train.group_size`` = L leaves. The leaves' rewards fuse into every node's (mean over the leaves
below it, :643-649), each depth's nodes are normalised against each other (:655-689), and the edge u -> c of step i
trains with A(c), clamped to +-adv_clip_max (:1204, :1547):

    L = 1/(B K) sum_{trained edges e} [ max(-A_e r_e, -A_e clip(r_e, 1 - c, 1 + c)) + beta KL_e ]

with B the local leaves and K the trained steps (the flat normaliser, one update per tree rollout: a constant factor
on BranchGRPO's 1/(G floor(E/T)), the same for every schedule). Targets sit on the [B, num_steps] grid at each edge's
first leaf. On-policy r = 1 and the gradient is linear in A, so Retain is exact (one kept graph per trained node), and
Reweight (a buffer per trained edge, ``lean.schedules.edge_buffers``); Recompute recomputes each trained edge
(BranchGRPO's ``grpo_one_step`` per edge, :714-752).

The tree script's updates (``train.edges_per_update`` = G, its --gradient_accumulation_steps): the E trained edges of
the process shuffled (:1481) and split into S = ceil(E / G) optimizer steps C_1..C_S of G edges and the remainder
(:1592-1610; ``lean.schedules.edge_updates``), each step s minimising

    L_s = 1/(G floor(E/T)) sum_{e in C_s} [ max(-A_e r_e, -A_e clip(r_e, 1 - c, 1 + c)) + beta KL_e ]

with T the local trees and r_e against the rollout's old log-prob (:1551-1575): the first step on-policy (r = 1),
the later ones under moved weights (the clip 1e-3 acts). Retain and Reweight run it as the exact hybrid of
``lean.schedules.hybrid.EdgeUpdates`` (C_1 from the rollout's graphs or buffers, C_2..C_S recomputed);
``train.on_policy=true`` keeps one update per tree rollout (the form above).

Pruning of the gradient (:1256-1470), while iteration + 1 <= int(train.iterations * ``pruning_until``) (:1258-1264):
depth pruning is the tree's (``sample.tree.depth_pruning``, shape-only: the trained mask loses those steps before the
rollout); width pruning (``width_pruning``) is decided after the rewards, among the trained edges of the steps after
the last branch point (the last layer, :1340-1350), each leaf's chain ranked by its edges' targets (a stable sort,
best first, ties in the tree script's depth-first order: leaf, then step):

    best_per_branch   each chain keeps its max(1, int(ratio m)) best of m                                (:1356-1432)
    best_and_worst    the tree's layer keeps its best floor(k/2) and worst k - floor(k/2), k = max(2, int(ratio m))
                                                                                                        (:1434-1456)

A pruned edge leaves the objective (its KL term too) and the normaliser counts the kept edges, as BranchGRPO's
1/(G floor(E/T)) does: each kept edge weighs (trained edges / kept edges) / (B K). The kept cells are a mask the
schedules apply to their weights (``kept_terms``): Retain keeps every candidate's graph and backpropagates the kept
edges (the pruned weigh 0), Reweight folds the kept edges' buffers only, Recompute recomputes the kept edges; all
three are exact. Differences: the ranking reads
the targets clamped to +-adv_clip_max (the script ranks before its clamp, :1547; equal unless the clamp binds, which
needs more than 26 leaves at the recipe's 5), and best_and_worst ranks each tree's layer, not the pool of the
process's trees (a world-size-free choice). Not yet: the log-prob softmax fusion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lean.algorithms.grpo import GRPO
from lean.algorithms.tree_targets import depthwise_advantages, edge_grid, edge_targets, fused_rewards
from lean.config import ConfigError
from lean.config.checks import check_choice
from lean.config.sections import register_options
from lean.sampling.tree import TreeShape, tree_shape

if TYPE_CHECKING:
    from torch import Tensor

    from lean.config import RunConfig


class BranchGRPO(GRPO):
    trains_trees = True

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple | None:
        if (problem := tree_problem(cfg, "BranchGRPO")) is not None:
            return problem
        if cfg.sample.timestep_selection == "random":
            return "sample.timestep_selection", "random", "a tree's node is shared by leaves: not drawn per sample"
        return None

    @classmethod
    def working_overrides(cls, cfg: RunConfig) -> list[str]:
        """A tree on ``cfg``'s steps: k branch points of ``sample.tree.branching`` b, k = log_b(group_size) where the
        group is a power of b (else 2, and the group b^2), every 3 steps from step 0 as BranchGRPO's [0, 3, 6, 9]
        (closer where the steps are few: a branch needs a step after it); one update per tree, steps not drawn per
        sample, every sample trained."""
        s, t, b = cfg.sample, cfg.train, cfg.sample.tree.branching
        k = next((k for k in range(1, 8) if b**k == t.group_size), None)
        fix = [] if k is not None else [f"train.group_size={b**2}"]
        k = k or 2
        spacing = min(3, (s.num_steps - 2) // max(k - 1, 1)) or 1
        fix.insert(0, f"sample.tree.branch_points=[{','.join(str(i * spacing) for i in range(k))}]")
        if s.timestep_selection == "random":
            fix.append("sample.timestep_selection=first")
        if cfg.algorithm.skip_zero_advantage:
            fix.append("algorithm.skip_zero_advantage=false")
        if t.optimizer_steps_per_iteration != 1 or t.num_inner_epochs != 1:
            fix += ["train.optimizer_steps_per_iteration=1", "train.num_inner_epochs=1"]
        return fix

    @classmethod
    def prunes(cls, cfg: RunConfig, iteration: int) -> bool:
        """BranchGRPO prunes while its step (iteration + 1) <= int(max_steps * pruning_step_ratio) (:1258-1264)."""
        return iteration + 1 <= int(cfg.train.iterations * cfg.algorithm.branch_grpo.pruning_until)

    def __init__(self, cfg: RunConfig, sigmas: Tensor | None):
        super().__init__(cfg, sigmas)
        self.run_cfg = cfg  # for the pruning's iteration window (train.iterations)

    @property
    def drops_terms(self) -> bool:
        """Width pruning leaves some trained edges out after the rewards, with their KL terms."""
        return self.cfg.branch_grpo.width_pruning != "none"

    def kept_terms(self, targets: Tensor, trained: Tensor, iteration: int) -> tuple[Tensor | None, int | Tensor]:
        """With width pruning, while it applies: the trained cells the update keeps [B, num_steps] and N = B x (kept
        cells / trained cells), so a kept edge weighs (trained / kept) / (B K). With ``train.edges_per_update`` = G:
        N = G floor(E / T) / K, E the kept edges and T the trees: an edge weighs the tree script's 1/(G floor(E/T))."""
        kept, n = self.kept_samples(targets)
        trained = trained.cpu()
        if self.drops_terms and self.prunes(self.run_cfg, iteration):
            options = self.cfg.branch_grpo
            kept = width_pruned(
                tree_shape(self.sample), targets.cpu(), trained, options.width_pruning, options.width_pruning_ratio
            )
            n, kept = len(targets) * float(kept.sum()) / float(trained.sum()), kept.to(targets.device)
        if (size := self.run_cfg.train.edges_per_update) is not None:
            edges = int(trained.sum() if kept is None else kept.sum())
            trees = len(targets) // self.run_cfg.train.group_size
            n = size * max(1, edges // trees) / int(trained[0].sum())  # :1500-1503 (at least 1), :1575
        return kept, n

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        """[N, num_steps] float64: each edge's advantage at (its first leaf, its step), 0 elsewhere."""
        shape = tree_shape(self.sample)
        trees = tree_rows(shape, group_ids)
        edges = edge_targets(
            shape, depthwise_advantages(fused_rewards(shape, rewards.view(trees, -1))), self.cfg.adv_clip_max
        )
        return edge_grid(shape, edges, len(rewards))


def tree_problem(cfg: RunConfig, name: str) -> tuple | None:
    """The settings every algorithm on a tree rollout needs (BranchGRPO, TreeGRPO; ``name`` says which): a tree, one
    group per tree, per-edge targets, and updates that are chunks of its edges; a problem tuple or None."""
    shape, t = tree_shape(cfg.sample), cfg.train
    if shape is None:
        return "sample.tree.branch_points", [], f"{name} rolls out trees: name its branch points"
    if t.group_size != shape.leaves:
        why = f"a tree of this shape has {shape.leaves} leaves: set that"
        return "train.group_size", t.group_size, why, [f"train.group_size={shape.leaves}"]
    if cfg.algorithm.skip_zero_advantage:
        return "algorithm.skip_zero_advantage", True, "a tree's targets are per edge, not per sample"
    if t.optimizer_steps_per_iteration != 1 or t.num_inner_epochs != 1:
        why = "a tree rollout's updates are chunks of its edges: set train.edges_per_update (null: one update)"
        return "train.optimizer_steps_per_iteration", t.optimizer_steps_per_iteration, why
    return None


def tree_rows(shape: TreeShape, group_ids: Tensor) -> int:
    """How many trees ``group_ids`` [N] hold, each group's L leaves contiguous (a tree is one group)."""
    trees = len(group_ids) // shape.leaves
    blocks = group_ids.view(trees, shape.leaves) if trees * shape.leaves == len(group_ids) else None
    if blocks is None or not (blocks == blocks[:, :1]).all():
        raise ValueError(
            f"tree targets need whole groups of {shape.leaves} contiguous leaves, got {group_ids.tolist()}"
        )
    return trees


def width_pruned(shape: TreeShape, targets: Tensor, trained: Tensor, mode: str, ratio: float) -> Tensor:
    """Host bool [B, num_steps]: the ``trained`` cells kept by width pruning ``mode`` at ``ratio`` (module docstring)
    of the host ``targets`` [B, num_steps]; the cells up to the last branch point stay as they are."""
    layer = trained.clone()
    layer[:, : max(shape.branch_points) + 1] = False  # the candidates: edges below the last branch, one chain per leaf
    kept = trained & ~layer
    leaves = shape.leaves
    for first in range(0, len(trained), leaves):
        chains = range(first, first + leaves)
        groups = [[(row, int(i)) for i in torch.nonzero(layer[row]).flatten()] for row in chains]
        if mode == "best_and_worst":
            groups = [[cell for chain in groups for cell in chain]]  # the tree's layer, in depth-first order
        for cells in groups:
            if not cells:
                continue
            values = torch.stack([targets[row, i] for row, i in cells])
            order = torch.sort(values, descending=True, stable=True).indices.tolist()
            if mode == "best_per_branch":
                chosen = order[: max(1, int(len(cells) * ratio))]
            else:
                count = max(2, int(len(cells) * ratio))
                chosen = order[: count // 2] + order[len(order) - (count - count // 2) :]
            for c in chosen:
                kept[cells[c]] = True
    return kept


@register_options("algorithm.branch_grpo")
@dataclass
class BranchGRPOConfig:
    """BranchGRPO's width pruning (``lean/algorithms/branch_grpo.py``; the depth pruning is ``sample.tree``'s)."""

    width_pruning: str = "none"
    """none | best_per_branch | best_and_worst: which of the last layer's trained edges keep training (the tree
    script's --width_pruning_mode 0 | 1 | 2, :1320-1470; its launch script 0)."""
    width_pruning_ratio: float = 0.5
    """The share of the last layer kept (--width_pruning_ratio, default 0.5, :2103)."""
    pruning_until: float = 1.0
    """The share of train.iterations during which depth and width pruning apply (--pruning_step_ratio, default 1.0:
    always, :2104)."""

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.width_pruning", self.width_pruning, WIDTH_PRUNING)
        if not 0 < self.width_pruning_ratio <= 1:
            raise ConfigError(f"{prefix}.width_pruning_ratio", self.width_pruning_ratio, "must be in (0, 1]")
        if not 0 <= self.pruning_until <= 1:
            raise ConfigError(f"{prefix}.pruning_until", self.pruning_until, "must be in [0, 1]")


WIDTH_PRUNING = ("none", "best_per_branch", "best_and_worst")
