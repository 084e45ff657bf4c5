"""What the three schedules share: the contract, the iteration's context, the per-term loss weights, flat gradient
buffers, and the inputs of their cost models.

A schedule decides these things and nothing else:
  * ``track_grad(i)`` / ``grad_micro_batch`` / ``rows_tracked(i)``: which rollout steps run with autograd on, in
    which micro-batches, for which rows;
  * ``on_step(step)``: what to do with each SDE step of the rollout, a ``lean.sampling.transition.Transition``
    (store what the algorithm reads of it, keep its graph, or backpropagate it);
  * ``finish(advantages, optimizer_step)``: turn the advantages into gradients in ``param.grad`` and call
    ``optimizer_step()`` (which syncs the gradients across processes, clips, steps the optimizer) once per update;
  * ``finish_rows(rows, advantages)`` (group layout, ``lean.parallel.layout``): the trajectories ``rows`` are scored and
    their advantages known before the rollout goes on; a schedule may turn them into gradients now (and free what it
    held for them). ``finish`` then does the rest.
Its class also states what it costs: ``predict(costs)``, the peak memory and time per iteration that ``lean plan``
reports, from the step costs ``lean.plan.cost.probe`` measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lean.algorithms import Algorithm, StepLoss
from lean.models.snapshot import Snapshot
from lean.observe.metrics import FlopTally, PhaseTimer
from lean.sampling.rollout import Sampler, reference_mean
from lean.sampling.sde import StepSelection
from lean.sampling.transition import Transition

if TYPE_CHECKING:
    from lean.config import RunConfig


@dataclass(kw_only=True)
class IterationContext:
    """Everything about one process's share of one iteration that a schedule needs (built by keyword)."""

    policy: object
    cfg: RunConfig
    algorithm: Algorithm  # what is optimised: the loss of each step (lean.algorithms)
    sigmas: torch.Tensor
    emb: object  # PromptEmbeds of the local samples
    steps: StepSelection  # trained: BoolTensor [B_local, num_steps]
    iteration: int = 0
    finish_unit: int | None = (
        None  # rows finished together before the rollout goes on (lean.parallel.layout); None: all
    )
    tally: FlopTally = field(default_factory=FlopTally)  # counts only inside tally.measuring()
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (group, prompt, sample) of each local row
    snapshot: Snapshot | None = None  # the algorithm's second weights (lean.models.snapshot), where it keeps them
    # each local sample's factor [B] on its regulariser, known after the rewards (Algorithm.regulariser_factors: set
    # with the advantages, before ``finish``); None: 1
    kl_factors: torch.Tensor | None = None

    @contextlib.contextmanager
    def region(self, name: str):
        """Time and count the FLOPs of a named part of the work (backward, recompute_forward, ...)."""
        with self.timer(name), self.tally.region(name):
            yield

    @functools.cached_property
    def sampler(self) -> Sampler:
        """The run's sampler on the iteration's grid."""
        return Sampler(self.cfg.sample, self.sigmas)

    @property
    def batch(self) -> int:
        return self.steps.trained.shape[0]

    @property
    def lockstep(self) -> bool:
        """Every process must run the same passes (a sharded policy, ``lean.parallel.sharding``): no pass is skipped
        because no local sample trains it."""
        return self.steps.shared_grad_steps is not None

    @property
    def steps_per_sample(self) -> int:
        """K: every sample trains the same number of steps."""
        return int(self.steps.trained[0].sum())

    @functools.cached_property
    def trained_on_device(self) -> torch.Tensor:
        """``steps.trained`` [B, num_steps] on the compute device, for the loss weights (one copy per iteration)."""
        return self.steps.trained.to(self.sigmas.device)

    def term_weights(
        self, rows: slice, i: int, samples_per_update: int | torch.Tensor, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Weight of each (sample, step i) loss term in the objective: 1/(N K) if step i is trained for it (and the
        sample is ``kept`` [B], or the cell is ``kept`` [B, num_steps], when given), else 0."""
        trained = self.trained_on_device[rows, i].to(self.sigmas.dtype)
        if kept is not None:
            trained = trained * (kept[rows] if kept.dim() == 1 else kept[rows, i]).to(trained.dtype)
        return trained / (samples_per_update * self.steps_per_sample)

    def kept_samples(self, targets: torch.Tensor) -> tuple[torch.Tensor | None, int | torch.Tensor]:
        """(which local samples [B] or trained cells [B, num_steps] the update keeps, None for all; the N of
        1/(N K)); the algorithm's choice (GRPO with ``algorithm.skip_zero_advantage`` drops the samples whose
        advantage is 0, BranchGRPO's width pruning some of a tree's last edges)."""
        return self.algorithm.kept_terms(targets, self.steps.trained, self.iteration)

    def total(self, loss: StepLoss, rows) -> torch.Tensor:
        """The loss terms [b] of a step's ``rows``: policy + beta kl, each row's KL times its factor where the
        algorithm weighs its regulariser after the rewards (:attr:`kl_factors`)."""
        return loss.total(self.algorithm.kl_weight, None if self.kl_factors is None else self.kl_factors[rows])

    def logged(self, loss: StepLoss, rows) -> StepLoss:
        """``loss`` with its rows' regulariser factors, for the logs (``lean.algorithms.loss_stats``)."""
        if self.kl_factors is None or loss.kl is None:
            return loss
        return dataclasses.replace(loss, kl_factor=self.kl_factors[rows])

    def with_reference(self, step: Transition) -> Transition:
        """The step with the reference policy's transition mean at its x_i, for the KL term (the step itself when the
        regulariser is off)."""
        if self.algorithm.kl_weight == 0:
            return step
        with self.region("reference_forward"):
            ref_mean = reference_mean(self.policy, self.sampler, step, self.emb.index(step.rows))
        return dataclasses.replace(step, ref_mean=ref_mean)


