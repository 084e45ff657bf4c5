"""Recompute: the FlowGRPO / DanceGRPO baseline.

Rollout (no gradients anywhere) stores, for every stochastic step i of every sample, x_i, x_{i+1} and what the
algorithm's loss reads of the rollout's step (``Algorithm.reads``: log p_old(x_{i+1} | x_i); GRPO-Guard's the old
mean too). After rewards and advantages A are known, the update loop recomputes every trained step with
gradients:

    for epoch in 1..num_inner_epochs:                      # off-policy when > 1
        shuffle the local samples; split them into S = optimizer_steps_per_iteration chunks
        for each chunk C (|C| = N/S samples), in micro-batches of train_batch_size:
            for j in 1..K:                                 # the j-th trained step of each sample
                mu_theta, log p_theta = policy_step(x_{t_bj}, scoring the stored x_{t_bj + 1})
                loss = sum_b [clipped_surrogate(log p_theta - log p_old, A_b) + beta KL(mu_theta, mu_ref)] / (|C| K)
                loss.backward()
            optimizer_step()                              # sync, clip, AdamW; later chunks are off-policy

With S = 1 and one epoch the loop is on-policy: log p_theta equals log p_old up to floating-point rounding (ratio = 1),
which is the redundancy Retain and Reweight remove: the forward pass above already ran during the rollout. In half
precision that rounding is not small: other micro-batches and another CFG layout than the rollout's round the forward
differently, the ratio leaves [1 - c, 1 + c] (c = 1e-4), and the clip drops those terms (``lean equivalence`` reports
how many). ``train.recompute_batching: rollout`` recomputes with the rollout's own micro-batches and CFG batch
instead (on-policy only): one update, steps in rollout order.

Cost (``predict``, in the terms of ``base.IterationCosts``): it peaks in the VAE decode or in one update backward,

    memory = base + max(decode, act x train_rows_fraction + transient)      time = n f + score + E (K fb + ref)
           (the K recomputed steps each cost a forward f beside the tracked forward + backward fb; it finishes
           nothing early, so in the group layout score is ``score_at_end``: the last micro-batch's wait)

On a tree rollout (``lean.sampling.tree``) the rollout runs one forward per node and the update one per trained edge
(``recompute_terms``: each edge recomputes its parent's forward, BranchGRPO's ``grpo_one_step``), so n f becomes the
nodes' forwards and K fb the trained edges' (``IterationCosts.forward_steps``, ``edge_steps``). Its updates
(``tree_updates``): one of every trained edge, or with ``train.edges_per_update`` the tree script's chunks of edges
(``edge_updates.py``), each recomputed and followed by an optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lean.algorithms import StepLoss, loss_stats
from lean.algorithms.base import step_targets
from lean.config.registry import Registry
from lean.sampling.rollout import iteration_generator, policy_step
from lean.sampling.transition import RECOMPUTE_INPUTS, Transition
from lean.sampling.tree import tree_shape
from lean.schedules.base import IterationContext, IterationCosts, OptimizerStep, Prediction, Schedule
from lean.schedules.edge_updates import edge_chunks, edges_per_update

if TYPE_CHECKING:
    from lean.config import RunConfig, TrainConfig

RECOMPUTE_BATCHINGS: Registry[str] = Registry(
    "recompute batching",
    [
        ("update", "FlowGRPO's update: the samples shuffled, in micro-batches of train.train_batch_size"),
        ("rollout", "the rollout's own micro-batches and CFG batch (on-policy the ratio is 1 to the bit)"),
    ],
)
ROLLOUT_BATCHING = "rollout"
# With algorithm.skip_zero_advantage and several updates per rollout: which comes first, dropping the zero-advantage
# samples or splitting the samples into the updates (algorithm.zero_advantage_order; auto resolves per schedule)
ZERO_ADVANTAGE_ORDERS: Registry[str] = Registry(
    "zero-advantage order",
    [
        ("filter_then_split", "FlowGRPO: the kept samples are split into the updates (known after the rewards)"),
        ("split_then_filter", "the updates' samples are drawn before the rollout; each drops its zero-advantage ones"),
    ],
)
FILTER_THEN_SPLIT, SPLIT_THEN_FILTER = ZERO_ADVANTAGE_ORDERS
# FLOP and time regions of the update's forwards: the first update's repeats the rollout's (on-policy: what the Lean
# schedules remove); a later update's runs under weights the earlier ones moved, so the algorithm needs it
RECOMPUTE_FORWARD, LATER_UPDATE_FORWARD = "recompute_forward", "update_forward"


@dataclass
class Terms:
    """Loss terms recomputed in one forward: the stored ``step`` of some trajectories (its ``rows`` on the device or
    a contiguous slice, its ``index`` an int or one per row), with the fields the algorithm reads."""

    step: Transition
    weight: float | torch.Tensor  # of each term in the objective: 1/(N K), 0 for a step the row does not train


def shuffled(t: TrainConfig, iteration: int, count: int, epoch: int) -> torch.Tensor:
    """A permutation of ``count`` from the stream of inner epoch ``epoch`` of ``iteration``, the same on every
    process."""
    return torch.randperm(count, generator=iteration_generator(t.seed, iteration, purpose=1 + epoch))


def rolled_out_in_update_order(t: TrainConfig) -> bool:
    """Whether each process's local batch is laid out in the first epoch's shuffled update order before the rollout
    (``lean.run.iteration.local_batch``): with several updates per rollout, so that each update's samples are contiguous
    rows and a hybrid's first update whole rollout micro-batches (none split into a tracked and an untracked
    forward). The order is drawn before the rewards either way, and a sample's trajectory does not depend on its row."""
    return t.shuffle_update and (t.optimizer_steps_per_iteration > 1 or t.num_inner_epochs > 1)


