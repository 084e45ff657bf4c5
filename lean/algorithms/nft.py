"""DiffusionNFT: negative-aware fine-tuning on the rollout's clean samples, no likelihoods, no CFG.

Source: github.com/NVlabs/DiffusionNFT, commit 24af555: scripts/train_nft_sd3.py ("the script") and config/nft.py.
Zheng et al. 2025, arXiv:2509.16117.

Rollout: deterministic, any solver (the source: DPM-Solver++(2M) on the data prediction, 10 steps, guidance 1, by the
*old* policy, the script :640-659; lean: ``sample.tail_solver: dpmsolver++`` with no SDE step). Each sample's clean
latent x_0 is kept (:674).

Targets: GRPO's group advantages (``lean.algorithms.groups``; the source: the group's mean over the std of all
rewards plus 1e-4, ``global_std``, flow_grpo/stat_tracking.py:17-31), clipped to C = ``algorithm.adv_clip_max`` (5),
then an optimality probability (:910-929)

    r_b = clip(1/2 + A_b / (2 C), 0, 1)

Loss of sample b at draw j (:862-970): t from the rollout's own grid (a per-sample permutation of its N points, the
first K = int(0.99 N) kept, :810-816, :854-866), eps fresh, x_t = (1 - t) x_0 + t eps; v = v_theta(x_t), v_old the
old policy's (no gradient), v_ref the reference's (adapter off). The implicit positive and negative policies mix by
beta (``algorithm.nft.beta``, :934-937):

    v+ = beta v + (1 - beta) v_old        v- = (1 + beta) v_old - beta v

and each regresses x_0 through its x_0-prediction x0± = x_t - t v±, under a detached self-normalising weight
(:939-957; means over the latent's D elements):

    L± = mean_D (x0± - x_0)^2 / max(mean_D |x0± - x_0|, 1e-5)
    loss_bj = (C / beta) [r_b L+ + (1 - r_b) L-] + lambda mean_D (v - v_ref)^2               (:959-970)

with lambda = ``algorithm.nft.kl_weight`` (the config's train.beta, 1e-4). L = 1/(N K) sum_b sum_j loss_bj per
optimizer step (each (micro-batch, draw) backward divided by the accumulation count, :983-987).

The old policy is a second copy of the trainable weights (``lean.models.snapshot.Snapshot``): a copy at the start, then,
after each rollout's updates, old <- eta old + (1 - eta) theta with eta from the optimizer step count
(``algorithm.nft.old_decay``, :169-189, :1034-1039). It rolls out and gives v_old.

Why no Lean schedule: every trained forward is at a freshly re-noised x_t, never a rollout step; there is no forward
to keep or reweight (``lean.algorithms.clean_samples``).

What differs from the source:
  * the draws' random streams (lean's are keyed per sample, the source's the global RNG);
  * its epoch draws its prompts in 16 batches of 3, independently, and merges the samples of a prompt drawn twice
    into one group (stat_tracking.py:17-25, grouped by the prompt's text); lean draws an iteration's prompts without
    replacement, a group per draw;
  * at ``sample.timestep_fraction`` 1 the source trains all N grid points, lean N - 1 (the published 0.99 gives 9 of
    10 in both).
Its rollout feeds the network int(1000 sigma) (``sample.truncate_timestep``), its training the float value, as lean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.algorithms.base import StepLoss
from lean.algorithms.clean_samples import CleanSampleAlgorithm, Velocities, per_sample_mean, renoise
from lean.algorithms.reward_combination import combined_advantages
from lean.config.checks import check_positive, choice, choices
from lean.config.registry import Registry
from lean.config.sections import register_options

if TYPE_CHECKING:
    from lean.config import RunConfig

OLD_POLICY_DECAYS: Registry[str] = Registry(
    "old-policy decay",
    [
        ("linear_capped", "eta = min(0.001 s, 0.5) at optimizer step s (the script's decay_type 1, config/nft.py)"),
        ("delayed", "eta = 0 for s < 75, then min(0.0075 (s - 75), 0.999) (decay_type 2, its OCR recipe)"),
        ("copy", "eta = 0: the old policy is the trained one at every rollout (decay_type 0)"),
    ],
)
WEIGHT_FLOOR = 1e-5  # the adaptive weight's floor (the script :945, :953)


def old_policy_decay(kind: str, step: int) -> float:
    """eta after ``step`` optimizer steps (:169-189)."""
    if kind == "linear_capped":
        return min(0.001 * step, 0.5)
    if kind == "delayed":
        return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)
    return 0.0


class NFT(CleanSampleAlgorithm):
    """DiffusionNFT's objective (module docstring; ``algorithm.nft``)."""

    rollout = "ode"
    uses_snapshot = True

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        if cfg.sample.sde_window:
            return "sample.sde_window", cfg.sample.sde_window, "nft rolls out ODE steps only: set 0"
        return None

    def snapshot_decay(self, optimizer_steps: int) -> float:
        return old_policy_decay(self.cfg.nft.old_decay, optimizer_steps)

    @property
    def rolls_out_snapshot(self) -> bool:
        return True  # the old policy samples (the script :640-659)

    @property
    def kl_weight(self) -> float:
        return self.cfg.nft.kl_weight

    @property
    def untracked_forwards_per_term(self) -> int:
        return 1 + (1 if self.kl_weight else 0)  # the old policy's, and the KL's reference

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        return combined_advantages(self.cfg, rewards, group_ids, components, self.reward_weights)

    def optimality(self, targets: Tensor) -> Tensor:
        """r = clip(1/2 + clip(A, -C, C) / (2 C), 0, 1) [B]."""
        c = self.cfg.adv_clip_max
        return (targets.clamp(-c, c) / c / 2 + 0.5).clamp(0, 1)

    def noise_levels(self, generator: torch.Generator) -> Tensor:
        """K of the rollout grid's N noise levels sigma_0 .. sigma_{N-1}: a random permutation's first K."""
        steps = torch.randperm(self.sample.num_steps, generator=generator)[: self.draws_per_unit]
        return self.sigmas[:-1].cpu().double()[steps]

    def unit_loss(self, velocities: Velocities, x0, rows, targets, draw_t, noise) -> StepLoss:
        x_t = renoise(x0, draw_t, noise)
        v_old = velocities.snapshot(x_t, draw_t, rows)  # first: the snapshot's weights are swapped in place
        v = velocities.policy(x_t, draw_t, rows)
        dtype = torch.float64 if x0.dtype == torch.float64 else torch.float32
        x0, x_t, v, v_old = x0.to(dtype), x_t.to(dtype), v.to(dtype), v_old.to(dtype)
        t = draw_t.to(device=x0.device, dtype=dtype).view(-1, *([1] * (x0.ndim - 1)))
        beta = self.cfg.nft.beta
        positive = self.weighted_error(x_t - t * (beta * v + (1 - beta) * v_old), x0)
        negative = self.weighted_error(x_t - t * ((1 + beta) * v_old - beta * v), x0)
        r = self.optimality(targets).to(device=x0.device, dtype=dtype)
        policy = (r * positive + (1 - r) * negative) / beta * self.cfg.adv_clip_max
        kl = None
        if self.kl_weight:
            kl = per_sample_mean((v - velocities.reference(x_t, draw_t, rows).to(dtype)) ** 2)
        return StepLoss(policy, kl, torch.ones_like(policy).detach())

    @staticmethod
    def weighted_error(prediction: Tensor, x0: Tensor) -> Tensor:
        """mean_D (x0_hat - x_0)^2 / max(mean_D |x0_hat - x_0|, 1e-5), the weight detached and in float64 [b]."""
        error = prediction - x0
        with torch.no_grad():
            weight = per_sample_mean(error.double().abs()).clamp_min(WEIGHT_FLOOR).to(error.dtype)
        return per_sample_mean(error**2) / weight

    def reference_unit_loss(self, velocities: Velocities, x0, rows, targets, draw_t, noise) -> Tensor:
        """In velocity form: with v* = eps - x_0 the flow's own velocity, x0± - x_0 = -t (v± - v*), so
        L± = t^2 mean_D (v± - v*)^2 / max(t mean_D |v± - v*|, 1e-5) (float64 throughout)."""
        x0, noise = x0.double(), noise.double()
        t = draw_t.double().to(x0.device).view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - t) * x0 + t * noise
        v_old = velocities.snapshot(x_t, draw_t, rows).double()
        v = velocities.policy(x_t, draw_t, rows).double()
        target, beta, c = noise - x0, self.cfg.nft.beta, self.cfg.adv_clip_max
        loss = 0.0
        for share, v_mix in (
            (torch.clamp(0.5 + targets.double().clamp(-c, c) / (2 * c), 0, 1), beta * v + (1 - beta) * v_old),
            (torch.clamp(0.5 - targets.double().clamp(-c, c) / (2 * c), 0, 1), (1 + beta) * v_old - beta * v),
        ):
            gap = v_mix - target
            scale = (t.flatten() * gap.detach().abs().flatten(1).mean(1)).clamp_min(WEIGHT_FLOOR)
            loss = loss + share.to(x0.device) * t.flatten() ** 2 * (gap**2).flatten(1).mean(1) / scale
        loss = loss * c / beta
        if self.kl_weight:
            ref = velocities.reference(x_t, draw_t, rows).double()
            loss = loss + self.kl_weight * ((v - ref) ** 2).flatten(1).mean(1)
        return loss


@register_options("algorithm.nft")
@dataclass
class NFTConfig:
    """DiffusionNFT's keys (``lean/algorithms/nft.py``)."""

    beta: float = 1.0
    """beta: the implicit positive policy is beta v_theta + (1 - beta) v_old, the negative (1 + beta) v_old -
    beta v_theta (config/nft.py: 1.0; its multi-reward and OCR recipes 0.1)."""
    kl_weight: float = 1e-4
    """Weight of mean (v_theta - v_ref)^2 against the reference (adapter off) (config/nft.py: train.beta 1e-4)."""
    old_decay: str = choice("old-policy decay")
    """How the old (sampling) policy follows the trained one after each rollout's updates: a name of
    ``lean.algorithms.nft.OLD_POLICY_DECAYS``."""

    def validate(self, prefix: str) -> None:
        choices(self, prefix)
        check_positive(f"{prefix}.beta", self.beta)
        check_positive(f"{prefix}.kl_weight", self.kl_weight, strict=False)
