"""The one rollout loop, and the one policy step that rollout, update and reference all share.

A trajectory starts from x_0 ~ N(0, I) at sigma_0 = 1 and takes ``num_steps`` steps down the sigma schedule. Steps
that the :class:`~lean.sampling.sde.StepSelection` marks stochastic use the SDE (``sde_step_with_logprob``); the others
are deterministic Euler (ODE) steps. What a rollout samples, and in which micro-batches, is its
:class:`RolloutPlan`; which steps run with gradient tracking is the schedule's choice, and what it does with each
step (a :class:`~lean.sampling.transition.Transition`) is its ``on_step`` hook (:class:`RolloutHooks`). Recompute
runs the whole loop under ``no_grad``; Retain and Reweight track gradients on the trained steps. The loop itself is
the same for all three, so their trajectories are the same.

Random streams: every sample owns a ``torch.Generator`` keyed by (seed, iteration, group, prompt, sample index). Its
step selection, its initial noise and every SDE noise draw come from it in a fixed order, so a trajectory never
depends on the batch it was rolled out in, the micro-batching, or the number of processes. With
``sample.init_same_noise`` (DanceGRPO) the initial noise comes from a stream of the group instead
(:func:`group_init_generator`), the same for all its samples.

What the rollout hands to the decoder (``DECODE_TARGETS``) is the final sample x_N, or DanceGRPO's prediction of
the clean sample at the last step, x̂_0 = x_{N−1} − σ_{N−1} v(x_{N−1}, σ_{N−1}).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lean.config.dtypes import storage_dtype
from lean.config.registry import Registry
from lean.sampling.sde import (
    EULER,
    Generators,
    Sde,
    StepSelection,
    compute_dtype,
    dpm_solver_pp_step,
    ode_step,
    rollout_sigmas,
    sde_step_with_logprob,
)
from lean.sampling.transition import Transition

if TYPE_CHECKING:
    from lean.sampling.options import SampleConfig


def keyed_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from a hash of ``keys`` (numpy's SeedSequence): distinct keys, independent streams."""
    state = np.random.SeedSequence(list(keys)).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def sample_generator(seed: int, iteration: int, group: int, prompt_index: int, sample_index: int) -> torch.Generator:
    """The random stream of one sample: a CPU generator seeded from a hash of its five keys. The group is one of them:
    a prompt drawn twice in one iteration makes two groups, which must not roll out the same trajectories."""
    return keyed_generator(seed, iteration, group, prompt_index, sample_index)


DECODE_TARGETS: Registry[str] = Registry(
    "decode target",
    [
        ("sample", "the final sample x_N (FlowGRPO)"),
        ("x0_prediction", "the last step's prediction x_{N-1} - sigma_{N-1} v (DanceGRPO)"),
    ],
)
_GROUP_STREAM = 2**32 - 1  # the sample-index key of a group's own stream (no sample has this index)


def group_init_generator(seed: int, iteration: int, group: int, prompt_index: int) -> torch.Generator:
    """The stream of a group's shared initial noise (``sample.init_same_noise``): keyed like a sample's, with a
    sample index no sample has, so it never repeats a sample's draws."""
    return sample_generator(seed, iteration, group, prompt_index, _GROUP_STREAM)


RENOISE_STREAM = 1  # the sixth key of a sample's re-noising stream (lean.schedules.renoised)


def renoise_generator(seed: int, iteration: int, group: int, prompt_index: int, sample_index: int) -> torch.Generator:
    """The stream of a sample's re-noising draws after the rollout (NFT, DPO): keyed like the sample's own with a
    sixth key, so it never repeats the rollout's draws and never depends on the batching."""
    return keyed_generator(seed, iteration, group, prompt_index, sample_index, RENOISE_STREAM)


def iteration_generator(seed: int, iteration: int, purpose: int = 0) -> torch.Generator:
    """A stream shared by all processes for one iteration (prompt choice, SDE window)."""
    return keyed_generator(seed, iteration, 2**31 + purpose)


