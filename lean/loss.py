"""The GRPO loss of one trained step, shared by every schedule.

For sample b at trained step j, with r = exp(log p_theta(x_{j+1} | x_j) - log p_old), advantage A and clip range c:

    policy_loss = max(-A r, -A clip(r, 1 - c, 1 + c))                       (PPO clipped surrogate)
    kl          = w_j mean_over_dims(||mu_theta - mu_ref||^2) / (2 std_j^2)
    loss_bj     = policy_loss + beta * kl

std_j is the std of step j's Gaussian transition, so with w_j = 1 (``train.kl_form: exact``) the KL term is the KL
divergence between the policy's and the reference's transitions (FlowGRPO's Wan2.1 script). FlowGRPO's SD3 and FLUX
scripts divide by the SDE's noise *scale* s_j^2 instead, before its sqrt(-dt) factor (``kl_form: flow_grpo``): for the
flow_grpo SDE kinds std_j = s_j sqrt(|dt_j|), so their KL is the exact one times w_j = |dt_j| = sigma_j - sigma_{j+1};
for the other kinds the returned std is the transition's own and w_j = 1 (:func:`kl_step_weights`).

The objective of one optimizer step over N samples (across all processes) and K trained steps per sample is
L = 1/(N K) sum_b sum_{j in T_b} loss_bj. On-policy, r = 1 and its gradient is A * grad log p: that is what lets
Retain and Reweight skip the recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lean.registry import Registry
from lean.sde import SQRT_DT_KINDS

KL_FORMS: Registry[str] = Registry(
    "KL form",
    [
        ("exact", "the KL divergence of the two Gaussian steps (FlowGRPO's Wan2.1 script)"),
        ("flow_grpo", "FlowGRPO's SD3/FLUX scripts: divided by the noise scale before its sqrt(-dt) factor"),
    ],
)


def kl_step_weights(sigmas: torch.Tensor, sde_kind: str, form: str) -> torch.Tensor:
    """w_j of every step [num_steps] (same dtype and device as ``sigmas``): the factor from the exact KL of step j
    to the KL of ``form`` (module docstring)."""
    if form not in KL_FORMS:
        raise ValueError(f"form={form!r}: must be one of {', '.join(KL_FORMS)}")
    if form == "flow_grpo" and sde_kind in SQRT_DT_KINDS:
        return sigmas[:-1] - sigmas[1:]
    return torch.ones_like(sigmas[:-1])


def clipped_surrogate(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample PPO loss and ratio. All inputs [B]."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def kl_penalty(
    mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, weight: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Per-sample ``weight`` x KL between N(mean, std^2) and N(ref_mean, std^2), averaged over the non-batch
    dimensions. ``weight``: a number or [B] (:func:`kl_step_weights` at each sample's step)."""
    dims = tuple(range(1, mean.ndim))
    sq = ((mean - ref_mean) ** 2).mean(dim=dims)
    return weight * sq / (2 * std.reshape(std.shape[0], -1)[:, 0] ** 2)


@dataclass
class StepLoss:
    policy: torch.Tensor  # [B] clipped surrogate
    kl: torch.Tensor | None  # [B] or None when beta == 0
    ratio: torch.Tensor  # [B], detached

    def total(self, beta: float) -> torch.Tensor:
        return self.policy if self.kl is None else self.policy + beta * self.kl


def step_loss(
    log_prob, old_log_prob, advantages, clip_range: float, *, mean=None, ref_mean=None, std=None, kl_weight=1.0
) -> StepLoss:
    """The per-sample loss terms of one trained step; ``ref_mean=None`` means no KL term."""
    policy, ratio = clipped_surrogate(log_prob, old_log_prob, advantages.to(log_prob.dtype), clip_range)
    kl = kl_penalty(mean, ref_mean, std, kl_weight).to(policy.dtype) if ref_mean is not None else None
    return StepLoss(policy, kl, ratio.detach())


def loss_stats(losses: list[StepLoss], beta: float) -> dict[str, float]:
    """Means over all (sample, step) terms, for logging."""
    if not losses:
        return {}
    pol = torch.cat([loss.policy.detach() for loss in losses])
    ratio = torch.cat([loss.ratio for loss in losses])
    stats = {"policy_loss": pol.mean(), "ratio_mean": ratio.mean(), "ratio_max_dev": (ratio - 1).abs().max()}
    if losses[0].kl is not None:
        stats["kl"] = torch.cat([loss.kl.detach() for loss in losses]).mean()
    values = torch.stack([v.double() for v in stats.values()]).tolist()  # one read per update, for the logs
    return dict(zip(stats, values))
