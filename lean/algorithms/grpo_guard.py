"""GRPO-Guard: GRPO with a normalised importance ratio and a per-step gradient reweighting, as FlowGRPO ships it.

Source: github.com/yifan123/flow_grpo, commit 2e2f712 ("GRPO-Guard", merged upstream as 518e155; read in the
ltt0716/flow_grpo_official fork, since the yifan123 snapshot predates it): scripts/train_sd3_GRPO_Guard.py ("the
script") and config/grpo_guard.py. Its targets, KL term and sample filter are GRPO's (``lean.algorithms.grpo``); two
things change in the loss of sample b at trained step j.

RatioNorm (the script :915-919). With mu the transition mean at x_j under the current weights, mu_old the rollout's
(stored by the script at :707), delta = mu - mu_old, s_j the transition's std (a function of sigma alone: no
gradient):

    log r_bj = s_j [ log p_theta,b - log p_old,b + mean_{B,D}(delta^2) / (2 s_j^2) ]

where mean_{B,D} averages over the whole micro-batch and the latent's D elements: the script writes
``.mean(dim=tuple(range(1, log_prob.ndim)))`` with a one-dimensional log_prob, an empty tuple, which torch reads as
every dimension (a per-sample mean_D was perhaps meant; lean computes what runs). log p is the Gaussian log-density
averaged over D, so with a = x_{j+1} - mu_old = s_j eps (the rollout's noise) log p_theta - log p_old =
<a, delta> / (D s_j^2) - |delta|^2 / (2 D s_j^2). The added term cancels the second part on average over the
micro-batch (exactly, per sample, were it per sample): the negative drift that makes FlowGRPO's ratio shrink below 1
at low-noise steps. The factor s_j removes the 1/s_j spread:

    log r_bj = <eps_b, delta_b> / D + (mean_B |delta|^2 - |delta_b|^2) / (2 s_j D)

Gradient reweighting (the script :931-932): the step's clipped surrogate is divided by the step size
Delta_j = sigma_j - sigma_{j+1} (the script's sqrt_dt.mean()**2), so that since d mu / d theta carries a factor
Delta_j, every step's gradient has the same scale; the KL term (off in every GRPO-Guard recipe: beta 0) is added
after it, unweighted:

    loss_bj = max(-A_b r_bj, -A_b clip(r_bj, 1 - c, 1 + c)) / Delta_j + beta kl_bj

with a symmetric clip c = ``algorithm.clip_range`` (the config's highclip_range is never read by the script).

Why Retain and Reweight stay exact: on-policy mu_old = stopgrad(mu) and log p_old = stopgrad(log p), so delta = 0
and log r = 0 to the bit: r = 1 identically, inside the clip. Its gradient is s_j grad log p (the added term's is
a mean of delta grad delta / s_j^2 = 0), so

    grad L = 1/(N K) sum_b sum_j [ -A_b (s_j / Delta_j) grad log p_bj + beta grad kl_bj ]

The rollout's own graph gives it, and it is linear in A_b (the A / Â fold). Recompute's later updates recompute mu and
read mu_old from the rollout (``reads`` names ``old_mean``: Recompute stores it).

Needs a Gaussian transition (``sample.sde_kind`` other than cps, whose log p drops the Gaussian's scale).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from lean.algorithms.grpo import GRPO, kl_penalty, transition_std
from lean.sampling.rollout import policy_step, reference_mean
from lean.sampling.transition import OLD_MEAN, Transition

NON_GAUSSIAN_KINDS = ("cps",)  # log p is -(x' - mean)^2 without the Gaussian's 1 / (2 std^2): no RatioNorm


def sample_means(x: Tensor) -> Tensor:
    """mean_D of every sample [B]: the average over all non-batch dimensions."""
    return x.mean(dim=tuple(range(1, x.ndim)))


class GRPOGuard(GRPO):
    """GRPO with RatioNorm and the 1 / Delta_j reweighting of the module docstring."""

    reads = GRPO.reads | {OLD_MEAN}

    @classmethod
    def problem(cls, cfg, world_size: int | None = None) -> tuple[str, object, str] | None:
        if cfg.sample.sde_kind in NON_GAUSSIAN_KINDS:
            return "sample.sde_kind", cfg.sample.sde_kind, "grpo_guard's RatioNorm needs a Gaussian transition"
        return None

    @functools.cached_property
    def step_sizes(self) -> Tensor:
        """Delta_j = sigma_j - sigma_{j+1} of every step [num_steps]."""
        return self.sigmas[:-1] - self.sigmas[1:]

    def log_ratio(self, step: Transition) -> Tensor:
        """RatioNorm's log r [B], as the script computes it (its shift a mean over the micro-batch and the latent)."""
        s = transition_std(step.std)
        shift = ((step.mean - step.old_mean) ** 2).mean() / (2 * s**2)
        return s * (step.log_prob - step.old_log_prob + shift)

    def step_policy_term(self, step: int | Tensor, ratio: Tensor, targets: Tensor) -> Tensor:
        """The clipped surrogate divided by the step size Delta_j (the KL term, added by ``step_loss``, is not)."""
        return self.policy_term(ratio, targets) / self.step_sizes[step].to(ratio.dtype)

    def reference_loss(self, policy, step: Transition, emb, targets: Tensor) -> Tensor:
        """The certificate's anchor: the loss [B] of one recorded trained step recomputed in float64 from the closed
        form of log r (module docstring), eps = (x_{j+1} - stopgrad(mu)) / s_j, delta = mu - stopgrad(mu)."""
        x = dataclasses.replace(step, sample=step.sample.double(), next_sample=step.next_sample.double())
        recomputed = policy_step(policy, self.sampler, x, emb)
        mean, std = recomputed.mean, recomputed.std
        eps, delta, s = (x.next_sample - mean.detach()) / std, mean - mean.detach(), transition_std(std)
        squares = sample_means(delta**2)
        ratio = torch.exp(sample_means(eps * delta) + (squares.mean() - squares) / (2 * s))
        loss = self.step_policy_term(step.index, ratio, targets.double())
        if self.kl_weight:
            ref = reference_mean(policy, self.sampler, recomputed, emb)
            loss = loss + self.kl_weight * kl_penalty(mean, ref, std, self.kl_weights[step.index])
        return loss
