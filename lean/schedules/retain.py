"""LeanGRPO-Retain: keep the rollout's own graphs and backpropagate them once the advantages are known.

On-policy (one optimizer step per rollout batch, one inner epoch, same dtype and process), the update's forward pass
at trained step j is the rollout's forward pass at step j: same weights, same x_j, same noise. Retain therefore runs
the trained steps of the rollout with autograd on (other steps under ``no_grad``) and keeps, per trained step, the
log-prob and transition mean together with their graphs and saved activations. After rewards and advantages A:

    L = 1/(N K) sum_b sum_{j in T_b} [ max(-A_b r_bj, -A_b clip(r_bj, 1-c, 1+c)) + beta KL_bj ],
        r_bj = exp(log p_bj - stopgrad(log p_bj)) = 1,  so  dL/dtheta = 1/(N K) sum_bj [ -A_b dlog p_bj + beta dKL_bj ]

and one ``L.backward()`` replaces Recompute's K forward + backward passes: no second forward. The price is memory: the
activations of (trained steps x local batch) forward passes stay alive until the backward; ``lean plan`` predicts it
(``predict``, in the terms of ``base.IterationCosts``):

    memory = base + K act h + max(decode, transient)      time = (n - K) f + K fb + score + ref

(with S > 1 updates per rollout, the hybrid of ``hybrid.py``: h = s = 1/S, the tracked work s of it, and Recompute's
later updates on top: time + (E - s)(K fb + ref), memory at least Recompute's update's).

where h is the share of the local batch whose graphs are held at once: 1 in the slice layout, one finishing unit
(a group) / B in the group layout, where each group is backpropagated as soon as it is scored (``finish_rows``).

Backward during the scoring (group layout). A group's graphs can be freed only by its backward, and the next group
cannot roll out before (that would hold two groups' graphs). Instead of waiting for the group's rewards, Retain
backpropagates it while it is decoded and scored (``unit_rolled_out``), with a provisional advantage Â_b = 1 and each
trajectory's policy gradient kept apart (``per_sample``, as Reweight does; the KL part, which has no A, goes to the
gradient directly), then folds it when the advantages arrive (``finish_rows``):

    grad += sum_b (A_b / Â_b) P_b,     P_b = 1/(N K) sum_{j in T_b} (-Â_b dlog p_bj)

exact on-policy for the reason Reweight is (the gradient is linear in A at r = 1). It needs every trainable parameter
in an ``nn.Linear`` (LoRA) and N before the rewards (not with ``algorithm.skip_zero_advantage``); otherwise the group
waits for its rewards and is backpropagated with them. The scoring then costs max(0, score - K (fb - f)): the
backward hides it, for (unit + 1) P of buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from lean.algorithms import StepLoss, loss_stats
from lean.algorithms.base import RATIO_ONE_ON_POLICY, step_targets
from lean.config import AUTO, ConfigError, check_choice, check_positive, register_options
from lean.observe.metrics import host_memory_mb
from lean.parallel.sharding import is_sharded
from lean.sampling.rollout import row_ids
from lean.sampling.transition import Transition
from lean.sampling.tree import tree_shape
from lean.schedules.base import (
    IterationContext,
    IterationCosts,
    OptimizerStep,
    Prediction,
    Schedule,
    set_grads,
    trainable,
)
from lean.schedules.hybrid import later_updates
from lean.schedules.offload import HostMemoryExceeded, SavedTensorOffload, offload_mode
from lean.schedules.per_sample import (
    PROVISIONAL_ADVANTAGE,
    PerSampleGrads,
    TermCells,
    TrajectoryBuffers,
    linear_owners,
    logged_with_true_targets,
)
from lean.schedules.recompute import Recompute

ALL_STEPS = "all"  # train.retain.steps: every trained step's graph is kept (Retain as first published)
DEVICE, HOST = "device", "host"  # train.retain.offload: where the kept graphs wait (YAML reads a bare off as false)
OFFLOADS = (DEVICE, HOST)
# train.retain.backward: one backward per finishing unit (all its kept graphs at once), or one per kept step and
# micro-batch in Recompute's order (train.recompute_batching=rollout): its gradient then Recompute's to the bit
UNIT_BACKWARD, STEP_BACKWARD = "unit", "step"


OPTIONS_KEY = "train.retain"  # where these options sit: a group of the train section


@register_options(OPTIONS_KEY)
@dataclass
class RetainOptions:
    """What Retain keeps and where it keeps it (docs/design/retain-offload.md). The defaults are Retain as published:
    every trained step's graph, on the device."""

    steps: int | str = ALL_STEPS
    """m: the trained steps per sample whose graphs are kept, the last m of each sample's; the others are recomputed
    after the rewards as Recompute does, so the gradient is Recompute's for any m. all: every trained step (K); auto:
    the largest m whose peak fits ``train.memory_budget_mb`` (``lean plan`` counts it)."""
    offload: str = DEVICE
    """Where the kept graphs wait for the backward: device (no offload) | host (pinned host memory, copied on a side
    stream as each step produces them, fetched back one step ahead of the backward: ``lean/schedules/offload.py``) |
    auto (host where the device would not hold them, else device)."""
    host_memory_budget_mb: float | None = None
    """Host memory one process may pin for offloaded graphs; None: the available RAM x 0.9, shared by the node's
    processes."""
    host_link_gb_s: float | None = None
    """Host link bandwidth per direction, GB/s, for the plan; None: measured on a CUDA device, else the GPU kind's
    table value (``lean.plan.meta``)."""
    backward: str = UNIT_BACKWARD
    """unit: one backward per finishing unit, of every kept graph's loss at once | step: one backward per kept step
    and rollout micro-batch, steps in order, as Recompute runs its update under ``train.recompute_batching=rollout``:
    where the kernels are deterministic the gradient, the update and the AdamW moments are Recompute's bit for bit
    (LeanGRPO App. E; ``lean equivalence --deterministic``), at one backward launch per kept graph."""

    def validate(self, prefix: str) -> None:
        if isinstance(self.steps, str):
            check_choice(f"{prefix}.steps", self.steps, (ALL_STEPS, AUTO))
        elif self.steps < 1:
            raise ConfigError(f"{prefix}.steps", self.steps, "keeps no graph: that is train.schedule=recompute")
        check_choice(f"{prefix}.offload", self.offload, (*OFFLOADS, AUTO))
        check_choice(f"{prefix}.backward", self.backward, (UNIT_BACKWARD, STEP_BACKWARD))
        for key in ("host_memory_budget_mb", "host_link_gb_s"):
            if getattr(self, key) is not None:
                check_positive(f"{prefix}.{key}", getattr(self, key))

    @property
    def is_default(self) -> bool:
        return self.steps == ALL_STEPS and self.offload == DEVICE and self.backward == UNIT_BACKWARD