@dataclass(frozen=True)
class Sampler:
    """A run's sampler: its settings (``sample.*``: guidance, SDE kind and noise level, ...) and its sigma grid
    [num_steps + 1] (float32, or float64 for the certificate's twin), on the compute device."""

    cfg: SampleConfig
    sigmas: torch.Tensor

    @property
    def sde(self) -> Sde:
        """The SDE of its stochastic steps."""
        return Sde.of(self.cfg, self.sigmas)


def velocity(policy, x: torch.Tensor, sigma: torch.Tensor, emb, cfg: SampleConfig, joint_cfg: bool = False):
    """The policy's velocity, guided as the sampler ``cfg`` says (the fields ``lean.models.policy.Guidance`` names)."""
    return policy.velocity(x, sigma, emb, cfg, joint_cfg)


def policy_step(
    policy,
    sampler: Sampler,
    step: Transition,
    emb,
    *,
    generators: Generators = None,
    noise: torch.Tensor | None = None,
    joint_cfg: bool = False,
) -> Transition:
    """v = policy(x_i, sigma_i) at ``step.sample`` and ``step.index``, then one SDE step: sample x_{i+1} (from
    ``noise``, or drawn from ``generators``), or score ``step.next_sample`` when the step has it. Returns the step
    with x_{i+1}, its log_prob, mean and std (and the sampler's grid).

    ``step.index`` is an int for the whole micro-batch or a LongTensor [b] on the device (one step per sample). sigma
    stays in the grid's dtype (float32 or float64): a bfloat16 sigma would move the timestep the model sees
    (913.35 -> 916).
    """
    v = velocity(policy, step.sample, sampler.sigmas[step.index], emb, sampler.cfg, joint_cfg)
    nxt, log_prob, mean, std = sde_step_with_logprob(
        sampler.sde, v, step.sample, step.index, prev_sample=step.next_sample, generator=generators, noise=noise
    )
    return dataclasses.replace(step, next_sample=nxt, log_prob=log_prob, mean=mean, std=std, sigmas=sampler.sigmas)


def predicted_x0(v: torch.Tensor, x: torch.Tensor, sigmas: torch.Tensor, index: int) -> torch.Tensor:
    """x̂_0 = x − σ_i v in the step's compute dtype, returned in the sample's dtype."""
    dtype = compute_dtype(x)
    return (x.to(dtype) - sigmas[index].to(dtype) * v.to(dtype)).to(x.dtype)


@torch.no_grad()
def reference_mean(policy, sampler: Sampler, step: Transition, emb) -> torch.Tensor:
    """Mean of the reference policy's transition (adapter disabled) at the step's x_i, scoring its x_{i+1}, for the
    KL term."""
    with policy.reference():
        return policy_step(policy, sampler, step, emb).mean


class StepNoise:
    """The SDE noise of one rollout, drawn on the host ahead of the device.

    Step i's noise for every trajectory comes from the trajectories' own CPU generators, each in its fixed order
    (its initial noise, then one draw per stochastic step), so a trajectory still never depends on the batching.
    :meth:`prefetch` draws the next step's noise into pinned memory and starts a non-blocking copy while the device
    computes the current step; :meth:`take` hands it over. On a CPU it is the same draws without the copy.
    """

    def __init__(
        self, generators: list[torch.Generator], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ):
        self.generators, self.shape, self.dtype, self.device = generators, shape, dtype, device
        self.ready: dict[int, torch.Tensor] = {}

    def prefetch(self, i: int | None) -> None:
        if i is None or i in self.ready:
            return
        pinned = self.device.type == "cuda"
        host = torch.empty((len(self.generators), *self.shape), dtype=self.dtype, pin_memory=pinned)
        for b, g in enumerate(self.generators):
            torch.randn(self.shape, generator=g, dtype=self.dtype, out=host[b])
        self.ready[i] = host.to(self.device, non_blocking=True)  # ordered on the stream; pinned: the host goes on

    def take(self, i: int) -> torch.Tensor:
        self.prefetch(i)
        return self.ready.pop(i)


