"""E-GRPO: GRPO trained on one high-entropy SDE step per rollout, every other step an ODE step, the group sharing
its initial noise, its advantages normalised within the samples that share the SDE step.

Source: github.com/shengjun-zhang/VisualGRPO at ae619bf (E-GRPO, Zhang et al. 2026, arXiv:2601.00423):
fastvideo/workers/sampler/flux_sampler.py ("sampler"), fastvideo/trainer/grpo_trainer.py ("trainer"),
fastvideo/workers/rollout_buffer.py ("buffer"), fastvideo/config/{config,algorithm/grpo_merge}.yaml and
scripts/finetune/train_grpo_merge.sh ("the script"). The recipe is the preset ``egrpo-flux``.

A step's entropy. Step i of the SDE, merged over m grid intervals, goes from sigma_i to sigma_{i+m} as one Gaussian
transition N(mu, std^2 I) with std = s(sigma_i) sqrt(sigma_i - sigma_{i+m}) (sampler:163-170, :184; FlowGRPO's
s = eta sqrt(sigma / (1 - sigma)), sigma_max = sigmas[1] at sigma = 1). Its differential entropy per latent element is

    H_i(m) = 1/2 log(2 pi e) + log std_i(m)                                              (:func:`step_entropy`)

which falls along the schedule (FLUX's 16 steps, shift 3, eta 0.7: 1.06, 1.09, 0.76, 0.57, 0.43, ... -0.64): the
early steps are the high-entropy ones, and merging m low-entropy intervals into one step raises its entropy by
1/2 log((sigma_i - sigma_{i+m}) / (sigma_i - sigma_{i+1})). std is read from the sampler's own transition (any
Gaussian ``sample.sde_kind``).

Which steps. The SDE steps are ``algorithm.e_grpo.steps``, the script's ``grpo.eta_step_list=[1,2,3]`` (:25), each
unmerged (``eta_step_merge_list=[1,1,1]``, :26: the published run merges nothing). For each prompt the sampler rolls
out, per listed step k, a branch of G samples: the group's shared initial noise (``init_same_noise``,
sampler:474-479), ODE steps to step k (the anchor, :522-527), the one SDE step k (:538-546), ODE steps to the end
(:556-561; the reward reads the last step's x0-prediction, :405-410). lean rolls out one such branch per iteration:
step k_g = steps[g mod len(steps)] at iteration g, for every group (``window_selection`` of one step, as Flash-GRPO's
and MixGRPO's own steps are placed).

Multi-step group-normalised advantage. The samples that share a prompt and an SDE step form a group (buffer:87-130);
with lean's one step per rollout these are GRPO's groups, so the targets are GRPO's
(``lean.algorithms.groups``): A = clamp((r - mean_g) / (std_g + 1e-8), -5, 5), std unbiased (buffer:123,
trainer:241-243).

The loss of the trained step k, one optimizer step per trained step (trainer:296-337), no KL term:

    loss_b = max(-A_b r_b, -A_b clip(r_b, 1 - c, 1 + c)),   L = 1/G sum_b loss_b          (trainer:246-256)

Differences from the source:
* one branch per rollout: the source rolls out the branches of all three steps from one ODE anchor, then updates
  once per step (trainer:296-337), so its second and third updates score rollout log-probs one and two optimizer
  steps old (off-policy, under clip 1e-4); lean rolls out step k_g's branch with the current weights, so every update
  is on-policy, and three lean iterations hold the updates of one source iteration.
* multi-granularity rewards: ``granular_list=[1, 2]`` (grpo_merge.yaml:14, the script :27) scores each branch twice,
  after the full ODE tail and after one on every second step (sampler:551-571), and sums the two group-normalised
  advantages (buffer:111-128); lean scores the full tail only, so its advantage is one of the two terms (the source's
  is up to twice as large where the two rewards agree).
* sampler:507-575 nests the branches inside ``if index % num_generations == 0``, so samples 2-12 of a group append
  nothing and :583 stacks an empty list; lean runs the evident intent: each sample draws its own SDE step from the
  group's anchor (its ODE prefix from the shared x_0, ``sample.init_same_noise``).
* merging is not offered: the published run merges no step, lean's rollout walks the run's own grid, and the
  source's merged branch restarts its ODE tail at sigma_{k+1} instead of sigma_{k+m} (sampler:556-558 pass k), so a
  merge > 1 has no working reference. :func:`step_entropy` gives the merged step's entropy all the same.

Why Retain and Reweight are exact: the trained step is chosen before the rollout (a constant), and its loss is
GRPO's: on-policy r = 1, grad L = 1/N sum_b -A_b grad log p_b, linear in A_b and given by the rollout's own graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.algorithms.grpo import GRPO
from lean.config.checks import ConfigError
from lean.config.sections import register_options
from lean.sampling.sde import TRANSITIONS, Sde, window_selection

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.sampling.sde import StepSelection

HALF_LOG_2PI_E = 0.5 * math.log(2 * math.pi * math.e)


def step_entropy(sde: Sde, merge: int = 1) -> Tensor:
    """H_i(m) [num_steps + 1 - m]: the differential entropy per latent element of each step's Gaussian transition
    from sigma_i to sigma_{i+m} (module docstring), its std read from the SDE's own transition."""
    if merge < 1 or merge > len(sde.sigmas) - 1:
        raise ValueError(f"merge={merge}: must be in [1, num_steps = {len(sde.sigmas) - 1}]")
    sigma, sigma_next = sde.sigmas[:-merge], sde.sigmas[merge:]
    zero = torch.zeros_like(sigma)
    _, std = TRANSITIONS[sde.kind](sde, zero, zero, sigma, sigma_next)
    return HALF_LOG_2PI_E + torch.log(std)