class Retain(Schedule):
    exact_only_on_policy = True
    needs = frozenset({RATIO_ONE_ON_POLICY})  # the rollout's graph is the objective's

    def __init__(self, ctx):
        super().__init__(ctx)
        # train.retain.backward=step: each kept graph as Recompute's recomputed one (its CFG batch too), backpropagated
        # on its own in Recompute's order: Recompute's gradient bit for bit where the kernels are deterministic
        self.joint_cfg = ctx.cfg.train.retain.backward == STEP_BACKWARD
        self.kept: list[Transition] = []  # the tracked steps with their graphs (and the reference's means)
        self.losses = []  # every backpropagated step's loss terms, for the stats
        self.provisional_stats: list[tuple[TermCells, StepLoss]] = []  # (where, terms) backpropagated with Â
        self.unscaled = False  # an early finish under skip_zero_advantage used N = 1 (N is known only at the end)
        self.later = later_updates(ctx)  # several updates per rollout: only the first's rows keep graphs (hybrid.py)
        if self.later is not None:
            self.track_rows = self.later.track_rows
            if self.later.tracked_steps is not None:  # a tree's first edges: their nodes alone (hybrid.EdgeUpdates)
                self.any_trained, self.track_cells = self.later.tracked_steps, self.later.cells
        options = ctx.cfg.train.retain
        # a hybrid's later updates store every trained step already: its Recompute recomputes the terms not kept
        recompute = None if self.later is None else self.later.recompute
        self.partial = partial_retention(ctx, options.steps, self.track_rows, recompute)
        self.offload = host_offload(options, ctx.sigmas.device) if options.offload == HOST else None
        # (per-trajectory buffers, their hooks) or None; an offloaded run's buffers would hold the inputs on the device
        early = self.finishes_early and self.offload is None
        self.provisional = self._provisional_buffers(ctx) if early else None

    def saving(self):
        return super().saving() if self.offload is None else self._offloading()

    @contextlib.contextmanager
    def _offloading(self):
        try:
            with self.offload.saving():
                yield
        except HostMemoryExceeded as err:  # raised in a pack hook, inside some forward of the rollout
            raise refused_host_memory(err) from None

    def track_grad(self, i: int) -> bool:
        return super().track_grad(i) if self.partial is None else bool(self.partial.kept_steps[i])

    def rows_tracked(self, i: int) -> torch.Tensor | None:
        rows = super().rows_tracked(i)
        if self.partial is None or self.ctx.lockstep:
            return rows
        kept = self.partial.kept[:, i]
        return kept if rows is None else rows & kept

    @staticmethod
    def _provisional_buffers(ctx) -> tuple[TrajectoryBuffers, PerSampleGrads] | None:
        """Buffers for one finishing unit's per-trajectory gradients where the backward can run during the scoring
        (see the module docstring), else None."""
        params = trainable(ctx.policy)
        # N, and each KL term's weight, must be known before the rewards (the KL goes to the gradient at once)
        after_rewards = ctx.cfg.algorithm.skip_zero_advantage or ctx.algorithm.weighs_regulariser
        if ctx.finish_unit is None or after_rewards or any(is_sharded(p) for p in params):
            return None
        # per-trajectory buffers split by row: a tree's edges share their node's row and differ in target (waits)
        if linear_owners(ctx.policy, params) is None or tree_shape(ctx.cfg.sample) is not None:
            return None
        buffers = TrajectoryBuffers(params, ctx.finish_unit)
        return buffers, PerSampleGrads(ctx.policy, params, buffers)

    def on_step(self, step: Transition) -> None:
        if self.later is not None:
            self.later.on_step(step)
        elif self.partial is not None:
            self.partial.recompute.on_step(step)
        if step.log_prob.requires_grad:
            if self.offload is not None:  # the step's tracked forward is done: its saved tensors form one group
                self.offload.close_group()
            self.kept.append(self.ctx.with_reference(step))

    def _take(self, rows: slice) -> list:
        """Remove and return the kept steps of the rows ``rows`` (whole micro-batches)."""
        inside = [rows.start <= int(row_ids(step.rows)[0]) < rows.stop for step in self.kept]
        taken = [e for e, yes in zip(self.kept, inside) if yes]
        self.kept = [e for e, yes in zip(self.kept, inside) if not yes]
        return taken

    def unit_rolled_out(self, rows: slice) -> None:
        """Group layout, while ``rows`` are scored: backpropagate their kept steps with Â = 1, each trajectory's
        policy gradient into its buffer and the KL gradient into ``param.grad``, freeing their graphs."""
        if self.provisional is None:
            return
        buffers, per_sample = self.provisional
        ctx, params = self.ctx, buffers.params
        unit = ctx.finish_unit
        entries = self._take(rows)
        # one backward per set of tracked rows (a rollout micro-batch, or the rows of it that train a step)
        by_rows: dict[tuple[int, ...], list] = {}
        for step in entries:
            by_rows.setdefault(tuple(row_ids(step.rows).tolist()), []).append(step)
        for ids, mine in sorted(by_rows.items()):
            policy, kl = 0.0, 0.0
            for step in mine:
                provisional = torch.full_like(step.log_prob, PROVISIONAL_ADVANTAGE)  # one per row of the step
                loss = ctx.algorithm.step_loss(step, provisional)
                weights = ctx.term_weights(step.rows, step.index, ctx.batch)
                policy = policy + (weights * loss.policy).sum()
                if loss.kl is not None:
                    kl = kl + (weights * ctx.algorithm.kl_weight * loss.kl).sum()
                kl_term = None if loss.kl is None else loss.kl.detach()
                terms = StepLoss(loss.policy.detach(), kl_term, loss.ratio.detach())
                self.provisional_stats.append((TermCells(step.rows, step.index), terms))
            with ctx.region("backward"):
                trajectories = torch.tensor(ids, device=params[0].device) % unit
                per_sample.backward(policy, trajectories, retain_graph=torch.is_tensor(kl))
                if torch.is_tensor(kl):
                    kl.backward()

    def finish_rows(self, rows: slice, advantages: torch.Tensor) -> None:
        """Group layout: backpropagate the kept steps of the scored groups ``rows`` and free their graphs, so the
        next group's rollout starts with none of them held (or, when ``unit_rolled_out`` did, fold their buffers)."""
        if self.provisional is not None:
            buffers, _ = self.provisional
            set_grads(buffers.params, buffers.combine_rows(rows, advantages / PROVISIONAL_ADVANTAGE))
            buffers.storage.zero_()
            return
        done = self._take(rows)
        kept, n = self.ctx.kept_samples(advantages)
        if kept is not None:  # N counts the kept samples of every group, known after the last one: scale then
            self.unscaled, n = True, 1
        self._backward(done, advantages, kept, n)
        self._release_offloaded()

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        kept, n = self.ctx.kept_samples(advantages)
        if self.later is not None:  # the first update's (kept) samples, or a tree's first edges
            kept, n = self.later.first_update(kept, n)
        held = self._offload_held()  # what is still on the device while the graphs wait
        self._backward(self.kept, advantages, kept, 1 if self.unscaled else n)
        self.kept = []
        offloaded = {**held, **self._offload_fetched()}
        self._release_offloaded()
        if self.partial is not None:  # the trained steps whose graphs were not kept, recomputed
            recomputed, n_terms = self.partial.recomputed, 1 if self.unscaled else n
            self.losses += self.partial.recompute.recompute_terms(recomputed, advantages, n_terms, kept)
        if self.unscaled:
            for p in trainable(self.ctx.policy):
                if p.grad is not None:
                    p.grad.div_(n)
        if self.provisional is not None:
            self.provisional[1].close()
        losses = self.losses + logged_with_true_targets(self.ctx.algorithm, self.provisional_stats, advantages)
        first = len(losses)
        stats = optimizer_step()
        if self.later is not None:
            recomputed, stats = self.later.run(advantages, optimizer_step)
            losses += recomputed
        return {**loss_stats(losses, first), **stats, **offloaded}

    def _release_offloaded(self) -> None:
        """Every kept graph has been backpropagated: the offload's records are dead, its arena starts over."""
        if self.offload is not None and not self.kept:
            self.offload.reset()

    def _offload_fetched(self) -> dict:
        """After the backward: what the offload brought back (MiB per process) and how many groups the backward read
        before their prefetch."""
        if self.offload is None:
            return {}
        stats = self.offload.stats
        return {"offload_fetched_mb": stats.fetched_bytes * 2.0**-20, "offload_demand_fetches": stats.demand_fetches}

    def _offload_held(self) -> dict:
        """Before the backward: what the offload moved out this iteration (MiB per process) and what of it is still on
        the device."""
        if self.offload is None:
            return {}
        stats, mib = self.offload.stats, 2.0**-20
        return {
            "offload_moved_mb": stats.moved_bytes * mib,
            "offload_resident_mb": stats.resident_bytes * mib,
            "offload_device_live_mb": self.offload.device_live_bytes() * mib,
            "offload_host_mb": (self.offload.arena.high_water if self.offload.arena else 0) * mib,
            "offload_groups": stats.groups,
        }

    def _backward(self, entries: list, advantages: torch.Tensor, kept: torch.Tensor | None, n) -> None:
        """The backward of the loss terms of ``entries`` (their graphs die with it), weighted 1/(n K): one of them
        all, or with ``train.retain.backward: step`` one per entry, in Recompute's order (step, then micro-batch)."""
        ctx = self.ctx
        per_step = ctx.cfg.train.retain.backward == STEP_BACKWARD
        if per_step:
            entries = sorted(entries, key=lambda step: (step.index, int(row_ids(step.rows)[0])))
        terms = []
        for step in entries:
            loss = ctx.algorithm.step_loss(step, step_targets(advantages, step))
            weights = ctx.term_weights(step.rows, step.index, n, kept)
            terms.append((weights * ctx.total(loss, step.rows)).sum())
            self.losses.append(ctx.logged(loss, step.rows))
        if not terms:
            return
        with ctx.region("backward"):
            for term in terms if per_step else [sum(terms)]:  # per kept graph, or all at once
                term.backward()

    @staticmethod
    def predict(c: IterationCosts) -> Prediction:
        """Peak and time with q = m / K of the trained steps kept (``c.retained``; the others recomputed after the
        rewards), on the device or offloaded (``c.offload``, :func:`kept_graphs`):

            time   = (n - K q s) f + K s fb + score + s ref [+ later updates] + exposed transfers
            memory = base + max(kept + max(decode, transient), [q < 1 or later] Recompute's update peak)

        s = the first update's share with several updates per rollout (a hybrid), else 1; kept = K q act h on the
        device (h = the rows held at once: s, or one finishing unit / B). On a tree rollout n and K count the nodes'
        forwards and the trained nodes' (``IterationCosts.forward_steps``, ``tracked_steps``): one graph per trained
        node, however many edges it feeds (docs/design/tree-rollouts.md, sections 3.2 and 4)."""
        q, s = c.retained, c.first_share if c.later else 1.0
        score = (c.score if c.score_at_end is None else c.score_at_end) if c.later else c.score
        k, n = c.tracked_steps, c.forward_steps  # K and n, or a tree's trained nodes and nodes, / B
        held = k * q * (s if c.later else c.held_fraction)  # tracked steps' activations held at once, / act
        kept = kept_graphs(c, held, units=1 if c.later else round(1 / c.held_fraction))
        held_mb = kept.peak_memory_mb
        # the backward runs beside the scoring (group layout, every step kept on the device, a flat rollout: the
        # module docstring; a tree waits for its rewards)
        early = c.held_fraction < 1 and c.per_row_grads and c.n_known and q == 1 and not c.offload
        if early and not c.later and c.rows is None:
            held_mb += (c.local * c.held_fraction + 1) * c.trainable_mb
            score = max(c.score - k * (c.fb - c.f), 0.0)
        memory = held_mb + max(c.decode_mb, c.transient_mb)
        if c.later or q < 1:  # the recomputed terms: Recompute's update, after the kept graphs are freed
            memory = max(memory, c.later_update_mb)
        memory = max(memory, c.optimizer_stage_mb)  # the kept graphs are freed by then
        time = (n - k * q * s) * c.f + k * s * c.fb + score + s * c.ref + (c.later_update_s if c.later else 0)
        return dataclasses.replace(
            kept,
            peak_memory_mb=c.base_mb + memory,
            time_iteration_s=time + kept.exposed_transfer_s,
            held_mb=held_mb,
            optimizer_peak_mb=c.base_mb + c.optimizer_stage_mb,
        )


