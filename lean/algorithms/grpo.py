"""GRPO on flow-matching SDE rollouts, as FlowGRPO (github.com/yifan123/flow_grpo) and DanceGRPO
(github.com/XueZeyue/DanceGRPO) run it. This file is the objective; every schedule and the float64 reference of the
certificate compute their loss with :meth:`GRPO.step_loss`.

Targets: group-relative advantages (``lean.algorithms.groups``). Sample n of prompt group g,
with reward r_n:

    A_n = clamp((r_n - mean_g) / (std + eps), -adv_clip_max, adv_clip_max)

with the population std and eps = 1e-4 (FlowGRPO) or the unbiased one and eps = 1e-8 (DanceGRPO), of the group or,
with ``algorithm.global_std``, of the whole batch.

Loss of sample b at trained step j, with r = exp(log p_theta(x_{j+1} | x_j) - log p_old) and clip range c:

    policy_bj = max(-A_b r, -A_b clip(r, 1 - c, 1 + c))                     (PPO's clipped surrogate)
    kl_bj     = w_j mean_over_dims(||mu_theta - mu_ref||^2) / (2 std_j^2)
    loss_bj   = policy_bj + beta kl_bj

std_j is the std of step j's Gaussian transition and mu_ref the reference policy's mean (the adapter switched off),
so with w_j = 1 (``algorithm.kl_form: exact``) kl_bj is the KL divergence between the two transitions (FlowGRPO's
Wan2.1 script). FlowGRPO's SD3 and FLUX scripts divide by the SDE's noise *scale* s_j^2 instead, before its
sqrt(-dt) factor (``kl_form: flow_grpo``): for the flow_grpo SDE kinds std_j = s_j sqrt(|dt_j|), so theirs is the
exact KL times w_j = |dt_j| = sigma_j - sigma_{j+1}; for the other kinds the returned std is the transition's own
and w_j = 1 (:func:`kl_step_weights`).

The objective of one optimizer step over N samples (all processes) and K trained steps per sample is

    L = 1/(N K) sum_b sum_{j in T_b} loss_bj

where, with ``algorithm.skip_zero_advantage`` (FlowGRPO's SD3, Fast and Wan scripts), samples with A = 0 leave the
sum and N counts the others; as in FlowGRPO, each process averages over its own kept samples and the processes'
gradients are averaged (``algorithm.all_zero_advantage`` decides a process with none left).

Why the Lean schedules are exact for it: on-policy r = exp(log p - stopgrad(log p)) = 1 identically, where the clip
does not bind, so grad L = 1/(N K) sum [-A_b grad log p + beta grad kl]: the rollout's own graph gives it (Retain),
and the policy part is linear in A_b, so a step backpropagated with a provisional Â is corrected by A / Â (Reweight).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from lean.algorithms.base import LINEAR_IN_TARGET, RATIO_ONE_ON_POLICY, Algorithm, StepLoss
from lean.algorithms.reward_combination import combined_advantages
from lean.config.registry import Registry
from lean.sampling.rollout import Sampler, policy_step, reference_mean
from lean.sampling.sde import SQRT_DT_KINDS
from lean.sampling.transition import Transition

KL_FORMS: Registry[str] = Registry(
    "KL form",
    [
        ("exact", "the KL divergence of the two Gaussian steps (FlowGRPO's Wan2.1 script)"),
        ("flow_grpo", "FlowGRPO's SD3/FLUX scripts: divided by the noise scale before its sqrt(-dt) factor"),
    ],
)


ALL_ZERO_ADVANTAGES: Registry[str] = Registry(
    "all-zero advantage",
    [
        ("drop", "every sample leaves: the update's gradient is 0 (FlowGRPO's Fast script trains them at A = 0)"),
        ("keep", "every sample stays, so the KL term keeps acting (FlowGRPO's Wan script, at A = 1e-6)"),
    ],
)


def kl_step_weights(sigmas: Tensor, sde_kind: str, form: str) -> Tensor:
    """w_j of every step [num_steps] (same dtype and device as ``sigmas``): the factor from the exact KL of step j
    to the KL of ``form`` (module docstring)."""
    if form not in KL_FORMS:
        raise ValueError(f"form={form!r}: must be one of {', '.join(KL_FORMS)}")
    if form == "flow_grpo" and sde_kind in SQRT_DT_KINDS:
        return sigmas[:-1] - sigmas[1:]
    return torch.ones_like(sigmas[:-1])


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """PPO's per-sample loss max(-A r, -A clip(r, 1 - c, 1 + c)) [B]."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped)


