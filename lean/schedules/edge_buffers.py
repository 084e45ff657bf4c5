"""Reweight on a tree rollout: one gradient buffer per trained edge (docs/design/tree-rollouts.md, section 3.3).

On a tree (``lean.sampling.tree``) the edges of step i sit on the local batch's [B, num_steps] grid at their cells
(first leaf, i), and their targets differ along a leaf's path (BranchGRPO's depth-wise advantages), so one buffer per
trajectory cannot fold them. On-policy the gradient is still linear in each edge's target:

    grad = sum_{trained cells c} (A_c / Â) P_c + Q,     P_c = 1/(N K) J_u(c)^T (-Â d log p_c / d mu_u(c))

with u(c) the node whose forward the edge c comes from and Q the target-free KL part (one buffer, as on a flat
rollout). So each trained cell keeps its own buffer P_c, filled by the rollout's backward with Â = 1, and is folded
when the tree's rewards are known. The buffers cover the trained cells of one finishing unit of U rows (the local
batch, or whole trees in the group layout); rows r and r + U share their slots, as trajectories do on a flat rollout.

Splitting a backward by edge. ``PerSampleGrads`` splits the weight gradient by the forward's rows, and a node is one
row: at a branch point its b edges share it. A branch step is therefore backpropagated in b rounds, round k holding
every node's k-th child (edges k, k + b, ... of the step, which lists its edges node by node, b each): one edge per
row, each into its cell's buffer. A step without a branch is one round. Cost: b - 1 extra backwards of the step's
node graphs per branch step, no extra forward. Without per-row splitting (a trainable outside an ``nn.Linear``) each
edge is a round of its own.
"""

from __future__ import annotations

import torch

from lean.sampling.tree import TreeShape
from lean.schedules.per_sample import TrajectoryBuffers


class EdgeSlots:
    """The buffer slot of every cell of the local batch's grid, ``slots``: host LongTensor [B, num_steps] (and its
    copy on ``device``, ``device_slots``), and ``count`` slots (the trained cells of one unit). ``trained``: host bool
    [B, num_steps], the trained edges."""

    def __init__(self, trained: torch.Tensor, unit: int, shape: TreeShape, device: torch.device):
        batch, steps = trained.shape
        unit_rows = torch.arange(batch) % unit
        in_unit = torch.zeros(unit, steps, dtype=torch.long).index_add_(0, unit_rows, trained.long()) > 0
        self.count = max(int(in_unit.sum()), 1)  # at least one: a tracked step's zero terms still land in a slot
        # an untrained cell of a tracked step weighs 0 (lockstep, pruning): its zero gradient may go to any slot
        self.slots = (in_unit.flatten().cumsum(0) - 1).clamp_min(0).view(unit, steps)[unit_rows]
        self.device_slots = self.slots.to(device)  # uploaded once: the per-step backward reads them on the device
        self.trained, self.shape = trained, shape

    def rounds(self, index: int, edges: int, split_by_row: bool) -> list[slice]:
        """The parts of step ``index``'s ``edges`` backpropagated together: at most one edge per node when the
        backward is split by row (``split_by_row``), else one edge each."""
        if not split_by_row:
            return [slice(j, j + 1) for j in range(edges)]
        b = self.shape.branching if index in self.shape.branch_points else 1
        return [slice(k, None, b) for k in range(b)]

    def fold(self, buffers: TrajectoryBuffers, rows: slice, coefficients: torch.Tensor) -> torch.Tensor:
        """sum_{trained cells c in ``rows``} w_c P_c as one flat vector; ``coefficients`` [B, num_steps] hold w (for
        the policy part A_c / Â times whether the update keeps c; for the KL part whether it keeps c)."""
        b, i = torch.nonzero(self.trained[rows], as_tuple=True)
        b = b + (rows.start or 0)
        device = coefficients.device
        weights = coefficients[b.to(device), i.to(device)].to(torch.float64)
        return buffers.combine_slots(self.device_slots[b.to(device), i.to(device)], weights)