OptimizerStep = Callable[[], dict]


@dataclass(frozen=True)
class RowCounts:
    """One process's rollout counted in rows, a row being one transformer forward of one latent
    (docs/design/tree-rollouts.md, section 4). On a flat rollout of B samples, n steps, K trained: forwards = B n,
    trained_forwards = trained_edges = B K, leaves = B. On T trees (``lean.sampling.tree``), live(i) nodes at step i:

        forwards         = T sum_i live(i)                    every node's forward
        trained_forwards = T sum_{i trained} live(i)          the trained nodes: Retain's kept graphs (one per node)
        trained_edges    = T sum_{i trained} edges(i)         Recompute's update forwards (one per edge), the KL's
        leaves           = T L = B                            what is decoded and scored
    """

    forwards: int
    trained_forwards: int
    trained_edges: int
    leaves: int


@dataclass(frozen=True)
class IterationCosts:
    """One process's iteration in the terms of the cost models (seconds and MiB; ``lean.plan.cost.probe`` measures).

    n steps, K trained per sample, B local samples; f / fb: one untracked step / one tracked step plus its backward
    over the local batch (all rollout micro-batches); fb_one: the same for one trajectory; ref: the reference
    forwards of the KL term (0 without it); score: the decoding and scoring the iteration waits for, which every
    schedule pays once (the local batch's, or with ``reward.async_scoring`` the last rollout micro-batch's: the others
    are scored while the rollout goes on; in the group layout a schedule that finishes groups early waits for every
    group's, one that does not waits for ``score_at_end``, the last's only). Memory: base (resident now), act /
    act_one: activations one tracked step saves at the local batch / one trajectory; transient: what a backward needs
    beyond them; decode: the VAE's working set for one rollout micro-batch (each is decoded on its own); trainable:
    the trainable parameters (MiB). A tree rollout counts its forwards in ``rows`` (:class:`RowCounts`), each
    figure per step of the local batch scaled by rows / B (:attr:`forward_steps`, :attr:`tracked_steps`,
    :attr:`edge_steps`; n, K, K on a flat rollout).
    """

    n: int
    k: int
    local: int
    f: float
    fb: float
    fb_one: float
    ref: float
    score: float
    base_mb: float
    act_mb: float
    act_one_mb: float
    transient_mb: float
    decode_mb: float
    trainable_mb: float
    train_rows_fraction: float  # Recompute's update micro-batch / the local batch
    kl: bool  # the KL term is on
    per_row_grads: bool  # every trainable parameter sits in an nn.Linear (Reweight stays batched)
    held_fraction: float = 1.0  # share of the local batch a schedule holds at once: one finishing unit / B (layout)
    score_at_end: float | None = None  # what a schedule that finishes nothing early waits for (None: ``score``)
    n_known: bool = True  # N and the KL terms' weights known before the rewards (not with skip_zero_advantage, GARDO)
    first_share: float = 1.0  # s: the first update's share of the local batch (1/S with S updates per rollout)
    epochs: int = 1  # E: inner epochs (passes over the rollout's samples)
    # Retain's kept graphs (train.retain, docs/design/retain-offload.md): q = m / K of each sample's trained steps
    # keep their graphs (the others are recomputed), on the device or offloaded to host memory over a link of
    # link_mb_s per direction; act_moved: of act, what an offload moves (parameters and leaves stay on the device);
    # act_group: one offload group's moved bytes (a tracked step at one rollout micro-batch, of the rows held at once)
    retained: float = 1.0
    offload: bool = False
    act_moved_mb: float | None = None  # None: all of act_mb
    # one tracked step at one rollout micro-batch (of act_mb's rounds): what a backward during the rollout frees before
    # the next micro-batch's forward (Reweight); None: act_mb (one micro-batch)
    act_micro_mb: float | None = None
    act_group_mb: float = 0.0
    link_mb_s: float = float("inf")
    host_budget_mb: float = float("inf")  # pinned host memory one process may take
    rows: RowCounts | None = None  # a tree rollout's counts (None: flat, B n forwards and B K trained)
    # what the optimizer stage holds beyond the base (and beyond what a schedule still holds then): the gradient and
    # its flat copy for the sync (lean.run.optimizer), and AdamW's moments where the base lacks them (a probe before
    # the first optimizer step, which allocates them); clipping's and AdamW's per-tensor temporaries come to one
    # parameter's size at most. It sets a full fine-tune's peak where the activations are small (LeanGRPO, arXiv
    # 2609.03528, Fig. 6: Native's peak)
    optimizer_stage_mb: float = 0.0

    @property
    def forward_steps(self) -> float:
        """The rollout's forwards in steps of the local batch (each costs f): n, or a tree's forwards / B."""
        return self.n if self.rows is None else self.rows.forwards / self.local

    @property
    def tracked_steps(self) -> float:
        """The trained nodes' forwards in steps of the local batch (each tracked one costs fb and keeps act): K, or a
        tree's trained_forwards / B."""
        return self.k if self.rows is None else self.rows.trained_forwards / self.local

    @property
    def edge_steps(self) -> float:
        """The trained edges in steps of the local batch (Recompute's update recomputes each): K, or a tree's
        trained_edges / B."""
        return self.k if self.rows is None else self.rows.trained_edges / self.local

    @property
    def backward_act_mb(self) -> float:
        """What a backward in the rollout holds: one tracked step at one rollout micro-batch (:attr:`act_micro_mb`)."""
        return self.act_mb if self.act_micro_mb is None else self.act_micro_mb

    @property
    def later(self) -> bool:
        """Updates after the first (S > 1 or E > 1): a Lean schedule is a hybrid (``lean.schedules.hybrid``)."""
        return self.first_share < 1 or self.epochs > 1

    @property
    def later_update_s(self) -> float:
        """Recompute's cost of every update after the first: (E - s) passes of K recomputed steps and their
        reference forwards."""
        return (self.epochs - self.first_share) * (self.edge_steps * self.fb + self.ref)

    @property
    def later_update_mb(self) -> float:
        """What a recomputed update holds at its peak beyond the base (Recompute's update backward)."""
        return self.act_mb * self.train_rows_fraction + self.transient_mb