class OdeSteps:
    """The deterministic steps of a rollout over ``grid``: Euler before step ``tail`` (the first after the last SDE
    step), ``solver`` (``lean.sampling.sde.ODE_SOLVERS``) from it on. DPM-Solver++(2M) reads the previous step's data
    prediction, whatever kind of step that was (MixGRPO-Flash feeds its solver state at every step,
    fastvideo/utils/sampling_utils.py:114-117, :127)."""

    def __init__(self, grid: torch.Tensor, solver: str, tail: int):
        self.grid, self.solver, self.tail = grid, solver, tail

    def start(self) -> OdeSteps.Trajectories:
        return OdeSteps.Trajectories(self)

    class Trajectories:
        """One micro-batch's pass: the data predictions x0 = x - sigma v of its previous step (multistep only)."""

        def __init__(self, steps: OdeSteps):
            self.steps = steps
            self.multistep = steps.solver != EULER and steps.tail < len(steps.grid) - 1
            self.x0: dict[int, torch.Tensor] = {}  # step -> x0 prediction [b, ...] of the micro-batch

        def observe(self, i: int, sub, v: torch.Tensor, x_rows: torch.Tensor) -> None:
            """Record step i's data prediction of the rows ``sub`` of the micro-batch ``x_rows`` (``v``: theirs)
            where a later multistep step reads it."""
            if self.multistep and i >= self.steps.tail - 1:
                if i not in self.x0:
                    self.x0[i] = torch.empty_like(x_rows)  # the whole micro-batch: a step may run it in parts
                self.x0[i][sub] = predicted_x0(v, x_rows[sub], self.steps.grid, i)
                self.x0.pop(i - 2, None)

        def step(self, i: int, sub, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            g = self.steps.grid
            if not self.multistep or i < self.steps.tail:
                return ode_step(v, x, g, i)
            prev = self.x0[i - 1][sub] if i - 1 in self.x0 else None
            return dpm_solver_pp_step(x, self.x0[i][sub], prev, g[i - 1], g[i], g[i + 1])


def forward_rows(
    size: int, tracked: bool, grad_micro_batch: int | None, track_rows: torch.Tensor | None
) -> list[tuple[slice | torch.Tensor, bool]]:
    """The forwards of one step of a micro-batch of ``size`` rows: (its rows, autograd on), the rows a slice or host
    ids. Untracked: one forward. Tracked: ``grad_micro_batch`` rows at a time; with ``track_rows`` [size] only those
    rows tracked, the others in one forward without autograd (a micro-batch all tracked or all not: as without)."""
    if not tracked or (track_rows is not None and not track_rows.any()):
        return [(slice(0, size), False)]
    if track_rows is None or track_rows.all():
        step = grad_micro_batch or size
        return [(slice(start, min(start + step, size)), True) for start in range(0, size, step)]
    ids = torch.arange(size)
    tracked_ids, others = ids[track_rows], ids[~track_rows]
    forwards = [(others, False)] if len(others) else []
    if len(tracked_ids):
        forwards += [(rows, True) for rows in tracked_ids.split(grad_micro_batch or len(tracked_ids))]
    return forwards


def row_ids(rows: slice | torch.Tensor) -> torch.Tensor:
    """A step's rows (``Transition.rows``: a contiguous slice, or host ids) as host ids [b]."""
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows


def local_rows(start: int, sub: slice | torch.Tensor) -> slice | torch.Tensor:
    """Rows ``sub`` of the micro-batch that starts at local row ``start``, as rows of the local batch."""
    return slice(start + sub.start, start + sub.stop) if isinstance(sub, slice) else sub + start


@dataclass
class RolloutPlan:
    """What one rollout of B trajectories samples, and in which batches."""

    sampler: Sampler
    emb: object  # the PromptEmbeds of the B trajectories
    generators: list[torch.Generator]  # every trajectory's own stream [B]: its initial noise, then its SDE draws
    steps: StepSelection  # which steps are SDE steps (a window among them) and which each trajectory trains
    init_generators: list[torch.Generator] | None = None  # the initial noise's streams (sample.init_same_noise)
    micro_batch: int | None = None  # trajectories rolled out together, through all their steps (None: all B)
    grad_micro_batch: int | None = None  # rows per tracked forward (None: the micro-batch's)
    decode: str = "sample"  # what the rollout returns: a name of DECODE_TARGETS
    # a tracked CFG step as one [uncond, cond] batch (v_u detached after it), as train.recompute_batching=rollout
    # recomputes it, instead of v_u in its own no-grad forward (Retain's train.retain.backward=step: the same graph)
    joint_cfg: bool = False


def _untracked(i: int) -> bool:
    return False


def _every_row(i: int) -> torch.Tensor | None:
    return None


@dataclass(frozen=True)
class RolloutHooks:
    """What a rollout's caller (the schedule, through ``lean.run.iteration``) decides and sees, step by step."""

    track_grad: Callable[[int], bool] = _untracked  # whether step i runs with autograd on
    rows_tracked: Callable[[int], torch.Tensor | None] = _every_row  # host bool [B]: the rows step i tracks (None: all)
    on_step: Callable[[Transition], None] | None = None  # every SDE step of every micro-batch
    on_finished: Callable[[slice, torch.Tensor], None] | None = None  # (rows, decode target) per finished micro-batch
    progress: Callable[[int], None] | None = None  # after step i of every micro-batch


def rollout(policy, plan: RolloutPlan, hooks: RolloutHooks | None = None) -> torch.Tensor:
    """Roll out ``len(plan.generators)`` trajectories; return what is decoded (``plan.decode``, a name of
    ``DECODE_TARGETS``): the final latents x_N, or the last step's x̂_0.

    The trajectories run in contiguous micro-batches of ``plan.micro_batch`` (all at once when None), each through
    all its steps before the next starts, so that ``hooks.on_finished(rows, target)`` can hand a finished micro-batch
    to the decoder and the rewards while the next one rolls out (``lean.run.async_scoring``). ``hooks.track_grad(i)``
    says whether step i runs with autograd on; tracked steps split the micro-batch further into
    ``plan.grad_micro_batch`` rows when given, and ``hooks.on_step`` may backpropagate or keep the graph.
    ``hooks.rows_tracked(i)`` (host bool [B] or None: all; the rows that train step i, among a hybrid schedule's
    first-update samples) limits the tracking of step i to those rows: the step runs the micro-batch's other rows in one
    forward without autograd, and hands both to ``on_step`` with ``rows`` as host ids. The next step always starts from
    a detached x_{i+1}: as in the recomputed loss, every step's input is a constant. Nothing in the loop reads a value
    back from the device: the schedule's decisions come from the host-side step selection, and the noise is drawn ahead
    (:class:`StepNoise`). ``plan.init_generators`` draw the initial noise instead of the samples' own streams
    (``sample.init_same_noise``). ``hooks.progress(i)`` is called after step i of every micro-batch (``num_steps`` calls
    per micro-batch). Without ``hooks`` nothing is tracked and nothing seen.
    """
    if plan.decode not in DECODE_TARGETS:
        raise ValueError(f"decode={plan.decode!r}: must be one of {', '.join(DECODE_TARGETS)}")
    hooks = hooks or RolloutHooks()
    # every sample's first draw, before any step's; kept at the sampler's precision (sample.latent_dtype)
    x = policy.init_latents(
        plan.init_generators or plan.generators, storage_dtype(plan.sampler.cfg.latent_dtype, policy.dtype)
    )
    loop = RolloutLoop(policy, plan, hooks)
    batch = x.shape[0]
    target = torch.empty_like(x)
    for start in range(0, batch, plan.micro_batch or batch):
        rows = slice(start, min(start + (plan.micro_batch or batch), batch))
        target[rows] = loop.roll_out_rows(x, rows)
        if hooks.on_finished is not None:
            hooks.on_finished(rows, target[rows])
    return target


class RolloutLoop:
    """The steps of one :func:`rollout`, micro-batch by micro-batch, and the host-side facts they read: the grid it
    walks (the run's sigmas, or a compressed tail after the SDE window), which steps draw noise, where the next
    stochastic step is."""

    def __init__(self, policy, plan: RolloutPlan, hooks: RolloutHooks):
        self.policy, self.plan, self.hooks = policy, plan, hooks
        cfg = plan.sampler.cfg
        self.grid = rollout_sigmas(plan.sampler.sigmas, plan.steps.stochastic.tolist(), cfg)
        n = self.num_steps = len(self.grid) - 1
        self.stochastic = plan.steps.stochastic.tolist() + [False] * (n - cfg.num_steps)  # host-side: which draw noise
        self.upcoming = [next((j for j in range(i + 1, n) if self.stochastic[j]), None) for i in range(n)]
        self.first_stochastic = next((j for j in range(n) if self.stochastic[j]), None)
        tail = max((i + 1 for i in range(n) if self.stochastic[i]), default=0)  # first step after the SDE
        self.ode_steps = OdeSteps(self.grid, cfg.tail_solver, tail)

    def roll_out_rows(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """All steps of the trajectories ``rows`` from x_0 = ``x[rows]``; returns their decode target."""
        x_rows = x[rows]
        noise = StepNoise(self.plan.generators[rows], tuple(x.shape[1:]), compute_dtype(x), x.device)
        noise.prefetch(self.first_stochastic)
        x0 = torch.empty_like(x_rows) if self.plan.decode == "x0_prediction" else None
        ode = self.ode_steps.start()
        for i in range(self.num_steps):
            eps = noise.take(i) if self.stochastic[i] else None
            x_rows = self.step(i, rows, x_rows, eps, ode, x0)
            noise.prefetch(self.upcoming[i])  # host draws step i+1's noise while the device works on step i
            if self.hooks.progress is not None:
                self.hooks.progress(i)
        return x_rows if x0 is None else x0

    def step(self, i: int, rows: slice, x_rows, eps, ode: OdeSteps.Trajectories, x0) -> torch.Tensor:
        """Step i of the micro-batch ``rows`` at x_i = ``x_rows`` (SDE noise ``eps``, or None: an ODE step), in the
        forwards :func:`forward_rows` splits it into; the last step writes its x̂_0 into ``x0`` when given. Returns
        x_{i+1}, detached."""
        plan, hooks, stochastic = self.plan, self.hooks, self.stochastic[i]
        tracked = stochastic and hooks.track_grad(i)
        x_next = torch.empty_like(x_rows)
        mine = hooks.rows_tracked(i) if tracked else None
        mine = None if mine is None else mine[rows]
        for sub, grad in forward_rows(x_rows.shape[0], tracked, plan.grad_micro_batch, mine):
            at = local_rows(rows.start, sub)  # the same rows of the local batch
            with torch.set_grad_enabled(grad):
                v = velocity(
                    self.policy, x_rows[sub], self.grid[i], plan.emb.index(at), plan.sampler.cfg, plan.joint_cfg
                )
            if i == self.num_steps - 1 and x0 is not None:
                x0[sub] = predicted_x0(v.detach(), x_rows[sub], self.grid, i)
            ode.observe(i, sub, v.detach(), x_rows)
            if not stochastic:
                x_next[sub] = ode.step(i, sub, v, x_rows[sub])
                continue
            with torch.set_grad_enabled(grad):
                nxt, log_prob, mean, std = sde_step_with_logprob(plan.sampler.sde, v, x_rows[sub], i, noise=eps[sub])
            x_next[sub] = nxt.detach()
            if hooks.on_step is not None:
                step = Transition(index=i, rows=at, sample=x_rows[sub], next_sample=nxt.detach(), log_prob=log_prob)
                hooks.on_step(dataclasses.replace(step, mean=mean, std=std, sigmas=plan.sampler.sigmas).on_policy())
        return x_next
