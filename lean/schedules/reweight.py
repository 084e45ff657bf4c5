"""LeanGRPO-Reweight: backpropagate each trained step during the rollout with a provisional advantage, correct later.

Why it is exact. On-policy the ratio is 1, so the gradient of trained step j of trajectory b is

    g_bj = 1/(N K) [ -A_b dlog p_bj + beta dKL_bj ]          (dKL: gradient of the KL term; no A in it)

which is linear in the unknown advantage A_b. During the rollout, the step is backpropagated at once with a provisional
advantage Â_b != 0 (we use Â_b = 1), its graph freed, and the two parts kept apart:

    P_b += 1/(N K) (-Â_b dlog p_bj)      one buffer per trajectory (trajectories must never share one before correction)
    Q   += 1/(N K) beta dKL_bj           one buffer for all (its weight does not depend on A)

When the group is complete and the true (normalised, clipped) advantages are known:

    grad = sum_b (A_b / Â_b) P_b + Q

which equals Recompute's gradient term by term; A_b = 0 and clipped advantages need no special case. Only then are the
gradients synchronised across processes (sync is delayed: ``optimizer_step`` all-reduces once).

Layout. A plain batched backward would sum the gradients of every trajectory in the micro-batch into one buffer.
When every trainable parameter lives in an ``nn.Linear`` (LoRA, or full fine-tuning of linear layers only), the
backward stays batched and ``per_sample.PerSampleGrads`` splits each layer's weight gradient by row (= trajectory);
otherwise the tracked steps run one trajectory per micro-batch. The buffers hold (local trajectories + 1) copies of
the trainable parameters: small with LoRA; their size is reported as ``reweight_buffer_mb``. With beta = 0 there is
exactly one backward per trained step. With the KL term on, each step takes a second backward, and no schedule of
this kind can avoid it: both parts go through the step's Jacobian J (P_b = J^T u_b, Q_b = J^T v_b, u and v the
derivatives of log p and KL in the transition mean), and grad = sum_b J_b^T (A_b u_b + beta v_b) needs both products
while A_b is unknown. A trained step then costs f + 2 (fb - f) against Recompute's f + fb: Reweight is slower than
Recompute whenever a backward costs more than a forward (always), so ``auto`` never takes it with a KL term
(FlowGRPO's SD3 and Wan recipes: 0.88x and 0.90x in ``lean bench schedules --preset``), and Retain, or Retain in the
group layout where memory is short, is the recompute-free schedule there.

In the group layout (``lean.parallel.layout``) the buffers cover one finishing unit of U trajectories (a group): when
its advantages are known, sum_b (A_b / Â_b) P_b is added to one folded buffer and the unit's buffers are reused, so
B buffers become U + 1.

On a tree rollout (``lean.sampling.tree``) the targets are per edge and differ along a leaf's path: the buffers are
one per trained edge of a unit instead, P_c for each cell c = (first leaf, step), folded as sum_c (A_c / Â) P_c + Q,
and a branch step's backward runs in b rounds of one child per node (``edge_buffers.py``).

Cost (``predict``, in the terms of ``base.IterationCosts``; kl = 2 backwards per step with the KL term, else 1; U = B
in the slice layout, where the folded buffer is not needed):

    batched     memory = base + (U + Q [+ 1]) P + max(decode, act_micro + transient)
                time   = n f + K kl (fb - f) + score + ref
    one by one  memory = base + (U + Q [+ 1]) P + max(decode, act_one + transient)
                time   = (n - K) f + K B kl fb_one + score + ref

where Q counts the KL buffers: 0 without the KL term, 1, or U when the algorithm drops samples after the rewards
(``algorithm.skip_zero_advantage``: a dropped sample's KL term leaves with it, so each trajectory keeps its own Q_b
and grad = sum_b (A_b / Â_b) P_b + sum_{b kept} Q_b) or weighs each sample's KL term after them (GARDO's gate,
``Algorithm.regulariser_factors``: grad = sum_b (A_b / Â_b) P_b + sum_b f_b Q_b).

With S > 1 updates per rollout (the hybrid of ``hybrid.py``, U = s B buffers, one per trajectory of the first
update): the backpropagated work is s = 1/S of it, and
Recompute's later updates come on top: time + (E - s)(K fb + ref), memory at least Recompute's update's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from lean.algorithms import StepLoss, loss_stats
from lean.algorithms.base import LINEAR_IN_TARGET, RATIO_ONE_ON_POLICY
from lean.parallel.sharding import is_sharded, reduce_scatter_whole, take_whole_grads
from lean.sampling.transition import Transition
from lean.sampling.tree import tree_shape
from lean.schedules.base import (
    IterationCosts,
    OptimizerStep,
    Prediction,
    Schedule,
    flat_grad,
    set_grads,
    trainable,
)
from lean.schedules.edge_buffers import EdgeSlots
from lean.schedules.hybrid import EdgeUpdates, later_updates
from lean.schedules.per_sample import (
    PROVISIONAL_ADVANTAGE,
    PerSampleGrads,
    TermCells,
    TrajectoryBuffers,
    linear_owners,
    logged_with_true_targets,
)


class Reweight(Schedule):
    exact_only_on_policy = True
    needs = frozenset({RATIO_ONE_ON_POLICY, LINEAR_IN_TARGET})  # the rollout's graph, and the A / Â fold
    backward_in_rollout = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.params = trainable(ctx.policy)
        n = sum(p.numel() for p in self.params)
        dtype = self.params[0].dtype
        # Buffers for one finishing unit (lean.parallel.layout): the whole local batch, or in the group layout the
        # groups scored together, whose buffers are folded into ``folded`` (sum_b (A_b / Â_b) P_b) and reused.
        self.later = later_updates(ctx)  # several updates per rollout: only the first's rows backpropagate (hybrid.py)
        self.first_cells = None  # a tree hybrid's first edges known before the rollout, on the device (hybrid.py)
        if self.later is not None:
            self.track_rows = self.later.track_rows
            if self.later.tracked_steps is not None:  # a tree's first edges: their nodes tracked, their cells buffered
                self.any_trained, self.track_cells = self.later.tracked_steps, self.later.cells
                self.first_cells = self.later.cells.to(ctx.sigmas.device)
        # a hybrid: one buffer per trajectory of the first update, in its slot; else per row of a finishing unit
        self.unit = (ctx.finish_unit if self.finishes_early else None) or ctx.batch
        slots = torch.arange(ctx.batch) % self.unit  # host: local row -> its buffer
        if self.later is not None:
            self.unit, slots = self.later.first_size, torch.zeros(ctx.batch, dtype=torch.long)
            slots[self.later.first] = torch.arange(self.later.first_size)  # the other rows are never backpropagated
        # a tree rollout: a buffer per trained edge of the unit (edge_buffers.py), its targets differing along a path
        shape = tree_shape(ctx.cfg.sample)
        cells = ctx.steps.trained.cpu() if self.first_cells is None else self.later.cells
        self.edges = None if shape is None else EdgeSlots(cells, self.unit, shape, self.params[0].device)
        self.policy_buffers = TrajectoryBuffers(self.params, self.unit if self.edges is None else self.edges.count)
        device = self.params[0].device
        self.kl_buffer = torch.zeros(n, dtype=dtype, device=device) if ctx.algorithm.kl_weight else None
        # a sample the algorithm may drop after the rewards (skip_zero_advantage) takes its KL term with it, and an
        # algorithm may weigh each sample's KL term after the rewards (GARDO's gate): then the KL gradients are kept
        # per trajectory too, Q_b, and folded with their weights (kept: 1, dropped: 0, times the factor)
        self.kl_buffers = None
        # (on a tree: an edge that width pruning leaves out, per edge)
        if ctx.algorithm.kl_weight and (ctx.algorithm.drops_terms or ctx.algorithm.weighs_regulariser):
            count = self.unit if self.edges is None else self.edges.count
            self.kl_buffers, self.kl_buffer = TrajectoryBuffers(self.params, count), None
        if self.edges is not None and self.later is not None and not isinstance(self.later, EdgeUpdates):
            raise ValueError("Reweight on a tree folds its first update's edges, not samples (train.edges_per_update)")
        self.folded = (
            torch.zeros(n, dtype=dtype, device=device) if self.finishes_early and self.unit < ctx.batch else None
        )
        self.finished = 0  # rows [0, finished) are folded
        self.provisional = torch.full((ctx.batch,), PROVISIONAL_ADVANTAGE, dtype=torch.float64, device=device)
        self.slots, self.trajectory_ids = slots, slots.to(device)  # on the host, and on the device for the hooks
        self.kept_stats: list[tuple[TermCells, StepLoss]] = []  # (where, detached loss terms) for logging
        self.samples_per_update = ctx.batch if self.later is None else self.later.first_size  # N of 1/(N K)
        self.per_sample = None
        # a sharded full fine-tune (parallel.grad_sync=per_update): FSDP2 accumulates each backward's gradient
        # unsharded, which is taken from it as the trajectory's own; the corrected sum is reduce-scattered once
        self.sharded = any(is_sharded(p) for p in self.params)
        if linear_owners(ctx.policy, self.params) is not None and not self.sharded:
            self.per_sample = PerSampleGrads(ctx.policy, self.params, self.policy_buffers, to_entries=True)
        else:
            self.grad_micro_batch = 1  # one trajectory per tracked forward: its gradient is its own

    @property
    def buffer_mb(self) -> float:
        flat = [b for b in (self.kl_buffer, self.folded) if b is not None]
        per_trajectory = self.policy_buffers.nbytes + (self.kl_buffers.nbytes if self.kl_buffers else 0)
        return (per_trajectory + sum(b.numel() * b.element_size() for b in flat)) / 2**20

    def on_step(self, step: Transition) -> None:
        if self.later is not None:
            self.later.on_step(step)
        if not step.log_prob.requires_grad:
            return
        ctx = self.ctx
        step = ctx.with_reference(step)  # the rollout's own step: its old values are its own, the ratio is 1
        loss = ctx.algorithm.step_loss(step, self.provisional[step.rows])
        # a tree hybrid's other edges weigh 0 here (they have no buffer): their updates are recomputed
        weights = ctx.term_weights(step.rows, step.index, self.samples_per_update, self.first_cells)
        with ctx.region("backward"):
            if self.edges is None:
                slots, retain_graph = self._slots(step.rows), step.ref_mean is not None
                self._per_trajectory_backward((weights * loss.policy).sum(), slots, self.policy_buffers, retain_graph)
            else:
                self._per_edge_backward(step, weights * loss.policy, self.policy_buffers, step.ref_mean is not None)
            if step.ref_mean is not None:
                kl_terms = weights * ctx.algorithm.kl_weight * loss.kl
                if self.kl_buffers is None:  # every KL term stays: one buffer
                    self.kl_buffer += flat_grad(self.params, self._grads(kl_terms.sum(), retain_graph=False))
                elif self.edges is not None:
                    self._per_edge_backward(step, kl_terms, self.kl_buffers, keep_graph=False)
                else:
                    slots = self._slots(step.rows)
                    self._per_trajectory_backward(kl_terms.sum(), slots, self.kl_buffers, retain_graph=False)
        if self.per_sample is not None:
            self.per_sample.release()  # the step's graph is freed
        kl = None if loss.kl is None else loss.kl.detach()
        self.kept_stats.append((TermCells(step.rows, step.index), StepLoss(loss.policy.detach(), kl, loss.ratio)))

    def _per_edge_backward(
        self, step: Transition, terms: torch.Tensor, buffers: TrajectoryBuffers, keep_graph: bool
    ) -> None:
        """A tree's step: each edge's weighted term of ``terms`` [edges] into its cell's buffer of ``buffers``, in
        rounds of at most one edge per node (``EdgeSlots.rounds``); the graph is kept after the last round when
        ``keep_graph`` (for the KL part)."""
        host, device = self.edges.slots[step.rows, step.index], self.edges.device_slots[step.rows, step.index]
        rounds = self.edges.rounds(step.index, len(host), split_by_row=self.per_sample is not None)
        for k, part in enumerate(rounds):
            retain_graph = keep_graph or k < len(rounds) - 1
            self._per_trajectory_backward(terms[part].sum(), (host[part], device[part]), buffers, retain_graph)

    def _slots(self, rows: slice) -> tuple[Tensor, Tensor]:
        """The buffer slots of the trajectories ``rows``, on the host and on the device (no upload per step)."""
        return self.slots[rows], self.trajectory_ids[rows]

    def _per_trajectory_backward(
        self,
        loss: torch.Tensor,
        slots: tuple[torch.Tensor, torch.Tensor],
        buffers: TrajectoryBuffers,
        retain_graph: bool,
    ) -> None:
        """Add each forward row's gradient of ``loss`` to its buffer of ``buffers``; ``slots``: the rows' slots
        [rows] on the host and on the device."""
        host, device = slots
        if self.per_sample is None:  # one trajectory (or edge) per micro-batch
            buffers.add(int(host[0]), self._grads(loss, retain_graph))
            return
        self.per_sample.backward(loss, device, retain_graph, buffers)

    def _grads(self, loss: torch.Tensor, retain_graph: bool) -> list[torch.Tensor | None]:
        """The whole gradient of ``loss`` for every trained parameter (None: not reached). Sharded: FSDP2's
        backward, whose sync is off, accumulates it unsharded, and it is taken from there (every process runs the
        same backwards: lockstep)."""
        if not self.sharded:
            return list(torch.autograd.grad(loss, self.params, retain_graph=retain_graph, allow_unused=True))
        loss.backward(retain_graph=retain_graph)
        return take_whole_grads(self.ctx.policy, self.params)

    def finish_rows(self, rows: slice, advantages: torch.Tensor) -> None:
        """Group layout: the groups ``rows`` (one finishing unit) are scored: fold their buffers with the true
        advantages and free the buffers for the next unit."""
        kept, _ = self.ctx.kept_samples(advantages)
        if self.edges is not None:  # a tree's: each trained edge's buffer with its own target
            folded = self._edge_fold(rows, advantages, kept)
        else:
            folded = self.policy_buffers.combine_rows(rows, advantages.to(torch.float64) / self.provisional)
            if self.kl_buffers is not None:  # the kept trajectories' KL terms
                folded += self.kl_buffers.combine_rows(rows, self._kl_weights(kept))
        if self.kl_buffers is not None:
            self.kl_buffers.storage.zero_()
        self.folded += folded
        self.policy_buffers.storage.zero_()
        self.finished = rows.stop

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        if self.per_sample is not None:
            self.per_sample.close()
        if self.edges is not None:  # a tree's edges not folded yet (all in the slice layout), each with its target
            kept, n = self.ctx.kept_samples(advantages)
            if self.later is not None:  # a hybrid's first edges (hybrid.EdgeUpdates)
                kept, n = self.later.first_update(kept, n)
            grad = self._edge_fold(slice(self.finished, self.ctx.batch), advantages, kept)
            grad = grad if self.folded is None else grad + self.folded
            if self.kl_buffer is not None:  # every kept edge's KL term, at 1/(B K) too
                grad = grad + self.kl_buffer
            # the buffers are at 1/(B K): 1/(n K) with the edges kept (or the tree script's normaliser)
            grad = grad * (self.samples_per_update / torch.as_tensor(n, dtype=torch.float64, device=grad.device))
        else:
            grad = self._trajectory_gradient(advantages)
            if self.kl_buffer is not None:
                grad = grad + self.kl_buffer
        if self.sharded:  # corrected, then synchronised: one reduce-scatter per unit (Sec. 4.3.2, Eq. 18)
            reduce_scatter_whole(self.ctx.policy, self.params, grad)
        else:
            set_grads(self.params, grad)
        logged = logged_with_true_targets(self.ctx.algorithm, self.kept_stats, advantages, self.ctx.kl_factors)
        first = len(logged)
        step_stats = optimizer_step()
        if self.later is not None:
            recomputed, step_stats = self.later.run(advantages, optimizer_step)
            logged += recomputed
        return {**loss_stats(logged, first), "reweight_buffer_mb": self.buffer_mb, **step_stats}

    def _edge_fold(self, rows: slice, advantages: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """sum_c kept_c [(A_c / Â) P_c + Q_c] over the trained cells c of ``rows`` (``advantages`` [B, num_steps]);
        ``kept`` [B, num_steps] (None: all) is 0 where the algorithm leaves an edge out after the rewards
        (BranchGRPO's width pruning)."""
        kept = torch.ones_like(advantages, dtype=torch.float64) if kept is None else kept.to(torch.float64)
        grad = self.edges.fold(self.policy_buffers, rows, advantages.to(torch.float64) / PROVISIONAL_ADVANTAGE * kept)
        if self.kl_buffers is not None:
            grad += self.edges.fold(self.kl_buffers, rows, kept)
        return grad

    def _trajectory_gradient(self, advantages: torch.Tensor) -> torch.Tensor:
        """sum_b (A_b / Â_b) P_b (+ the kept Q_b) over the trajectories' buffers, and what finished units folded."""
        # The buffers hold each trajectory's gradient at weight 1/(N K) and the provisional advantage: rescale both.
        # A dropped sample (skip_zero_advantage) has A = 0, and the others' N is the kept count.
        kept, n = self.ctx.kept_samples(advantages)
        if self.later is not None:
            n = self.later.first_count(kept)
        # in float64: a kept count is an integer tensor, and int / int in torch rounds to float32 (4 / 3 to 3e-8)
        scale = self.samples_per_update / torch.as_tensor(n, dtype=torch.float64) if kept is not None else 1.0
        coefficients = advantages.to(torch.float64) / self.provisional * scale
        kl_coefficients = None if self.kl_buffers is None else self._kl_weights(kept) * scale  # Q_b of kept b
        if self.later is not None:  # a hybrid: the first update's trajectories, each in its slot
            first = self.later.first.to(coefficients.device)
            return self._combine(self.trajectory_ids[first], coefficients[first], kl_coefficients, first)
        if self.folded is None:  # slice layout: every buffer is combined here
            rows = torch.arange(self.ctx.batch, device=coefficients.device)
            return self._combine(self.trajectory_ids, coefficients, kl_coefficients, rows)
        if self.finished < self.ctx.batch:  # a last unit no early finish folded
            rows = torch.arange(self.finished, self.ctx.batch, device=coefficients.device)
            grad = self._combine(self.trajectory_ids[rows], coefficients[rows], kl_coefficients, rows)
            return grad + self.folded * scale
        return self.folded * scale

    def _kl_weights(self, kept: torch.Tensor | None) -> torch.Tensor:
        """Each local trajectory's weight on its KL buffer Q_b [B] (float64): whether the update keeps it (``kept``
        [B]; None: all), times its factor where the algorithm weighs its regulariser after the rewards."""
        weights = torch.ones(self.ctx.batch, dtype=torch.float64, device=self.provisional.device)
        if kept is not None:
            weights = weights * kept.to(torch.float64)
        return weights if self.ctx.kl_factors is None else weights * self.ctx.kl_factors.to(torch.float64)

    def _combine(
        self, slots: torch.Tensor, coefficients: torch.Tensor, kl_coefficients: torch.Tensor | None, rows: torch.Tensor
    ) -> torch.Tensor:
        """sum_i coefficients[i] P_{slots[i]} (+ kl_coefficients[rows[i]] Q_{slots[i]} with per-trajectory KL)."""
        grad = self.policy_buffers.combine_slots(slots, coefficients)
        if kl_coefficients is not None:
            grad = grad + self.kl_buffers.combine_slots(slots, kl_coefficients[rows])
        return grad

    @staticmethod
    def predict(c: IterationCosts) -> Prediction:
        p = Reweight._predict_tree(c) if c.rows is not None else Reweight._predict_flat(c)
        # its buffers are held through the optimizer stage
        return dataclasses.replace(p, optimizer_peak_mb=c.base_mb + p.held_mb + c.optimizer_stage_mb)

    @staticmethod
    def _predict_flat(c: IterationCosts) -> Prediction:
        backwards = 2 if c.kl else 1  # the KL part needs its own vector-Jacobian product
        # a hybrid (hybrid.py) backpropagates the first update's share s, finishes at the end, then recomputes
        s, later_mb = c.first_share, (c.later_update_mb if c.later else 0.0)
        unit = c.local * (s if c.later else c.held_fraction)  # trajectories with a buffer: the batch, a unit, or s
        folded = not c.later and unit < c.local  # the folded sum of finished units
        # the KL gradient: one buffer, or with samples dropped after the rewards (not n_known) one per trajectory
        kl_buffers = 0 if not c.kl else (1 if c.n_known else unit)
        buffers = (unit + kl_buffers + folded) * c.trainable_mb
        score = c.score if c.score_at_end is None or not c.later else c.score_at_end
        if c.per_row_grads:
            return Prediction(
                c.base_mb
                + buffers
                + max(c.decode_mb, c.backward_act_mb + c.transient_mb, later_mb, c.optimizer_stage_mb),
                c.n * c.f + c.k * s * backwards * (c.fb - c.f) + score + s * c.ref + c.later_update_s,
                held_mb=buffers,
            )
        return Prediction(
            c.base_mb + buffers + max(c.decode_mb, c.act_one_mb + c.transient_mb, later_mb, c.optimizer_stage_mb),
            (c.n - c.k * s) * c.f + c.k * s * c.local * c.fb_one * backwards + score + s * c.ref + c.later_update_s,
            held_mb=buffers,
        )

    @staticmethod
    def _predict_tree(c: IterationCosts) -> Prediction:
        """A tree rollout: a buffer per trained edge of one finishing unit (and per edge for the KL part when edges are
        dropped after the rewards), every node's forward once, and a backward per edge's round: a branch step's b
        rounds each backpropagate the step's nodes, so the backwards count the edges (``edge_steps``) where the
        forwards count the nodes (``tracked_steps``). With several updates by edges (the hybrid's ``EdgeUpdates``):
        s = G / E of it, buffers for the first update's edges, and Recompute's later updates on top."""
        backwards, s = 2 if c.kl else 1, c.first_share if c.later else 1.0
        edges = c.rows.trained_edges * (s if c.later else c.held_fraction)
        kl_buffers = 0 if not c.kl else (1 if c.n_known else edges)
        buffers = (edges + kl_buffers + (c.held_fraction < 1)) * c.trainable_mb
        n, k, e = c.forward_steps, c.tracked_steps * s, c.edge_steps * s
        score = c.score_at_end if c.later and c.score_at_end is not None else c.score
        later_s, later_mb = (c.later_update_s, c.later_update_mb) if c.later else (0.0, 0.0)
        if c.per_row_grads:
            time = n * c.f + e * backwards * (c.fb - c.f) + score + s * c.ref + later_s
            act = c.backward_act_mb + c.transient_mb
        else:
            time = (n - k) * c.f + e * c.local * c.fb_one * backwards + score + s * c.ref + later_s
            act = c.act_one_mb + c.transient_mb
        return Prediction(
            c.base_mb + buffers + max(c.decode_mb, act, later_mb, c.optimizer_stage_mb), time, held_mb=buffers
        )