def kept_graphs(c: IterationCosts, held: float, units: int) -> Prediction:
    """What ``held`` tracked steps' activations (in units of ``c.act_mb``, per finishing unit; ``units`` of them per
    iteration) cost beyond the base: device MiB (``peak_memory_mb``), host MiB, MiB moved each way and the exposed
    copy seconds (``time_iteration_s`` left 0).

    On the device: held act. Offloaded (``c.offload``), H = held act_moved per process on the host, and the device
    holds the resident part (parameters' views, leaves) plus two groups of a = act_group: one copying while the next
    is produced (in the backward: one backpropagated, one prefetched). Each group's copy, a / B at the link's B,
    overlaps the next group's compute (f_g = f a / act_moved forward, b_g = (fb - f) a / act_moved backward); the
    group at a unit's boundary overlaps the unit's scoring (score / units). With G = units H / a groups:

        exposed D2H = units max(0, a/B - score/units) + (G - units) max(0, a/B - f_g)   (H2D: b_g for f_g)

    The DMA engines run each direction on their own: the two do not add to each other's time, only to the step's."""
    if not c.offload:
        return Prediction(held * c.act_mb, 0.0)
    moved_mb = c.act_mb if c.act_moved_mb is None else c.act_moved_mb
    host = held * moved_mb
    if host <= 0:
        return Prediction(held * c.act_mb, 0.0)
    group = min(c.act_group_mb or moved_mb, host)
    groups, copy = units * host / group, group / c.link_mb_s
    boundary = units * max(0.0, copy - c.score / units)
    d2h = boundary + (groups - units) * max(0.0, copy - c.f * group / moved_mb)
    h2d = boundary + (groups - units) * max(0.0, copy - (c.fb - c.f) * group / moved_mb)
    resident = held * max(c.act_mb - moved_mb, 0.0)  # moved counts views' spans, act storages: it can be above
    total = units * host
    return Prediction(resident + 2 * group, 0.0, host, total, total, d2h + h2d)


