"""Flash-GRPO: GRPO trained on one SDE step per trajectory, the step shared by the group, each step's gradient
rescaled to a common magnitude, as its code computes it.

Source: github.com/Shredded-Pork/Flash-GRPO at 8cfc973 ("Add files via upload"; HEAD 4211013 changes the code only
in config/dgx.py's beta): scripts/train_wanx2_1_flash.py ("the script"), its rollout
flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob_sample.py ("sample.py"), its training step
wan2_1_pipeline_with_logprob2.py ("logprob2.py"), config/dgx.py:wan2_1_flash and config/base.py. The recipe is the
preset ``flashgrpo-wan``. Targets, clip and KL are GRPO's (``lean.algorithms.grpo``).

Single-step training, iso-temporal grouping. Each rollout has one SDE step j, drawn uniformly from the first
``algorithm.flash_grpo.steps`` = 10 steps (the script :693-706: ``random.choices(range(10))`` once per prompt, so
every sample of a group shares it); the other steps are deterministic Euler steps (sample.py:332-343, logprob2.py:70)
and only step j is stored (sample.py:346-351) and trained: K = 1.

Temporal gradient rectification. With the flow_grpo_linear SDE (sample.py:51-52) the transition at step j is
N(mu_j, std_j^2) with mu_j = a_j x + b_j v (v the velocity) and std_j = s_j sqrt(-dt_j); the gradient of log p through
v is eps b_j / std_j (eps the rollout's noise), so its scale is c_j = |b_j| / std_j
= sqrt(-dt)/s + s sqrt(-dt) (1 - sigma) / (2 sigma) (the script's comment, :983). Each sample's surrogate is
multiplied by coe_j = 1 / c_j (logprob2.py:81's last return; the script's table :984, 7.4770 at t = 999 ... 3.7754
at t = 785, is coe on Wan's 20-step grid at shift 3, see tests/test_flash_grpo.py) over a normaliser:

    w_j = coe_j / mean_{k < steps} coe_k
    loss_b = w_{j_b} max(-A_b r_b, -A_b clip(r_b, 1 - c, 1 + c)) + beta kl_b          (the script :976-1003)

L = 1/N sum_b loss_b (``torch.mean`` over the micro-batch, :997). coe_j is read here from the sampler's own
transition (any Gaussian SDE kind): b_j = mu_j(x=0, v=1) - mu_j(x=0, v=0).

Differences from the source:
* one step per rollout, shared by every group of the iteration (and every process): lean's sampler has one set of
  SDE steps per rollout batch (``StepSelection.stochastic`` [num_steps]); the script draws one per prompt, so the
  groups of one optimizer step sit at different steps. A per-group draw needs a per-sample stochastic mask in
  ``lean.sampling``.
* the normaliser: the script divides by the mean of coe over the optimizer step's samples on every process (:990,
  ``accelerator.reduce(value_tensor.mean())``: 96 groups' draws in the published run); with one step per rollout that
  mean would cancel the weight, so lean divides by its expectation under the uniform draw, mean_{k < steps} coe_k, as
  UniRL's re-implementation does over its candidate pool (unirl/algorithms/flashgrpo.py at 2487630, which draws one
  step per prompt through a per-sample SDE index in its sampler).
* the script passes the prompt's step as a one-element list (:706), which sample.py:332 compares with an int (never
  equal: no step would be stochastic and :736 would stack an empty list); lean runs the evident intent.
* the script skips its first two epochs (:690-692, :775-776: "group_size will be buggy"); lean trains from the first.

Why Retain and Reweight are exact: w_j depends on the grid and the drawn step only (drawn before the rollout: a
constant); on-policy r = 1, so grad L = 1/N sum_b [-A_b w_{j_b} grad log p_b + beta grad kl_b], GRPO's with a
constant weight per step: linear in A_b (the A / Â fold), and the rollout's own graph gives it.

Needs a Gaussian transition (``sample.sde_kind`` other than cps, whose log p drops the Gaussian's scale).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.algorithms.grpo import GRPO
from lean.config.checks import check_positive
from lean.config.sections import register_options
from lean.sampling.rollout import iteration_generator
from lean.sampling.sde import TRANSITIONS, Sde, window_selection

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.sampling.sde import StepSelection

STEP_STREAM = 97  # iteration_generator purpose of the trained step's draw (one stream for all processes)


def drawable_steps(steps: int, num_steps: int) -> int:
    """How many first steps the SDE step is drawn from: ``algorithm.flash_grpo.steps``, at most num_steps - 1 (the
    last step is never trained)."""
    return min(steps, num_steps - 1)


def rectification(sde: Sde) -> Tensor:
    """coe_j = std_j / |b_j| of every step but the last [num_steps - 1] (module docstring): the transition's std over
    the velocity's coefficient in its mean, b_j = mu_j(0, 1) - mu_j(0, 0) (the mean is affine in x and v)."""
    sigma, sigma_next = sde.sigmas[:-2], sde.sigmas[1:-1]
    zero = torch.zeros_like(sigma)
    transition = TRANSITIONS[sde.kind]
    with_velocity, std = transition(sde, zero, torch.ones_like(sigma), sigma, sigma_next)
    without, _ = transition(sde, zero, zero, sigma, sigma_next)
    return std / (with_velocity - without).abs()


class FlashGRPO(GRPO):
    """GRPO on one drawn SDE step per rollout, its surrogate weighted by w_j (module docstring)."""

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        if cfg.sample.sde_window:
            return "sample.sde_window", cfg.sample.sde_window, "flash_grpo draws its own step: algorithm.flash_grpo"
        if cfg.sample.sde_kind == "cps":
            return "sample.sde_kind", cfg.sample.sde_kind, "flash_grpo's rectification needs a Gaussian transition"
        return None

    @classmethod
    def steps(cls, cfg: RunConfig, iteration: int, batch_size: int) -> StepSelection:
        """One SDE (and trained) step for every sample, uniform over the first :func:`drawable_steps`."""
        generator = iteration_generator(cfg.train.seed, iteration, purpose=STEP_STREAM)
        step = int(
            torch.randint(
                drawable_steps(cfg.algorithm.flash_grpo.steps, cfg.sample.num_steps), (1,), generator=generator
            )
        )
        return window_selection(cfg.sample.num_steps, batch_size, step, 1)

    @functools.cached_property
    def step_weights(self) -> Tensor:
        """w_j = coe_j / mean_{k < steps} coe_k of every step but the last [num_steps - 1]."""
        coe = rectification(Sde.of(self.sample, self.sigmas))
        return coe / coe[: drawable_steps(self.cfg.flash_grpo.steps, self.sample.num_steps)].mean()

    def step_policy_term(self, step: int | Tensor, ratio: Tensor, targets: Tensor) -> Tensor:
        """The clipped surrogate times w_j (the KL term, added by ``step_loss``, is not weighted: the script :1003)."""
        return self.policy_term(ratio, targets) * self.step_weights[step].to(ratio.dtype)


@register_options("algorithm.flash_grpo")
@dataclass
class FlashGRPOConfig:
    """Flash-GRPO's keys (``lean/algorithms/flash_grpo.py``)."""

    steps: int = 10
    """The rollout's one SDE step is drawn uniformly from its first this-many steps (at most num_steps - 1): the
    script's ``weights = [1] * 10`` "only choose the first 10 steps" (train_wanx2_1_flash.py:697 at 8cfc973)."""

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.steps", self.steps)
