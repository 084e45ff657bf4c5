"""Exact hybrid schedules: the first update from the rollout's own graphs, every later one recomputed.

A recipe with S = ``optimizer_steps_per_iteration`` > 1 (or E = ``num_inner_epochs`` > 1) updates several times per
rollout. Recompute visits the local samples in an order drawn from a stream every process shares (FlowGRPO: shuffled;
DanceGRPO: as rolled out, ``lean.schedules.recompute.update_order``), splits it into S chunks C_1..C_S, one optimizer
step each, E times over. The first step runs under the rollout's weights, so its ratio is exactly 1:

    step 1:      grad = 1/(|C_1| K) sum_{b in C_1} sum_{j in T_b} [ -A_b dlog p_bj + beta dKL_bj ]     (on-policy)
    steps 2..SE: Recompute's, each under weights that earlier steps have moved (r != 1, the clip may bind)

The order depends on (seed, iteration, local batch size) alone, so :func:`first_update_rows` draws C_1 before the
rollout. The rollout then tracks gradients for C_1's samples only (``Schedule.track_rows``): Retain keeps |C_1| / B
of the graphs, Reweight backpropagates |C_1| / B of the trajectories, and step 1 needs no recompute. The rollout also
stores every trained step's x_i, x_{i+1} and log p_old (:class:`LaterUpdates`, a Recompute), from which steps 2..SE
are recomputed exactly as Recompute computes them. The iteration ends with Recompute's weights.

With ``algorithm.skip_zero_advantage`` the order of the filter and the split matters. FlowGRPO drops the
zero-advantage samples first and splits the rest (``algorithm.zero_advantage_order: filter_then_split``), so C_1 would
be known only after the rewards. A hybrid splits first and filters each chunk (``split_then_filter``, what ``auto``
takes under a hybrid): C_1 is drawn from every sample before the rollout, and step 1 averages over its kept samples,

    grad = 1/(|C_1 kept| K) sum_{b in C_1, A_b != 0} sum_{j in T_b} [ -A_b dlog p_bj + beta dKL_bj ]

Each update still averages over the kept samples it holds, and every sample is in exactly one update per epoch: only
how many kept samples each update gets varies (hypergeometric around FlowGRPO's even split). Recompute with
``split_then_filter`` computes the same steps, and the certificate compares against it.

On a tree rollout with ``train.edges_per_update`` = G (BranchGRPO's updates, ``edge_updates.py``) an update is a
chunk of the tree's trained edges, not of its samples, and the hybrid is :class:`EdgeUpdates`: every row rolls out
and finishes at the end, the first update is the rollout's graphs' (Retain) or buffers' (Reweight) restricted to
C_1's cells, each edge at its weight w_e in the objective, and the later chunks are recomputed from the stored steps
as Recompute recomputes them (``Recompute.tree_updates``):

    step 1:      grad = sum_{e in C_1} w_e [ -A_e dlog p_e + beta dKL_e ]        (on-policy, ratio 1)
    steps 2..S:  Recompute's, on C_2..C_S

Without width pruning C_1 is known before the rollout (the cells are shape-only, the same on every process): the
rollout tracks only the nodes with an edge in C_1 (``Schedule.track_cells``, read by ``lean.sampling.tree``; a
tracked node's other children weigh 0), and Reweight keeps a buffer for C_1's edges alone. With width pruning it is
known after the rewards: every trained node is tracked and C_1 is chosen among the kept cells then (the other graphs
are freed unused, the other buffers folded with weight 0).

Cost against the on-policy schedule (``predict``, s = |C_1| / B): the tracked work of the rollout is s of it, and the
later updates cost Recompute's (E - s) K fb.
"""

from __future__ import annotations

import torch

from lean.algorithms import StepLoss
from lean.sampling.transition import Transition
from lean.schedules.base import IterationContext, OptimizerStep
from lean.schedules.edge_updates import edges_per_update, first_edges
from lean.schedules.recompute import Recompute, first_update_rows, rows_mask


class LaterUpdates:
    """The updates after the first of an iteration: the first update's samples (drawn before the rollout), and a
    Recompute that stores the rollout's trained steps and recomputes every later chunk from them."""

    tracked_steps: torch.Tensor | None = None  # host bool [num_steps]: the only steps the rollout tracks (None: all)

    def __init__(self, ctx: IterationContext, first: torch.Tensor):
        self.ctx = ctx
        self.first = first  # host ids of the first update's local samples, ascending
        self.recompute = Recompute(ctx, hybrid=True)
        self.track_rows = rows_mask(ctx.batch, first)

    @property
    def first_size(self) -> int:
        """|C_1|: the rows the rollout tracks."""
        return len(self.first)

    def first_count(self, kept: torch.Tensor | None) -> int | torch.Tensor:
        """The N of the first update's 1/(N K): |C_1|, or with ``kept`` [B] (skip_zero_advantage) the kept samples
        of C_1 (on kept's device; an all-dropped C_1 counts 1 and weighs 0)."""
        if kept is None:
            return self.first_size
        return kept[self.first.to(kept.device)].sum().clamp_min(1)

    def on_step(self, step: Transition) -> None:
        self.recompute.on_step(step)

    def run(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> tuple[list[StepLoss], dict]:
        """Steps 2..SE: (their loss terms, the last optimizer step's stats)."""
        return self.recompute.later_updates(advantages, optimizer_step)

    def first_update(self, kept: torch.Tensor | None, n: int | torch.Tensor) -> tuple:
        """(kept, the N of 1/(N K)) of the first update, from the whole update's ``IterationContext.kept_samples``."""
        return kept, self.first_count(kept)


class EdgeUpdates(LaterUpdates):
    """A tree's updates after the first (module docstring): the first update's cells C_1 and a Recompute that stores
    the rollout's trained steps and recomputes C_2..C_S from them. Every row rolls out whole (``first``: all of them),
    and finishes at the end (``track_rows`` set)."""

    def __init__(self, ctx: IterationContext):
        super().__init__(ctx, torch.arange(ctx.batch))
        # C_1 before the rollout where the cells are shape-only (no width pruning): its nodes alone are tracked
        self.cells = None if ctx.algorithm.drops_terms else first_edges(ctx, None)
        self.tracked_steps = None if self.cells is None else self.cells.any(0)

    def first_update(self, kept: torch.Tensor | None, n: int | torch.Tensor) -> tuple:
        """(C_1's cells among the kept ones, on the device, as the cells an update keeps; n unchanged: an edge weighs
        the same in every update)."""
        return first_edges(self.ctx, kept).to(self.ctx.sigmas.device), n

    def run(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> tuple[list[StepLoss], dict]:
        losses, _, step_stats = self.recompute.tree_updates(advantages, optimizer_step, skip_first=True)
        return losses, step_stats


def later_updates(ctx: IterationContext) -> LaterUpdates | None:
    """The later updates of ``ctx``'s iteration, or None when its one update is on-policy."""
    if edges_per_update(ctx.cfg) is not None:
        return EdgeUpdates(ctx)
    first = first_update_rows(ctx.cfg, ctx.iteration, ctx.batch)
    return None if first is None else LaterUpdates(ctx, first)
