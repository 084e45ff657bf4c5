"""Flow-DPPO: GRPO's rollout and group advantages with a Gaussian-KL trust-region mask in place of PPO's ratio clip,
as UniRL ships it.

Source: github.com/Tencent-Hunyuan/UniRL at 1a7b501: unirl/algorithms/flowdppo.py ("flowdppo.py"), its recipe
examples/diffusion/sd3_flowdppo.yaml (the preset ``unirl-flow-dppo-sd3``) and FlowDPPO/README.md; the paper is
"FlowDPPO: Divergence Proximal Policy Optimization for Flow Matching Models" (arXiv 2606.11025). Its targets, sample
filter and KL term are GRPO's (``lean.algorithms.grpo``); the policy term of sample b at trained step j changes.

With mu and mu_old the transition means at x_j under the current and the rollout's weights, s_j the transition's std
(a function of sigma alone), r = exp(log p_theta - log p_old) GRPO's ratio (log p averaged over the latent's D
elements), A_b the advantage and tau = ``algorithm.flow_dppo.kl_threshold``:

    kl_bj     = mean_D (mu - mu_old)^2 / (2 s_j^2)          the KL of the two Gaussian steps (flowdppo.py:43-51, :92-93)
    out_bj    = not (kl_bj < tau)                            left the trust region (flowdppo.py:96)
    drop_bj   = out_bj and ((r > 1 and A_b > 0) or (r < 1 and A_b < 0))       moves the way A pushes (:104-107)
    policy_bj = 0 if drop_bj else -A_b r                     the unclipped surrogate, masked (:89, :109-111)
    loss_bj   = policy_bj + beta kl_ref_bj                   (beta: GRPO's KL to the reference; none in the source)

averaged over the trained (sample, step) terms as GRPO's (flowdppo.py:319 ``loss_per_elem.mean()`` over [B, S']). The
mask is not differentiated (:107 ``.detach()``): kl_bj enters only through it. Unlike the clip, a term inside the
trust region keeps -A r however far r is from 1, and a term that left it keeps its gradient when r moves against its
advantage; only a term both far (in KL) and moving with its advantage is dropped.

The means' precision (``algorithm.flow_dppo.trust_region_means_dtype``): ``compute`` (the default) takes kl_bj from
the step's own means, float32 (float64 in a float64 run). UniRL's replay returns them cast to its
trajectory_precision (unirl/models/sd3/diffusion.py:496, bf16 in the recipe, sd3.yaml:36), and flowdppo.py:51 takes
mu - mu_old and its square in that dtype before dividing by the float32 2 s_j^2; ``bfloat16`` does the same:

    kl_bj     = mean_D float32(bf16(bf16(bf16(mu) - bf16(mu_old))^2)) / (2 s_j^2)

Rounding both means to bf16 (8 significant bits) adds to a small difference: a term whose exact KL is tau = 1e-5
reads 1.3x (step 0) to 2.1x (step 4) of it on SD3's 10-step grid with unit-scale latents and velocities
(tests/test_flow_dppo.py), so more terms count as outside. On-policy mu_old = mu rounds alike: kl_bj = 0 either way.

Differences from the source:
* s_j is the rollout's transition std. flowdppo.py:366-367 recomputes it as eta sqrt(s / (1 - min(s, 0.99)))
  sqrt(-dt), the rollout's std (unirl/sde/kernels.py:223, :234) except at sigma = 1, where the rollout puts sigmas[1]
  in place of sigma (unirl/models/sd3/diffusion.py:457) and the mask 0.99: there the source's kl_bj is
  0.01 / (1 - sigmas[1]) times lean's (0.28 on SD3's 10-step grid). Only a term whose KL lies between the two
  against tau is masked differently.
* mu_old: flowdppo.py:254-266 replays the trained steps at the pre-update weights (no_grad) before the updates; lean
  keeps the rollout's means (``old_mean``), of the same weights: equal where the rollout's and the update's forwards
  agree, as for log p_old (the source's default ``old_logp_source: rollout``, :34).
* ``add_kl_coefficient: false`` (kl_bj unnormalised, :353-354) is not offered: the recipe sets true.

Why Retain and Reweight are exact: on-policy mu_old = stopgrad(mu) and log p_old = stopgrad(log p), so kl = 0 and
r = 1 to the bit: r is neither above nor below 1, so no term is dropped, whatever tau. The policy term is -A r with the
gradient -A grad log p, GRPO's inside its clip: the rollout's own graph gives it (Retain) and it is linear in A (the
A / Â fold of Reweight). Later updates (Recompute's, a hybrid's after its first) read mu_old from the rollout
(``reads`` names ``old_mean``: Recompute stores it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from lean.algorithms.base import StepLoss
from lean.algorithms.grpo import GRPO, kl_penalty, transition_std
from lean.config.checks import check_positive, choice, choices
from lean.config.dtypes import DTYPES
from lean.config.sections import register_options
from lean.sampling.transition import OLD_MEAN, Transition

COMPUTE_DTYPE = "compute"  # algorithm.flow_dppo.trust_region_means_dtype: the step's own means, unrounded


def trust_region_divergence(step: Transition, means_dtype: torch.dtype | None) -> Tensor:
    """kl_bj [B] of the module docstring: of the step's means as computed (``means_dtype`` None), or with the two means,
    their difference and its square rounded to ``means_dtype`` as UniRL's replay and flowdppo.py:51 do."""
    if means_dtype is None:
        return kl_penalty(step.mean, step.old_mean, step.std)
    mean, old_mean = step.mean.detach().to(means_dtype), step.old_mean.to(means_dtype)
    # the difference and its square stay in the narrow dtype, as the source's tensors are; the mean is float32's
    sq = ((mean - old_mean) ** 2).to(step.std.dtype)
    return sq.mean(dim=tuple(range(1, sq.ndim))) / (2 * transition_std(step.std) ** 2)


