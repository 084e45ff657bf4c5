"""GRPO-Guard (lean/algorithms/grpo_guard.py): RatioNorm as FlowGRPO's script computes it equals its closed form, the
on-policy gradient is GRPO's reweighted by s_j / Delta_j, and what it cannot run is one config line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny

from lean.algorithms import build_algorithm
from lean.algorithms.grpo_guard import sample_means
from lean.config import ConfigError
from lean.sampling.sde import Sde, sde_step_with_logprob, sigma_schedule
from lean.sampling.transition import Transition

GUARD = ["algorithm.name=grpo_guard", "model.dtype=float64"]


def _step(v: torch.Tensor, x: torch.Tensor, sigmas: torch.Tensor, j: int, x_next: torch.Tensor | None = None):
    return sde_step_with_logprob(Sde("flow_grpo", 0.7, sigmas), v, x, j, prev_sample=x_next)


def test_ratio_norm_is_its_closed_form_off_policy():
    """log r = s (log p - log p_old + mean_{B,D}(delta^2) / (2 s^2)) = <eps, delta>/D + (mean_B|d|^2 - |d|^2)/(2 s D)"""
    g = torch.Generator().manual_seed(0)
    sigmas = sigma_schedule(10, 3.0).double()
    algorithm = build_algorithm(tiny(*GUARD), sigmas)
    x = torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    v_old, v_new = torch.randn(2, *x.shape, generator=g, dtype=torch.float64)
    for j in (0, 4, 8):
        x_next, log_p_old, mean_old, std = _step(v_old, x, sigmas, j)
        _, log_p, mean, _ = _step(v_new, x, sigmas, j, x_next)
        step = Transition(index=j, sample=x, next_sample=x_next, log_prob=log_p, mean=mean, std=std)
        got = algorithm.log_ratio(dataclasses.replace(step, old_log_prob=log_p_old, old_mean=mean_old))
        eps, delta, s = (x_next - mean_old) / std, mean - mean_old, std.flatten()[0]
        squares = sample_means(delta**2)
        closed = sample_means(eps * delta) + (squares.mean() - squares) / (2 * s)
        torch.testing.assert_close(got, closed, rtol=1e-12, atol=1e-14)
        assert (got - torch.log(torch.exp(log_p - log_p_old))).abs().max() > 1e-3  # not GRPO's ratio


def test_on_policy_the_ratio_is_one_and_the_gradient_grpos_times_s_over_dt():
    sigmas = sigma_schedule(10, 3.0).double()
    guard, grpo = (build_algorithm(tiny(*GUARD, f"algorithm.name={n}"), sigmas) for n in ("grpo_guard", "grpo"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    targets = torch.tensor([0.7, -1.3], dtype=torch.float64)
    j, grads = 5, {}
    v0 = torch.randn(x.shape, generator=g, dtype=torch.float64)
    x_next = _step(v0, x, sigmas, j)[0]  # the rollout's sample
    for name, algorithm in (("guard", guard), ("grpo", grpo)):
        v = v0.clone().requires_grad_()
        _, log_p, mean, std = _step(v, x, sigmas, j, x_next)
        step = Transition(index=j, sample=x, next_sample=x_next, log_prob=log_p, mean=mean, std=std)
        loss = algorithm.step_loss(step.on_policy(), targets)
        assert torch.equal(loss.ratio, torch.ones_like(loss.ratio))  # to the bit
        (grads[name],) = torch.autograd.grad(loss.policy.sum(), v)
        s = std.flatten()[0]
    torch.testing.assert_close(grads["guard"], grads["grpo"] * s / (sigmas[j] - sigmas[j + 1]), rtol=1e-12, atol=0)


def test_what_grpo_guard_cannot_run_is_one_config_line():
    with pytest.raises(ConfigError, match=r"sample\.sde_kind='cps'.*algorithm\.name=grpo_guard"):
        tiny(*GUARD, "sample.sde_kind=cps", "sample.noise_level=0.8")
