"""BranchGRPO (Fredreic1849/BranchGRPO@19fbb9f, ``fastvideo/train_branchgrpo_flux.py``): DanceGRPO's clipped
surrogate on a tree rollout (``lean.sampling.tree``), each edge with the depth-wise advantage of the node it leads to
(``lean.algorithms.tree_targets``; docs/design/tree-rollouts.md, section 1).

One tree per group of ``train.group_size`` = L leaves. The leaves' rewards fuse into every node's (mean over the leaves
below it, :643-649), each depth's nodes are normalised against each other (:655-689), and the edge u -> c of step i
trains with A(c), clamped to +-adv_clip_max (:1204, :1547):

    L = 1/(B K) sum_{trained edges e} [ max(-A_e r_e, -A_e clip(r_e, 1 - c, 1 + c)) + beta KL_e ]

with B the local leaves and K the trained steps (the flat normaliser: a constant factor on BranchGRPO's 1/(G E/T),
the same for every schedule). Targets sit on the [B, num_steps] grid at each edge's first leaf. On-policy r = 1 and the
gradient is linear in A, so Retain is exact (one kept graph per trained node), and Reweight (a buffer per trained edge,
``lean.schedules.edge_buffers``); Recompute recomputes each trained edge (BranchGRPO's ``grpo_one_step`` per edge,
:714-752). Not yet: the log-prob softmax fusion, width and depth pruning, several updates per rollout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lean.algorithms.grpo import GRPO
from lean.algorithms.tree_targets import depthwise_advantages, edge_targets, fused_rewards
from lean.sampling.tree import TreeShape, tree_shape

if TYPE_CHECKING:
    from torch import Tensor

    from lean.config import RunConfig


class BranchGRPO(GRPO):
    trains_trees = True

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        shape, t = tree_shape(cfg.sample), cfg.train
        if shape is None:
            return "sample.tree.branch_points", [], "BranchGRPO rolls out trees: name its branch points ([0, 3, 6, 9])"
        if t.group_size != shape.leaves:
            return "train.group_size", t.group_size, f"a tree of this shape has {shape.leaves} leaves: set that"
        if cfg.sample.timestep_selection == "random":
            return "sample.timestep_selection", "random", "a tree's node is shared by leaves: not drawn per sample"
        if cfg.algorithm.skip_zero_advantage:
            return "algorithm.skip_zero_advantage", True, "a tree's targets are per edge, not per sample"
        if t.optimizer_steps_per_iteration != 1 or t.num_inner_epochs != 1:
            return "train.optimizer_steps_per_iteration", t.optimizer_steps_per_iteration, "one update per tree rollout"
        return None

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        """[N, num_steps] float64: each edge's advantage at (its first leaf, its step), 0 elsewhere."""
        shape = tree_shape(self.sample)
        trees = tree_rows(shape, group_ids)
        edges = edge_targets(
            shape, depthwise_advantages(fused_rewards(shape, rewards.view(trees, -1))), self.cfg.adv_clip_max
        )
        grid = torch.zeros((len(rewards), shape.num_steps), dtype=torch.float64, device=rewards.device)
        for i, values in enumerate(edges):
            grid[shape.first_leaves(i + 1, torch.arange(trees)), i] = values.flatten().to(grid)
        return grid


def tree_rows(shape: TreeShape, group_ids: Tensor) -> int:
    """How many trees ``group_ids`` [N] hold, each group's L leaves contiguous (a tree is one group)."""
    trees = len(group_ids) // shape.leaves
    blocks = group_ids.view(trees, shape.leaves) if trees * shape.leaves == len(group_ids) else None
    if blocks is None or not (blocks == blocks[:, :1]).all():
        raise ValueError(
            f"tree targets need whole groups of {shape.leaves} contiguous leaves, got {group_ids.tolist()}"
        )
    return trees