def trust_region_surrogate(ratio: Tensor, advantages: Tensor, divergence: Tensor, threshold: float) -> Tensor:
    """-A r where the term is kept, 0 where it left the trust region (``divergence`` [B] not under ``threshold``)
    moving the way its advantage pushes [B]. The mask carries no gradient."""
    outside = ~(divergence.detach() < threshold)
    with_advantage = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    unclipped = -advantages * ratio
    return torch.where((outside & with_advantage).detach(), torch.zeros_like(unclipped), unclipped)


class FlowDPPO(GRPO):
    """GRPO with the KL trust-region mask of the module docstring in place of the clipped surrogate."""

    reads = GRPO.reads | {OLD_MEAN}

    @property
    def kl_threshold(self) -> float:
        return self.cfg.flow_dppo.kl_threshold

    @property
    def trust_region_means_dtype(self) -> torch.dtype | None:
        """What the mask's KL rounds the means to; None: the step's compute dtype."""
        name = self.cfg.flow_dppo.trust_region_means_dtype
        return None if name == COMPUTE_DTYPE else DTYPES[name]

    def policy_term(self, ratio: Tensor, targets: Tensor) -> Tensor:
        """The masked surrogate at divergence 0, where it is read (the on-policy terms of a provisional backward)."""
        advantages = targets.to(ratio.dtype)
        return trust_region_surrogate(ratio, advantages, torch.zeros_like(ratio), self.kl_threshold)

    def step_loss(self, step: Transition, targets: Tensor) -> StepLoss:
        """GRPO's terms with the policy term masked by the KL of the current step to the rollout's."""
        loss = super().step_loss(step, targets)
        ratio = torch.exp(self.log_ratio(step))
        divergence = trust_region_divergence(step, self.trust_region_means_dtype)
        policy = trust_region_surrogate(ratio, targets.to(ratio.dtype), divergence, self.kl_threshold)
        return dataclasses.replace(loss, policy=policy)


@register_options("algorithm.flow_dppo")
@dataclass
class FlowDPPOConfig:
    """Flow-DPPO's keys (``lean/algorithms/flow_dppo.py``)."""

    kl_threshold: float = 1e-5
    """tau: a term whose KL to the rollout's step is not under it and that moves the way its advantage pushes is
    dropped (UniRL flowdppo.py:32 kl_mask_threshold = 1e-5, sd3_flowdppo.yaml:116)."""

    trust_region_means_dtype: str = choice("dtype", COMPUTE_DTYPE, also=(COMPUTE_DTYPE,))
    """The precision the two means are rounded to before the mask's KL, their difference and its square taken in it
    (a name of ``lean.config.dtypes.DTYPES``); ``compute``: the step's own means, float32 (float64 in a float64 run).
    UniRL's recipe: bfloat16, its trajectory_precision (diffusion.py:496, sd3.yaml:36; flowdppo.py:51)."""

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.kl_threshold", self.kl_threshold, strict=False)
        choices(self, prefix)