def transition_std(std: Tensor) -> Tensor:
    """The std of each row's Gaussian transition [B] (or [1], broadcast), from the SDE step's [B, 1, ..., 1]."""
    return std.reshape(std.shape[0], -1)[:, 0]


def kl_penalty(mean: Tensor, ref_mean: Tensor, std: Tensor, weight: Tensor | float = 1.0) -> Tensor:
    """Per-sample ``weight`` x KL between N(mean, std^2) and N(ref_mean, std^2), averaged over the non-batch
    dimensions [B]. ``weight``: a number or [B] (:func:`kl_step_weights` at each sample's step)."""
    dims = tuple(range(1, mean.ndim))
    sq = ((mean - ref_mean) ** 2).mean(dim=dims)
    return weight * sq / (2 * transition_std(std) ** 2)


class GRPO(Algorithm):
    """Group advantages, the clipped surrogate and the KL of the module docstring (``algorithm.*`` keys)."""

    facts = frozenset({RATIO_ONE_ON_POLICY, LINEAR_IN_TARGET})

    @functools.cached_property
    def kl_weights(self) -> Tensor:
        """w_j of every step [num_steps], beside the sigmas (:func:`kl_step_weights`)."""
        return kl_step_weights(self.sigmas, self.sample.sde_kind, self.cfg.kl_form)

    @property
    def kl_weight(self) -> float:
        return self.cfg.beta

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        return combined_advantages(self.cfg, rewards, group_ids, components, self.reward_weights)

    @property
    def drops_samples(self) -> bool:
        return self.cfg.skip_zero_advantage

    def kept_samples(self, targets: Tensor) -> tuple[Tensor | None, int | Tensor]:
        """With ``skip_zero_advantage`` the samples whose advantage is 0 leave the update; when none of the
        process's samples is left, ``algorithm.all_zero_advantage`` drops them all (the batch counts 1 and weighs 0)
        or keeps them all. The count stays on the advantages' device (no host read)."""
        if not self.drops_samples:
            return None, targets.shape[0]
        kept = targets != 0
        if self.cfg.all_zero_advantage == "keep":
            kept = kept | ~kept.any()
        return kept, kept.sum().clamp_min(1)

    def policy_term(self, ratio: Tensor, targets: Tensor) -> Tensor:
        return clipped_surrogate(ratio, targets.to(ratio.dtype), self.cfg.clip_range)

    @functools.cached_property
    def sampler(self) -> Sampler:
        """The run's sampler on the algorithm's grid (float64 for the certificate's reference)."""
        return Sampler(self.sample, self.sigmas)

    def log_ratio(self, step: Transition) -> Tensor:
        """log r [B] of a trained step: log p_theta - log p_old."""
        return step.log_prob - step.old_log_prob

    def step_policy_term(self, step: int | Tensor, ratio: Tensor, targets: Tensor) -> Tensor:
        """The target-dependent term [B] of trained step ``step`` at ``ratio``: the clipped surrogate."""
        return self.policy_term(ratio, targets)

    def step_loss(self, step: Transition, targets: Tensor) -> StepLoss:
        ratio = torch.exp(self.log_ratio(step))
        policy = self.step_policy_term(step.index, ratio, targets)
        kl = None
        if step.ref_mean is not None:
            kl = kl_penalty(step.mean, step.ref_mean, step.std, self.kl_weights[step.index]).to(policy.dtype)
        return StepLoss(policy, kl, ratio.detach())

    def recomputed(self, policy, step: Transition, emb) -> Transition:
        """The recorded step ``step`` (x_j, x_{j+1}) recomputed in float64 by ``policy``, its own old policy (log p_old
        = stopgrad(log p)), with the reference's mean when the KL term is on."""
        x = dataclasses.replace(step, sample=step.sample.double(), next_sample=step.next_sample.double())
        step = policy_step(policy, self.sampler, x, emb).on_policy()
        ref_mean = reference_mean(policy, self.sampler, step, emb) if self.kl_weight else None
        return dataclasses.replace(step, ref_mean=ref_mean)

    def reference_loss(self, policy, step: Transition, emb, targets: Tensor) -> Tensor:
        """The certificate's anchor (``lean equivalence``): the loss [B] of one recorded trained step
        (x_j, x_{j+1}) recomputed by ``policy`` (the float64 twin of ``lean.tools.equivalence``) straight from the
        module docstring, with the ratio 1 by construction (log p - stopgrad(log p)). Summed with the weights 1/(N K),
        its gradient is the one every schedule computes on-policy."""
        return self.step_loss(self.recomputed(policy, step, emb), targets.double()).total(self.kl_weight)