def update_order(t: TrainConfig, iteration: int, samples: torch.Tensor, epoch: int) -> torch.Tensor:
    """``samples`` (host ids) in the order the update visits them in inner epoch ``epoch``: shuffled by a stream every
    process shares (FlowGRPO's SD3, FLUX and Wan scripts), or as rolled out (``train.shuffle_update: false``, and the
    first epoch of a batch already laid out in that order: :func:`rolled_out_in_update_order`)."""
    if not t.shuffle_update or (epoch == 0 and rolled_out_in_update_order(t)):
        return samples
    return samples[shuffled(t, iteration, len(samples), epoch)]


def first_update_rows(cfg: RunConfig, iteration: int, batch: int) -> torch.Tensor | None:
    """The local samples of an iteration's first optimizer step, host ids ascending, as the update will draw them
    before any zero-advantage sample leaves (``split_then_filter``): the update that runs under the rollout's own
    weights. None when it is the only update (one optimizer step per rollout, one inner epoch)."""
    t = cfg.train
    if t.optimizer_steps_per_iteration == 1 and t.num_inner_epochs == 1:
        return None
    order = update_order(t, iteration, torch.arange(batch), epoch=0)
    return _chunks(order, t.optimizer_steps_per_iteration)[0].sort().values


def rows_mask(batch: int, rows: torch.Tensor) -> torch.Tensor:
    """Host bool [batch]: True at the host ids ``rows``."""
    mask = torch.zeros(batch, dtype=torch.bool)
    mask[rows] = True
    return mask


