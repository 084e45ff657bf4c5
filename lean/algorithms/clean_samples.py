"""What DiffusionNFT and Diffusion-DPO share: an update on the rollout's clean samples, re-noised afresh.

The rollout (ODE steps only for NFT; any sampler for DPO) hands every sample's clean latent x_0 (its decode target)
to the update. The update splits the samples into *units* (a sample for NFT, a chosen/rejected pair for DPO), draws
K noise levels and noises per unit (from the unit's own stream, ``lean.sampling.rollout.renoise_generator``), and at
each draw j re-noises

    x_t = (1 - t) x_0 + t eps                                  (the flow-matching forward process)

and asks the algorithm for the unit's loss from the velocities that up to three weights predict at x_t: the trained
policy (with gradients), the snapshot (NFT's old policy, online DPO's reference: ``lean.models.snapshot.Snapshot``) and
the reference (the adapter off). The objective of one update over U units is

    L = 1/(U K) sum_u sum_j loss_uj

No term of it is a rollout step: Retain and Reweight, whose whole saving is reusing the rollout's forward of a
trained step, have nothing to reuse, and ``train.schedule`` must be recompute, the update that computes its own
forwards after the rewards (``lean.schedules.renoised``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import Tensor

from lean.algorithms.base import CLEAN_SAMPLES, Algorithm, StepLoss
from lean.sampling.sde import StepSelection, num_trained_steps

if TYPE_CHECKING:
    from lean.config import RunConfig


class Velocities(Protocol):
    """The velocities of the weights a loss compares, at x_t [b, ...] and noise levels t [b], for the rows ``rows``
    (local ids, host) of the iteration's prompts."""

    def policy(self, x: Tensor, t: Tensor, rows: Tensor) -> Tensor: ...  # the trained weights, with gradients

    # no gradients; called before ``policy`` (its weights are swapped in place, which a saved graph would not allow)
    def snapshot(self, x: Tensor, t: Tensor, rows: Tensor) -> Tensor: ...

    def reference(self, x: Tensor, t: Tensor, rows: Tensor) -> Tensor: ...  # the adapter off, no gradients


def renoise(x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """x_t = (1 - t) x_0 + t eps, with t [b] broadcast over the latent's dimensions, in x_0's dtype."""
    t = t.to(x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise.to(x0.dtype)


def per_sample_mean(x: Tensor) -> Tensor:
    """mean over every non-batch dimension [b]."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def logit_normal_sigmas(z: Tensor, shift: float, grid: int = 1000) -> Tensor:
    """sigma of the training grid of diffusers' FlowMatchEulerDiscreteScheduler(shift) at the index floor(u x grid),
    u = sigmoid(z) (``compute_density_for_timestep_sampling("logit_normal")``): s = 1 - index / grid, sigma =
    shift s / (1 + (shift - 1) s). float64 [K]."""
    index = torch.floor(torch.sigmoid(z.double()) * grid)
    s = 1 - index / grid
    return shift * s / (1 + (shift - 1) * s)


class CleanSampleAlgorithm(Algorithm):
    """Base class of the algorithms that train on re-noised clean samples (module docstring)."""

    trains_on = CLEAN_SAMPLES
    facts = frozenset()  # no trained step is a rollout step: nothing a Lean schedule needs
    unit_size: ClassVar[int] = 1  # samples per unit

    @classmethod
    def steps(cls, cfg: RunConfig, iteration: int, batch_size: int) -> StepSelection | None:
        """No rollout step is trained (and, for an ODE rollout, none is stochastic)."""
        n = cfg.sample.num_steps
        stochastic = torch.full((n,), cls.rollout == "sde", dtype=torch.bool)
        return StepSelection(stochastic=stochastic, trained=torch.zeros(batch_size, n, dtype=torch.bool))

    @property
    def draws_per_unit(self) -> int:
        """K: int(N x sample.timestep_fraction) draws per unit (NFT: 9 of 10 grid points, DPO: 39 for 40 steps)."""
        return num_trained_steps(self.sample.num_steps, self.sample.timestep_fraction)

    @property
    def terms_per_sample(self) -> int:
        return self.draws_per_unit

    def units(self, targets: Tensor, group_ids: Tensor) -> Tensor:
        """The local rows of every unit, [U, unit_size] (host), from the local targets [B] and groups [B]."""
        return torch.arange(targets.shape[0]).view(-1, 1)

    def noise_levels(self, generator: torch.Generator) -> Tensor:
        """A unit's K noise levels t [K] (float64, in (0, 1]), the first draws of its stream; the K noises come
        after them, one latent at a time (``lean.schedules.renoised``)."""
        raise NotImplementedError

    def unit_loss(
        self, velocities: Velocities, x0: Tensor, rows: Tensor, targets: Tensor, draw_t: Tensor, noise: Tensor
    ) -> StepLoss:
        """The loss terms [U] of the units whose samples are ``x0`` [U x unit_size, ...] (rows ``rows`` [U x
        unit_size], unit-major), their targets, at one draw each: noise levels ``draw_t`` [U], noises [U, ...]."""
        raise NotImplementedError

    def reference_unit_loss(
        self, velocities: Velocities, x0: Tensor, rows: Tensor, targets: Tensor, draw_t: Tensor, noise: Tensor
    ) -> Tensor:
        """The float64 anchor of the certificate: the total loss [U] written straight from the published formula, in
        another arrangement than :meth:`unit_loss`."""
        raise NotImplementedError
