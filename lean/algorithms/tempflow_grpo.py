"""TempFlow-GRPO: GRPO on trajectory branches (one SDE step at a branching step k off a shared ODE trunk, ODE after
it), so a branch's reward credits step k alone, each step's surrogate weighted by its noise level.

Source: "TempFlow-GRPO: When Timing Matters for GRPO in Flow Models" (He et al., arXiv 2508.04324), its code
github.com/Shredded-Pork/TempFlow-GRPO. The newest snapshot ``fetch`` brings (afe6d33, 2025-08-08) holds the README
and figures only; the code was read from the later commits the file index stores: e66824e
(scripts/train_sd3_pr.py, "the SD3 script"; flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_perstep.py, "the
SD3 rollout"; sd3_sde_with_logprob_perstep.py, "the branch step"; sd3_sde_with_logprob.py, "the training step";
flux_pipeline_with_logprob_perstep.py, "the FLUX rollout"), 28a9b9b (scripts/train_flux_pr.py, "the FLUX script")
and 63e4def (config/dgx.py: pickscore_sd3_pr, flux_pr). Their line numbers could not be read (the index serves
characters): citations name the function or block. The advantage's statistics are flow_grpo's PerPromptStatTracker
(yifan123/flow_grpo at ac4c86e, flow_grpo/stat_tracking.py:11-31), which the scripts import. The recipe is the preset
``tempflowgrpo-sd3``. Targets, clip and KL are GRPO's (``lean.algorithms.grpo``).

Trajectory branching (the SD3 rollout's denoising loop; the FLUX rollout's is the same). One trunk per prompt: x_0
(the SDE's x_T) and deterministic Euler steps x_{j+1} = x_j + dt_j v_j. At every step j of the trunk the same
velocity also draws K = 6 SDE samples (the branch step: ``num_samples = 6``)

    x^b_{j+1} = mu_j(x_j, v_j) + std_j eps_b,   b = 1..K,

each continued to the end by Euler steps and decoded: reward R_{j,b}. Every other step of a branch is deterministic,
so R_{j,b} differs from its siblings' by step j's noise alone: process rewards for step j, no intermediate reward
model. The scripts' "seed group" (their advantage block: the rewards are not gathered across processes, the FLUX
script's comment ``# seed group``): the K branches of one trunk are one group, per step (the tracker's column-wise
statistics over one process's rows of a prompt):

    A_{j,b} = (R_{j,b} - mean_b' R_{j,b'}) / (std_b' R_{j,b'} + 1e-4)      (population std, stat_tracking.py:25-31)

clamped to +-adv_clip_max. lean: a group of K samples shares its x_T (``sample.init_same_noise``), so the ODE
steps before k give every sample of the group the same x_k, the trunk's; step k is the only SDE step
(``StepSelection``), the steps after it ODE steps: each sample is a branch at k, the group's GRPO advantage is
A_{k,b}.

Noise-aware weighting (the SD3 script's training loop, the FLUX script's: the surrogate times ``2.25 *
std_dev_t`` and ``1.73 * std_dev_t``). The training step returns std_j = s_j sqrt(-dt_j), the transition's std
(FlowGRPO's SDE, s_j = a sqrt(sigma_j / (1 - sigma_j)), a = 0.7), and the constant is 1 / mean of std_j over the
trained steps j < J = int(N timestep_fraction) = 9 of N = 10: 2.2527 on SD3.5's shift-3 grid at a = 0.7, 1.7260 on
FLUX's 1024-px grid (mu = 1.15) at a = 0.9 (tests/test_tempflow_grpo.py). So

    w_j = std_j / mean_{i < J} std_i
    loss_{j,b} = w_j max(-A_{j,b} r, -A_{j,b} clip(r, 1 - c, 1 + c)) + beta KL_{j,b}

with KL_{j,b} = mean_dims(||mu_theta - mu_ref||^2) / (2 std_j^2), not weighted (``kl_form: exact``: the training
step divides by the transition's own variance). The loss is averaged over the rows of each step's micro-batch and
accumulated over the J steps and the batches of an optimizer step (gradient_accumulation_steps x J micro-steps):
every trained step counts alike. Early (high-noise) steps weigh more: w_0 = 1.58, w_1 = 1.67, w_8 = 0.51 on SD3.5's
grid.

Here, std_j is read from the sampler's own transition (any ``sample.sde_kind``), and each rollout branches at one
step: k = iteration mod J, so J consecutive iterations train every step once, with the same weight as the source's
one iteration. L = 1/(N K) sum_b loss_{k,b} over the N samples of an update (K = 1 trained step each).

Differences from the source:
* one branching step per rollout, shared by every group (lean's sampler has one set of SDE steps per rollout batch),
  cycled over the J steps; the source branches every trunk at all J steps in one iteration (per prompt, N = 10,
  K = 6: the trunk's 10 forwards and K (N - 1 - j) for each step j's branches, 280 forwards for 54 trained branch
  steps; lean's rollout of a group: 60 forwards for 6).
* w_j's normaliser is computed, 1 / mean std, where the scripts write it rounded: 2.25 for 2.2527 (0.12 %), 1.73
  for 1.7260 (0.23 %).
* a group is the K branches of one trunk, as the source's seed group; the source's tracker also pools the branches of
  two trunks of the same prompt that land on one process (its K-repeat sampler can place a prompt twice there).

Why Retain and Reweight are exact: w_k depends on the grid and the iteration only (a constant of the update), the
ratio is 1 on-policy, so grad L = 1/N sum_b [-A_b w_k grad log p_b + beta grad KL_b]: GRPO's with a constant
weight, linear in A_b (Reweight's A / A-hat fold) and given by the rollout's own graph (Retain).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.algorithms.grpo import GRPO
from lean.sampling.sde import TRANSITIONS, Sde, num_trained_steps, window_selection

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.sampling.options import SampleConfig
    from lean.sampling.sde import StepSelection


def branch_steps(sample: SampleConfig) -> int:
    """J: the steps a rollout branches at, in turn, the first int(N x ``sample.timestep_fraction``) (the scripts'
    num_train_timesteps; 9 of 10), the last never."""
    return num_trained_steps(sample.num_steps, sample.timestep_fraction, sample.timestep_fraction_of)


def branch_step(sample: SampleConfig, iteration: int) -> int:
    """k at ``iteration``: the steps 0..J-1 in turn."""
    return iteration % branch_steps(sample)


def transition_stds(sde: Sde) -> Tensor:
    """std_j of the Gaussian transition of every step but the last [num_steps - 1] (it does not depend on x or v)."""
    sigma, sigma_next = sde.sigmas[:-2], sde.sigmas[1:-1]
    zero = torch.zeros_like(sigma)
    _, std = TRANSITIONS[sde.kind](sde, zero, zero, sigma, sigma_next)
    return std * torch.ones_like(sigma)  # a kind whose std is a number (cps) broadcast to the steps


def noise_weights(sde: Sde, steps: int) -> Tensor:
    """w_j = std_j / mean_{i < steps} std_i of every step but the last [num_steps - 1] (module docstring)."""
    std = transition_stds(sde)
    return std / std[:steps].mean()


class TempFlowGRPO(GRPO):
    """GRPO on the branches of one step k per rollout, its surrogate weighted by w_k (module docstring)."""

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        if cfg.sample.sde_window:
            return "sample.sde_window", cfg.sample.sde_window, "tempflow_grpo places its own branch step"
        if not cfg.sample.init_same_noise:
            return "sample.init_same_noise", False, "a group's branches leave one trunk: one x_T per group"
        return None

    @classmethod
    def working_overrides(cls, cfg: RunConfig) -> list[str]:
        fix = [] if cfg.sample.init_same_noise else ["sample.init_same_noise=true"]
        return fix + (["sample.sde_window=0"] if cfg.sample.sde_window else [])

    @classmethod
    def steps(cls, cfg: RunConfig, iteration: int, batch_size: int) -> StepSelection:
        """One SDE (and trained) step for every sample, k = iteration mod J; the others ODE steps."""
        return window_selection(cfg.sample.num_steps, batch_size, branch_step(cfg.sample, iteration), 1)

    @functools.cached_property
    def step_weights(self) -> Tensor:
        """w_j of every step but the last [num_steps - 1]."""
        return noise_weights(Sde.of(self.sample, self.sigmas), branch_steps(self.sample))

    def step_policy_term(self, step: int | Tensor, ratio: Tensor, targets: Tensor) -> Tensor:
        """The clipped surrogate times w_j (the KL term, added by ``step_loss``, is not weighted)."""
        return self.policy_term(ratio, targets) * self.step_weights[step].to(ratio.dtype)