def _chunks(order: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``order`` split into ``count`` chunks as ``Tensor.chunk`` does, padded with empty ones: every process takes
    the same number of optimizer steps (each syncs gradients), even when skip_zero_advantage left few samples."""
    chunks = list(order.chunk(count)) if len(order) else []
    return chunks + [order[:0]] * (count - len(chunks))


def splits_first(cfg: RunConfig, hybrid: bool) -> bool:
    """Whether the updates' samples are split before the zero-advantage ones leave (``split_then_filter``), for a
    hybrid schedule's updates or Recompute's: ``algorithm.zero_advantage_order``, ``auto`` taking the one each
    needs (a hybrid draws its first update before the rollout; Recompute keeps FlowGRPO's order)."""
    order = cfg.algorithm.zero_advantage_order
    return order == SPLIT_THEN_FILTER or (order not in ZERO_ADVANTAGE_ORDERS and hybrid)


class Recompute(Schedule):
    tracks_rollout_graphs = False

    def __init__(self, ctx: IterationContext, hybrid: bool = False):
        """``hybrid``: the later updates of a hybrid schedule (``hybrid.py``), whose first update drew its samples
        before the rollout."""
        super().__init__(ctx)
        self.split_first = splits_first(ctx.cfg, hybrid)
        # what each trained step's recompute starts from and what the algorithm's loss reads of the rollout's step
        self.fields = RECOMPUTE_INPUTS + tuple(sorted(ctx.algorithm.reads))
        self.stored: dict[int, dict[str, torch.Tensor]] = {}  # step i -> field -> its value of every row [B, ...]
        # ratio r = p_theta / p_old of every (sample, step) term its update computed (1 where none was), on the device:
        # on-policy r is 1 up to rounding, and the certificate reports how often rounding alone made the clip bind
        self.ratios = torch.ones(ctx.steps.trained.shape, dtype=torch.float64, device=ctx.sigmas.device)

    def track_grad(self, i: int) -> bool:
        return False

    def on_step(self, step: Transition) -> None:
        if not self.any_trained[step.index]:
            return  # never trained: nothing to store
        if step.index not in self.stored:
            self.stored[step.index] = {
                name: getattr(step, name).new_empty((self.ctx.batch, *getattr(step, name).shape[1:]))
                for name in self.fields
            }
        for name, store in self.stored[step.index].items():
            store[step.rows] = getattr(step, name).detach()

    def _gather(self, name: str, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Field ``name`` of each sample b of ``rows`` at its step steps[b] (host-side ids; views of the stored device
        tensors)."""
        return torch.stack([self.stored[int(t)][name][int(b)] for b, t in zip(rows, steps)])

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        ctx = self.ctx
        like_rollout = ctx.cfg.train.recompute_batching == ROLLOUT_BATCHING
        if tree_shape(ctx.cfg.sample) is not None:  # a tree's trained edges sit on cells, not K per row
            losses, first, step_stats = self.tree_updates(advantages, optimizer_step)
            return {**loss_stats(losses, first), **step_stats}
        losses: list[StepLoss] = []
        step_stats = {}
        kept, n = ctx.kept_samples(advantages)
        batches = self._batches_like_rollout(kept, n) if like_rollout else self._shuffled_batches(kept)
        first = None  # how many of the losses are the first update's
        for u, update in enumerate(batches):
            region = RECOMPUTE_FORWARD if u == 0 else LATER_UPDATE_FORWARD
            for batch in update:
                losses.append(self._backward(batch, advantages, joint_cfg=like_rollout, region=region))
            first = len(losses) if first is None else first
            step_stats = optimizer_step()
        return {**loss_stats(losses, first), **step_stats}

    def later_updates(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> tuple[list[StepLoss], dict]:
        """Every update but the first (a hybrid schedule computed that one from the rollout's graphs): (the loss terms
        recomputed, the last optimizer step's stats)."""
        losses, step_stats = [], {}
        kept, _ = self.ctx.kept_samples(advantages)
        for update in self._shuffled_batches(kept, skip_first=True):
            for batch in update:
                losses.append(self._backward(batch, advantages, joint_cfg=False, region=LATER_UPDATE_FORWARD))
            step_stats = optimizer_step()
        return losses, step_stats

    def tree_updates(
        self, advantages: torch.Tensor, optimizer_step: OptimizerStep, skip_first: bool = False
    ) -> tuple[list[StepLoss], int, dict]:
        """A tree's updates: its trained (kept) edges in one update, or with ``train.edges_per_update`` in the chunks
        of ``edge_updates.py``, each recomputed and followed by an optimizer step; ``skip_first``: all but the first
        (a hybrid's). Returns (the loss terms, how many of them are the first update's, the last step's stats)."""
        ctx = self.ctx
        kept, n = ctx.kept_samples(advantages)
        terms = ctx.steps.trained.cpu()
        if kept is not None and kept.dim() == 2:  # width-pruned edges are not recomputed (they weigh 0)
            terms = terms & kept.cpu()
        chunks = [terms] if edges_per_update(ctx.cfg) is None else edge_chunks(ctx.cfg, ctx.iteration, terms)
        # the same cells on every process unless width pruning chose them (sharded passes then pad, in lockstep)
        padded = ctx.lockstep and ctx.algorithm.drops_terms
        losses, first, step_stats = [], 0, {}
        for u, chunk in enumerate(chunks):
            if skip_first and u == 0:
                continue
            region = RECOMPUTE_FORWARD if u == 0 else LATER_UPDATE_FORWARD
            losses += self.recompute_terms(chunk, advantages, n, kept, region, padded or len(chunks) == 1)
            first = first or len(losses)
            step_stats = optimizer_step()
        return losses, first, step_stats

    def recompute_terms(
        self,
        terms: torch.Tensor,
        advantages: torch.Tensor,
        n: int | torch.Tensor,
        kept: torch.Tensor | None,
        region: str = RECOMPUTE_FORWARD,
        padded: bool = True,
    ) -> list[StepLoss]:
        """The first update's loss terms restricted to ``terms`` (host bool [B, num_steps], among the trained
        ones), recomputed and backpropagated with the weights 1/(n K) of the whole update, latest step first: the
        steps Retain's partial retention did not keep (``retain.py``), or one update of a tree's edges. No optimizer
        step. In lockstep every process recomputes every local row of the same steps (the rows that do not train a
        step weigh 0), so the sharded forwards match; not ``padded``: ``terms`` are the same on every process."""
        ctx, size = self.ctx, self.ctx.cfg.train.train_batch_size
        device, losses = ctx.sigmas.device, []
        lockstep = ctx.lockstep and padded
        for i in sorted((i for i in self.stored if terms[:, i].any() or lockstep), reverse=True):
            rows = torch.arange(ctx.batch) if lockstep else torch.nonzero(terms[:, i]).flatten()
            for chunk in rows.split(size):
                on_device = chunk.to(device)
                weight = ctx.term_weights(on_device, i, n, kept) * terms[chunk, i].to(device, ctx.sigmas.dtype)
                stored = {name: value[on_device] for name, value in self.stored[i].items()}
                step = Transition(index=i, rows=on_device, **stored)
                losses.append(self._backward(Terms(step, weight), advantages, joint_cfg=False, region=region))
        return losses

    def _shuffled_batches(self, kept: torch.Tensor | None, skip_first: bool = False) -> Iterator[list[Terms]]:
        """FlowGRPO's update: per inner epoch the local samples (the ``kept`` ones) in :func:`update_order`, split
        into one chunk per optimizer step, in micro-batches of train_batch_size; within one, the j-th trained step of
        every sample (ascending). With ``split_first`` every sample is ordered and split, and each chunk then drops
        the samples not kept. ``skip_first``: all but the first epoch's first chunk."""
        ctx, t = self.ctx, self.ctx.cfg.train
        trained_steps = [torch.nonzero(row).flatten() for row in ctx.steps.trained]  # per sample, ascending (host)
        device = ctx.sigmas.device
        keep = None if kept is None else kept.cpu()
        samples = torch.arange(ctx.batch)
        if keep is not None and not self.split_first:
            samples = samples[keep]
        for epoch in range(t.num_inner_epochs):
            order = update_order(t, ctx.iteration, samples, epoch)
            for c, chunk in enumerate(_chunks(order, t.optimizer_steps_per_iteration)):
                if skip_first and epoch == 0 and c == 0:
                    continue
                if keep is not None and self.split_first:
                    chunk = chunk[keep[chunk]]
                update = []
                for rows in chunk.split(t.train_batch_size) if len(chunk) else ():  # host-side ids; device below
                    on_device = rows.to(device)
                    for j in range(ctx.steps_per_sample):
                        steps = torch.stack([trained_steps[int(b)][j] for b in rows])
                        stored = {name: self._gather(name, rows, steps) for name in self.fields}
                        step = Transition(index=steps.to(device), rows=on_device, **stored)
                        update.append(Terms(step, 1.0 / (len(chunk) * ctx.steps_per_sample)))
                yield update

    def _batches_like_rollout(self, kept: torch.Tensor | None, n: int | torch.Tensor) -> Iterator[list[Terms]]:
        """One update whose forwards are the rollout's: every stored step in order, in the rollout's contiguous
        micro-batches (rows whose step is not trained weigh 0), so that on-policy the recomputed log-probs are the
        rollout's to the last bit where the kernels are deterministic."""
        ctx, size = self.ctx, self.ctx.cfg.train.rollout_batch_size
        update = []
        for i in sorted(self.stored):
            for start in range(0, ctx.batch, size):
                rows = slice(start, min(start + size, ctx.batch))
                stored = {name: value[rows] for name, value in self.stored[i].items()}
                update.append(Terms(Transition(index=i, rows=rows, **stored), ctx.term_weights(rows, i, n, kept)))
        yield update

    def _backward(self, terms: Terms, advantages: torch.Tensor, joint_cfg: bool, region: str) -> StepLoss:
        """Recompute the terms' log-probs with gradients (timed and counted as ``region``), the algorithm's loss, and
        its backward."""
        ctx, rows = self.ctx, terms.step.rows
        emb = ctx.emb.index(rows)
        with ctx.region(region):
            step = policy_step(ctx.policy, ctx.sampler, terms.step, emb, joint_cfg=joint_cfg)
        loss = ctx.algorithm.step_loss(ctx.with_reference(step), step_targets(advantages, step))
        self.ratios[rows, step.index] = loss.ratio.detach().double()
        with ctx.region("backward"):
            (terms.weight * ctx.total(loss, rows)).sum().backward()
        return ctx.logged(loss, rows)

    @staticmethod
    def predict(c: IterationCosts) -> Prediction:
        return Prediction(
            c.base_mb + max(c.decode_mb, c.later_update_mb, c.optimizer_stage_mb),
            c.forward_steps * c.f
            + (c.score if c.score_at_end is None else c.score_at_end)
            + c.epochs * (c.edge_steps * c.fb + c.ref),
            optimizer_peak_mb=c.base_mb + c.optimizer_stage_mb,
        )
