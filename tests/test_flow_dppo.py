"""Flow-DPPO (lean/algorithms/flow_dppo.py): off-policy its loss is UniRL's KL-masked surrogate, written here in float64
from flowdppo.py:86-111 at 1a7b501; on-policy nothing is masked and the gradient is GRPO's; its schedules are certified
and a bad threshold is one config line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny

from lean.algorithms import build_algorithm
from lean.config import ConfigError
from lean.sampling.sde import Sde, sde_step_with_logprob, sigma_schedule
from lean.sampling.transition import Transition
from lean.tools.equivalence import run_equivalence

DPPO = ["algorithm.name=flow_dppo", "model.dtype=float64"]


def _step(v: torch.Tensor, x: torch.Tensor, sigmas: torch.Tensor, j: int, x_next: torch.Tensor | None = None):
    # the step's noise from a seeded generator: the global RNG's state depends on which tests ran before on the worker
    noise = torch.Generator().manual_seed(1) if x_next is None else None
    return sde_step_with_logprob(Sde("flow_grpo", 0.7, sigmas), v, x, j, prev_sample=x_next, generator=noise)


def published_loss(log_p, log_p_old, mean, mean_old, std, advantages, threshold):
    """flowdppo.py:86-111: -A r, zeroed where the mean-KL (per element (mu - mu_old)^2 / (2 sigma^2), averaged over
    the latent) is not under the threshold and r moves the way A pushes; [B]."""
    ratio = torch.exp(log_p - log_p_old)
    kl = ((mean - mean_old) ** 2 / (2 * std**2)).flatten(1).mean(dim=1)
    removed = ~(kl < threshold) & (((ratio > 1.0) & (advantages > 0)) | ((ratio < 1.0) & (advantages < 0)))
    return torch.where(~removed.detach(), -advantages * ratio, torch.zeros(())), kl, removed


def test_off_policy_the_loss_and_its_gradient_are_the_sources():
    g = torch.Generator().manual_seed(0)
    sigmas = sigma_schedule(10, 3.0).double()
    x = torch.randn(8, 4, 8, 8, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)
    v_old = torch.randn(x.shape, generator=g, dtype=torch.float64)
    # rows moved by different amounts: some stay inside the trust region, some leave it
    scale = torch.tensor([1e-4, 1e-4, 3e-2, 3e-2, 3e-2, 3e-2, 1e-1, 1e-1], dtype=torch.float64).view(-1, 1, 1, 1)
    v_new = (v_old + scale * torch.randn(x.shape, generator=g, dtype=torch.float64)).requires_grad_()
    j = 2
    x_next, log_p_old, mean_old, std = _step(v_old, x, sigmas, j)
    _, log_p, mean, _ = _step(v_new, x, sigmas, j, x_next)
    kl = ((mean - mean_old) ** 2).flatten(1).mean(dim=1).detach() / (2 * std.flatten()[0] ** 2)
    # between the small moves and the large ones (half of them out), at no term's own KL: a threshold equal to one
    # would decide that term by the last bit of two reductions (the thread count changes it)
    threshold = float(kl.sort().values[3:5].mean())
    algorithm = build_algorithm(tiny(*DPPO, f"algorithm.flow_dppo.kl_threshold={threshold}"), sigmas)
    step = Transition(index=j, sample=x, next_sample=x_next, log_prob=log_p, mean=mean, std=std)
    got = algorithm.step_loss(dataclasses.replace(step, old_log_prob=log_p_old, old_mean=mean_old), advantages)
    want, _, removed = published_loss(log_p, log_p_old, mean, mean_old, std, advantages, threshold)
    assert 0 < removed.sum() < (kl >= threshold).sum()  # the mask binds, and not on every term outside
    torch.testing.assert_close(got.policy, want, rtol=1e-13, atol=0)
    (grad,) = torch.autograd.grad(got.policy.sum(), v_new, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want.sum(), v_new)
    torch.testing.assert_close(grad, want_grad, rtol=1e-13, atol=0)
    assert grad.flatten(1)[removed].abs().max() == 0  # a dropped term carries no gradient


@pytest.mark.parametrize("threshold", [0.0, 1e-5])
def test_on_policy_nothing_is_dropped_and_the_gradient_is_grpos(threshold):
    sigmas = sigma_schedule(10, 3.0).double()
    sets = [*DPPO, f"algorithm.flow_dppo.kl_threshold={threshold}"]
    dppo, grpo = (build_algorithm(tiny(*sets, f"algorithm.name={n}"), sigmas) for n in ("flow_dppo", "grpo"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    targets = torch.tensor([0.7, -1.3], dtype=torch.float64)
    v0 = torch.randn(x.shape, generator=g, dtype=torch.float64)
    x_next, grads = _step(v0, x, sigmas, 5)[0], {}
    for name, algorithm in (("dppo", dppo), ("grpo", grpo)):
        v = v0.clone().requires_grad_()
        _, log_p, mean, std = _step(v, x, sigmas, 5, x_next)
        step = Transition(index=5, sample=x, next_sample=x_next, log_prob=log_p, mean=mean, std=std)
        loss = algorithm.step_loss(step.on_policy(), targets)
        assert torch.equal(loss.ratio, torch.ones_like(loss.ratio))  # to the bit
        (grads[name],) = torch.autograd.grad(loss.policy.sum(), v)
    assert torch.equal(grads["dppo"], grads["grpo"])


@pytest.mark.timeout(120)
def test_in_float64_every_schedule_is_the_reference_with_the_kl_and_a_later_update():
    """Retain and Reweight against Recompute and the float64 reference, with the KL to the reference on and a second,
    off-policy update per rollout (the hybrids' recompute reads the rollout's means)."""
    cfg = tiny(*DPPO, "algorithm.beta=0.04", "train.train_batch_size=2", "train.optimizer_steps_per_iteration=2")
    report = run_equivalence(cfg)
    assert set(report["reference"]) == {"recompute", "retain", "reweight"}
    for r in report["reference"].values():
        assert r["rel_norm_diff"] < 1e-10


def test_a_negative_threshold_is_one_config_line():
    with pytest.raises(ConfigError, match=r"algorithm\.flow_dppo\.kl_threshold"):
        tiny(*DPPO, "algorithm.flow_dppo.kl_threshold=-1")
