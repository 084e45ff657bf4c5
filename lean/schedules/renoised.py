"""The update of the algorithms that train on re-noised clean samples (DiffusionNFT, DPO: ``lean.algorithms.
clean_samples``): what ``train.schedule: recompute`` runs for them, since no rollout forward is theirs to reuse.

Rollout (no gradients) keeps every sample's clean latent x_0 (:meth:`on_finished`). After the rewards:

    units = the algorithm's units of the local samples (NFT: each sample; DPO: each group's chosen/rejected pair)
    for epoch in 1..num_inner_epochs:
        shuffle the units; split them into S = optimizer_steps_per_iteration chunks
        for each chunk C, in micro-batches of train_batch_size samples:
            for j in 1..K:                                  # the unit's j-th noise level t and noise eps (its stream)
                x_t = (1 - t) x_0 + t eps
                loss = sum_u loss_uj(v_theta(x_t), v_snapshot(x_t), v_ref(x_t)) / (|C| K)
                loss.backward()
            optimizer_step()

Each unit's draws come from its first sample's re-noising stream (``lean.sampling.rollout.renoise_generator``): its K
levels first, then one noise per draw in order, so they never depend on the batching or the number of processes.

Cost (``predict``): the rollout's n forwards, then per epoch K tracked forwards and backwards over the local batch
plus the untracked ones of the snapshot and the reference (``IterationCosts.ref``: NFT's old policy and KL reference,
DPO's reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from lean.algorithms import CleanSampleAlgorithm, StepLoss, loss_stats
from lean.sampling.rollout import renoise_generator, velocity
from lean.sampling.transition import Transition
from lean.schedules.base import IterationContext, OptimizerStep, Schedule
from lean.schedules.recompute import LATER_UPDATE_FORWARD, RECOMPUTE_FORWARD, Recompute, _chunks, update_order

if TYPE_CHECKING:
    from torch import Tensor

    from lean.sampling.options import SampleConfig


class ConditionalVelocities:
    """The three weights' velocities of ``policy`` at re-noised samples (``lean.algorithms.clean_samples.
    Velocities``), conditional only (the clean-sample losses train no CFG), sigma in ``sigma_dtype``; each forward
    inside ``region(name)`` (timed and counted in the update; nothing for the certificate's float64 twin)."""

    def __init__(
        self,
        policy,
        emb,
        sample: SampleConfig,
        snapshot_swapped_in: Callable[[], AbstractContextManager],
        sigma_dtype: torch.dtype,
        region: Callable[[str], AbstractContextManager] = lambda name: contextlib.nullcontext(),
        policy_region: str = RECOMPUTE_FORWARD,
    ):
        self.model, self.emb, self.swapped_in, self.sigma_dtype = policy, emb, snapshot_swapped_in, sigma_dtype
        self.sample = dataclasses.replace(sample, cfg=False, truncate_timestep=False)
        self.region, self.policy_region = region, policy_region

    @classmethod
    def of(cls, ctx: IterationContext, region: str = RECOMPUTE_FORWARD) -> ConditionalVelocities:
        """The update's: the run's policy, prompts and snapshot, each forward a region of ``ctx``."""
        snapshot = ctx.snapshot.swapped_in if ctx.snapshot is not None else contextlib.nullcontext
        return cls(ctx.policy, ctx.emb, ctx.cfg.sample, snapshot, ctx.sigmas.dtype, ctx.region, region)

    def _velocity(self, x: Tensor, t: Tensor, rows: Tensor) -> Tensor:
        sigma = t.to(device=x.device, dtype=self.sigma_dtype)
        return velocity(self.model, x, sigma, self.emb.index(rows.to(x.device)), self.sample)

    def policy(self, x: Tensor, t: Tensor, rows: Tensor) -> Tensor:
        with self.region(self.policy_region):
            return self._velocity(x, t, rows)

    def snapshot(self, x: Tensor, t: Tensor, rows: Tensor) -> Tensor:
        with torch.no_grad(), self.region("snapshot_forward"), self.swapped_in():
            return self._velocity(x, t, rows)

    def reference(self, x: Tensor, t: Tensor, rows: Tensor) -> Tensor:
        with torch.no_grad(), self.region("reference_forward"), self.model.reference():
            return self._velocity(x, t, rows)


class UnitDraws:
    """Every unit's K noise levels [U, K] and its stream, which hands out its noises in order."""

    def __init__(self, ctx: IterationContext, units: Tensor):
        algorithm: CleanSampleAlgorithm = ctx.algorithm
        seed = ctx.cfg.train.seed
        self.generators = [renoise_generator(seed, ctx.iteration, *ctx.samples[int(u[0])]) for u in units]
        self.levels = torch.stack([algorithm.noise_levels(g) for g in self.generators]) if len(units) else None

    def noise(self, units: Tensor, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """The next noise of each of ``units`` [u] (host ids), [u, *shape], on ``device``."""
        return torch.stack([torch.randn(shape, generator=self.generators[int(u)]) for u in units]).to(device)


class Renoised(Schedule):
    """The clean-sample update of the module docstring."""

    tracks_rollout_graphs = False

    def __init__(self, ctx: IterationContext):
        super().__init__(ctx)
        self.clean: Tensor | None = None  # x_0 of every local sample [B, ...]

    def track_grad(self, i: int) -> bool:
        return False

    def on_step(self, step: Transition) -> None:
        return  # the rollout's steps train nothing here

    def on_finished(self, rows: slice, final: Tensor) -> None:
        if self.clean is None:
            self.clean = final.new_empty((self.ctx.batch, *final.shape[1:]))
        self.clean[rows] = final.detach()

    def finish(self, targets: Tensor, optimizer_step: OptimizerStep) -> dict:
        ctx, t = self.ctx, self.ctx.cfg.train
        algorithm: CleanSampleAlgorithm = ctx.algorithm
        groups = torch.tensor([g for g, _, _ in ctx.samples])
        units = algorithm.units(targets.cpu(), groups)  # [U, unit size], local rows
        draws = UnitDraws(ctx, units)
        k, shape = algorithm.draws_per_unit, tuple(self.clean.shape[1:])
        per_micro_batch = max(1, t.train_batch_size // algorithm.unit_size)
        losses: list[StepLoss] = []
        first, step_stats = None, {}
        for epoch in range(t.num_inner_epochs):
            order = update_order(t, ctx.iteration, torch.arange(len(units)), epoch)
            for c, chunk in enumerate(_chunks(order, t.optimizer_steps_per_iteration)):
                region = RECOMPUTE_FORWARD if epoch == 0 and c == 0 else LATER_UPDATE_FORWARD
                velocities = ConditionalVelocities.of(ctx, region)
                for batch in chunk.split(per_micro_batch) if len(chunk) else ():
                    rows = units[batch].flatten()
                    on_device = rows.to(ctx.sigmas.device)
                    x0 = self.clean[on_device]
                    for j in range(k):
                        noise = draws.noise(batch, shape, x0.device)
                        loss = algorithm.unit_loss(
                            velocities, x0, rows, targets[on_device], draws.levels[batch, j], noise
                        )
                        with ctx.region("backward"):
                            (loss.total(algorithm.kl_weight).sum() / (len(chunk) * k)).backward()
                        losses.append(loss)
                first = len(losses) if first is None else first
                step_stats = optimizer_step()
        return {**loss_stats(losses, first), **step_stats}

    predict = staticmethod(Recompute.predict)  # the same phases: n rollout forwards, then E K tracked ones and more
