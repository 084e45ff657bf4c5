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

Cost against the on-policy schedule (``predict``, s = |C_1| / B): the tracked work of the rollout is s of it, and the
later updates cost Recompute's (E - s) K fb.
"""

from __future__ import annotations

import torch

from lean.algorithms import StepLoss
from lean.sampling.transition import Transition
from lean.schedules.base import IterationContext, OptimizerStep
from lean.schedules.recompute import Recompute, first_update_rows, rows_mask


class LaterUpdates:
    """The updates after the first of an iteration: the first update's samples (drawn before the rollout), and a
    Recompute that stores the rollout's trained steps and recomputes every later chunk from them."""

    def __init__(self, ctx: IterationContext, first: torch.Tensor):
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


def later_updates(ctx: IterationContext) -> LaterUpdates | None:
    """The later updates of ``ctx``'s iteration, or None when its one update is on-policy."""
    first = first_update_rows(ctx.cfg, ctx.iteration, ctx.batch)
    return None if first is None else LaterUpdates(ctx, first)