def trained_step(steps: list[int], iteration: int) -> int:
    """Step k_g of ``iteration``: the listed steps in turn."""
    return steps[iteration % len(steps)]


class EGRPO(GRPO):
    """GRPO on one listed SDE step per rollout (module docstring; ``algorithm.e_grpo``)."""

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        if cfg.sample.sde_window:
            return "sample.sde_window", cfg.sample.sde_window, "e_grpo places its own SDE steps: algorithm.e_grpo.steps"
        steps, last = cfg.algorithm.e_grpo.steps, cfg.sample.num_steps - 2
        if max(steps) > last:
            fitting = [k for k in steps if k <= last]  # the listed steps this grid has, else a grid that has them all
            fix = f"algorithm.e_grpo.steps=[{','.join(map(str, fitting))}]" if fitting else None
            fix = fix or f"sample.num_steps={max(steps) + 2}"
            return "algorithm.e_grpo.steps", steps, f"steps in [0, sample.num_steps - 2 = {last}]", [fix]
        return None

    @classmethod
    def steps(cls, cfg: RunConfig, iteration: int, batch_size: int) -> StepSelection:
        """Step k_g stochastic and trained for every sample, the others ODE steps."""
        return window_selection(
            cfg.sample.num_steps, batch_size, trained_step(cfg.algorithm.e_grpo.steps, iteration), 1
        )


@register_options("algorithm.e_grpo")
@dataclass
class EGRPOConfig:
    """E-GRPO's keys (``lean/algorithms/e_grpo.py``)."""

    steps: list[int] = field(default_factory=lambda: [1, 2, 3])
    """The SDE (and trained) steps, one per iteration in turn: the high-entropy early steps of the script's
    ``grpo.eta_step_list=[1,2,3]`` (VisualGRPO train_grpo_merge.sh:25 at ae619bf)."""

    def validate(self, prefix: str) -> None:
        if not self.steps or min(self.steps) < 0:
            raise ConfigError(f"{prefix}.steps", self.steps, "a non-empty list of steps from 0")