@dataclass(frozen=True)
class Prediction:
    peak_memory_mb: float
    time_iteration_s: float
    host_mb: float = 0.0  # pinned host memory per process (offloaded graphs)
    d2h_mb: float = 0.0  # bytes moved to the host per iteration (MiB), and back
    h2d_mb: float = 0.0
    exposed_transfer_s: float = 0.0  # the copies' time not hidden behind compute or scoring (in time_iteration_s)
    # device MiB a schedule holds through the rollout for its update (in peak_memory_mb): Retain's kept graphs,
    # Reweight's gradient buffers (the terms `lean plan` names when a Lean row does not fit)
    held_mb: float = 0.0
    optimizer_peak_mb: float = 0.0  # the optimizer stage's peak (IterationCosts.optimizer_stage_mb beyond the held)


class Schedule:
    """Base class; see the module docstring for the contract."""

    grad_micro_batch: int | None = None
    joint_cfg: bool = False  # tracked CFG steps as one [uncond, cond] batch, as Recompute recomputes them (rollout)
    track_rows: torch.Tensor | None = None  # host bool [B]: the only rows the tracked steps track (None: all)
    track_cells: torch.Tensor | None = None  # host bool [B, num_steps]: the only cells they track (a tree's edges)
    exact_only_on_policy = False  # its graphs give the on-policy update only: several per rollout run as hybrid.py
    needs: frozenset[str] = frozenset()  # the algorithm's facts its exactness rests on (lean.algorithms.FACTS)
    tracks_rollout_graphs = True  # False: it can update from stored steps (a rollout made in another process)
    backward_in_rollout = False  # its backward runs inside the rollout phase (timed there)

    def __init__(self, ctx: IterationContext):
        self.ctx = ctx
        self.any_trained = ctx.steps.grad_steps  # [num_steps]: steps at least one sample trains

    def track_grad(self, i: int) -> bool:
        return bool(self.any_trained[i])

    def rows_tracked(self, i: int) -> torch.Tensor | None:
        """Host bool [B]: the rows whose step i runs with autograd when ``track_grad(i)`` (None: every row): the rows
        that train step i (DanceGRPO draws the trained steps per sample), among ``track_rows``. A row that does not
        train step i would carry a graph that nothing backpropagates, or that is backpropagated with weight 0. In
        lockstep (sharded passes) every process tracks the same forwards, so step i is tracked for every row, but for
        ``track_cells`` (the same on every process)."""
        if self.track_cells is not None:
            return self.track_cells[:, i]
        if self.ctx.lockstep:
            return self.track_rows
        trained = self.ctx.steps.trained[:, i]
        if trained.all():
            return self.track_rows
        return trained if self.track_rows is None else trained & self.track_rows

    def saving(self) -> contextlib.AbstractContextManager:
        """Entered around the rollout: where the tensors autograd saves for the tracked forwards go (Retain's
        offload: ``offload.py``). By default nothing changes."""
        return contextlib.nullcontext()

    def on_step(self, step: Transition) -> None:
        raise NotImplementedError

    def on_finished(self, rows: slice, final: torch.Tensor) -> None:
        """The rows ``rows`` are rolled out; ``final`` [b, ...] is what they decode (their clean samples). By default
        nothing (the schedules of rollout steps keep what they need in :meth:`on_step`)."""

    def unit_rolled_out(self, rows: slice) -> None:
        """Group layout: the rows ``rows`` (whole groups) are rolled out and being scored; what needs no advantage
        can run now, beside the scoring. By default nothing."""

    def finish_rows(self, rows: slice, advantages: torch.Tensor) -> None:
        """``advantages`` [B] hold the true values at ``rows`` (whole groups); by default nothing happens early."""

    @property
    def finishes_early(self) -> bool:
        """Whether :meth:`finish_rows` does anything: the group layout waits for a unit's rewards only then. A hybrid
        (``track_rows``: the first update's samples, across the groups) finishes its whole batch at the end."""
        return type(self).finish_rows is not Schedule.finish_rows and self.track_rows is None

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        raise NotImplementedError

    @staticmethod
    def predict(c: IterationCosts) -> Prediction:
        raise NotImplementedError


# ---------------------------------------------------------------- flat gradient buffers


def trainable(policy) -> list[torch.nn.Parameter]:
    return [p for _, p in policy.trainable_parameters()]


def flat_grad(params: list[torch.nn.Parameter], grads) -> torch.Tensor:
    """Concatenate per-parameter gradients (None -> zeros) into one vector."""
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(params, grads)])


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Write a flat gradient vector into ``param.grad`` (adding to what is there)."""
    offset = 0
    for p in params:
        n = p.numel()
        g = flat[offset : offset + n].view_as(p)
        p.grad = g.clone() if p.grad is None else p.grad + g
        offset += n