def host_offload(options: RetainOptions, device: torch.device) -> SavedTensorOffload:
    """The offload of ``train.retain.offload=host``, its arena bounded by ``host_memory_budget_mb`` (default: the
    available RAM x 0.9 over the node's processes); past it the rollout stops with one line naming the keys."""
    budget_mb = host_budget_mb(options)
    return SavedTensorOffload(offload_mode(device), host_limit_bytes=None if budget_mb is None else budget_mb * 2**20)


def host_budget_mb(options: RetainOptions) -> float | None:
    """Host MiB one process may pin for offloaded graphs: ``train.retain.host_memory_budget_mb``, else 90% of the
    available RAM over the node's processes (None: unknown, no bound)."""
    return options.host_memory_budget_mb or host_memory_mb()


def refused_host_memory(err: HostMemoryExceeded) -> ConfigError:
    """The one-line refusal of an offload that outgrew the host budget."""
    return ConfigError(
        "train.retain.offload",
        HOST,
        f"the kept graphs need more than {err.limit / 2**20:.0f} MiB of host memory per process (train.retain."
        "host_memory_budget_mb, default 90% of the available RAM over the node's processes): keep fewer steps "
        "(train.retain.steps) or raise the budget",
    )


class PartialRetention:
    """Which trained terms keep their graphs and which are recomputed (``train.retain.steps`` = m < K).

    Each sample keeps the last m of its trained steps T_b (L_b) and the others (R_b = T_b minus L_b) are recomputed
    after the rewards by Recompute's code on those terms alone, at the same weights 1/(N K), before the one optimizer
    step. The objective is a sum of per-term losses whose inputs are detached, so

        grad L = sum_b sum_{j in L_b} w_bj grad l_bj  +  sum_b sum_{j in R_b} w_bj grad l_bj

    the first sum from the rollout's graphs (ratio 1), the second recomputed at the same weights (ratio 1 up to
    rounding): Recompute's gradient for every m (m = K is Retain, m = 0 Recompute). The last steps, because the
    backward needs them first and their memory is m act h whatever the per-sample draw. In lockstep (a sharded policy:
    every process runs the same forwards) the kept steps are the last m of the steps any process trains, for every
    row, and the others are recomputed for every row (weight 0 where a row does not train the step).

    ``kept``, ``recomputed``: host bool [B, num_steps], disjoint, their union the trained terms (of the first
    update's rows in a hybrid); ``kept_steps`` [num_steps]: the steps the rollout tracks."""

    def __init__(self, ctx: IterationContext, m: int, track_rows: torch.Tensor | None, recompute: Recompute | None):
        trained = ctx.steps.trained.cpu()
        if track_rows is not None:  # a hybrid: the first update's rows only
            trained = trained & track_rows[:, None]
        if ctx.lockstep:
            shared = ctx.steps.grad_steps.cpu()
            self.kept_steps = shared & (shared.flip(0).cumsum(0).flip(0) <= m)
            self.kept = trained & self.kept_steps
        else:
            self.kept = trained & (trained.flip(1).cumsum(1).flip(1) <= m)  # at most m trained steps from it on
            self.kept_steps = self.kept.any(0)
        self.recomputed = trained & ~self.kept
        if recompute is None:  # one that stores the recomputed steps' inputs during the rollout (Retain.on_step)
            recompute = Recompute(ctx)
            shared_steps = ctx.steps.grad_steps.cpu() & ~self.kept_steps
            recompute.any_trained = shared_steps if ctx.lockstep else self.recomputed.any(0)
        self.recompute = recompute


def partial_retention(
    ctx: IterationContext, steps: int | str, track_rows: torch.Tensor | None, recompute: Recompute | None
) -> PartialRetention | None:
    """The :class:`PartialRetention` of ``train.retain.steps`` = m, or None where every trained step is kept (all, or
    m at least the steps a sample trains: K, in lockstep the steps any process trains). ``recompute``: a hybrid's
    (it stores every trained step), else one of its own."""
    if steps == ALL_STEPS:
        return None
    if steps == AUTO:
        raise ConfigError("train.retain.steps", steps, "is resolved by lean train before the run (lean.plan.cost)")
    if steps >= (int(ctx.steps.grad_steps.sum()) if ctx.lockstep else ctx.steps_per_sample):
        return None
    return PartialRetention(ctx, steps, track_rows, recompute)
