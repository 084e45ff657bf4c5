"""Flow-DPPO (lean/algorithms/flow_dppo.py): off-policy its loss is UniRL's KL-masked surrogate, written here in float64
from flowdppo.py:86-111 at 1a7b501; on-policy nothing is masked and the gradient is GRPO's; its schedules are certified
and a bad threshold is one config line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import reference_gap, tiny

from lean.algorithms import build_algorithm
from lean.algorithms.flow_dppo import trust_region_divergence
from lean.algorithms.grpo import kl_penalty
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
    assert reference_gap(report) < 1e-10


def test_a_negative_threshold_is_one_config_line():
    with pytest.raises(ConfigError, match=r"algorithm\.flow_dppo\.kl_threshold"):
        tiny(*DPPO, "algorithm.flow_dppo.kl_threshold=-1")


def unirl_kept(log_p, log_p_old, mean, mean_old, std, advantages, threshold):
    """The source's kept set [B], transcribed in float64 from UniRL at 1a7b501: the replay hands both means back cast to
    trajectory_precision = bf16 (unirl/models/sd3/diffusion.py:496, sd3_flowdppo.yaml:36; flowdppo.py:300-302 keeps
    that dtype); flowdppo.py:51 takes (p - q) ** 2 in bf16 and divides by the float32 2 sigma^2, :93 averages over the
    latent, :96-107 keeps a term under the threshold or moving against its advantage."""

    def bf16(t):  # one bf16 operation: the exact result, rounded to nearest even
        return t.to(torch.bfloat16).double()

    diff = bf16(bf16(mean) - bf16(mean_old))
    kl = (bf16(diff**2) / (2 * std.double() ** 2)).flatten(1).mean(dim=1)
    ratio = torch.exp(log_p.double() - log_p_old.double())
    removed = ~(kl < threshold) & (((ratio > 1.0) & (advantages > 0)) | ((ratio < 1.0) & (advantages < 0)))
    return ~removed, kl


def test_on_bfloat16_means_the_mask_keeps_the_sources_terms():
    """trust_region_means_dtype=bfloat16 on float32 means (lean's compute dtype for a bf16 trajectory) keeps exactly the
    terms the float64 transcription of UniRL keeps; the default (the float32 means) keeps others."""
    g = torch.Generator().manual_seed(0)
    b, tau, sigmas = 512, 1e-5, sigma_schedule(10, 3.0, "uniform")
    std = torch.stack([_step(torch.zeros(1, 4), torch.zeros(1, 4), sigmas.float(), j)[3][0] for j in range(5)])
    std = std[torch.arange(b) % 5].view(b, 1, 1, 1)  # the pool's steps 0..4
    mean = torch.randn(b, 16, 8, 8, generator=g)
    # each row moved so that its exact KL lies in [tau / 10, 10 tau]
    target = tau * 10 ** (2 * torch.rand(b, generator=g) - 1)
    mean_old = mean + (2 * target).sqrt().view(b, 1, 1, 1) * std * torch.randn(mean.shape, generator=g)
    log_p_old = torch.randn(b, generator=g)
    log_p = log_p_old + 0.01 * torch.randn(b, generator=g)
    advantages = torch.randn(b, generator=g)
    step = Transition(index=0, sample=mean, log_prob=log_p, mean=mean, std=std, old_log_prob=log_p_old)
    step = dataclasses.replace(step, old_mean=mean_old)
    want, kl = unirl_kept(log_p, log_p_old, mean, mean_old, std, advantages, tau)
    kept = {}
    for name in ("bfloat16", "compute"):
        algorithm = build_algorithm(tiny(f"algorithm.flow_dppo.trust_region_means_dtype={name}", *DPPO[:1]), sigmas)
        kept[name] = algorithm.step_loss(step, advantages).policy != 0
    assert 50 < (~want).sum() < b - 50  # the mask binds on many terms, not on all
    assert torch.equal(kept["bfloat16"], want)
    assert (kept["compute"] & ~want).sum() > 10  # in float32 terms the source drops are kept


@pytest.mark.parametrize("j,low,high", [(0, 1.2, 1.4), (4, 2.0, 2.25)])
def test_bfloat16_means_inflate_the_kl_at_the_threshold(j, low, high):
    """The size the preset header states: at exact KL 1e-5, unit-scale x_j and velocity, the KL on bf16 means reads
    1.3x (step 0) to 2.1x (step 4) of it on SD3's 10-step grid (shift 3)."""
    g = torch.Generator().manual_seed(0)
    sigmas = sigma_schedule(10, 3.0, "uniform").float()
    x, v = torch.randn(8, 16, 32, 32, generator=g), torch.randn(8, 16, 32, 32, generator=g)
    _, _, mean, std = _step(v, x, sigmas, j)
    old = mean + (2 * 1e-5) ** 0.5 * std * torch.randn(mean.shape, generator=g)
    exact = kl_penalty(mean.double(), old.double(), std.double())
    step = Transition(index=j, sample=x, mean=mean, std=std, old_mean=old)
    assert low < (trust_region_divergence(step, torch.bfloat16) / exact).mean() < high


def test_the_preset_draws_its_sde_steps_as_unirl():
    """Over 2,000 rollouts each of steps 0..4 is stochastic (and trained) as often as in UniRL's draw, written here
    from scheduler_utils.py:118-124 at 1a7b501 (3 of range(0, 5) without replacement, numpy seeded by the rollout
    index): 60 %, within 2 %; every draw is 3 steps of the pool, and the window's old contiguous draw would fail."""
    from lean.configure import load_config
    from lean.run.iteration import select_local_steps

    source = np.zeros(10)
    for rollout in range(2000):
        source[np.random.default_rng(rollout).choice(list(range(0, 5)), size=3, replace=False)] += 1
    cfg = load_config(None, preset="unirl-flow-dppo-sd3")
    counts = torch.zeros(10)
    for iteration in range(2000):
        steps = select_local_steps(cfg, iteration, [(0, 0, 0), (0, 0, 1)], None)
        assert steps.stochastic.sum() == 3 and not steps.stochastic[5:].any()
        assert torch.equal(steps.trained, steps.stochastic.expand(2, -1))
        counts += steps.stochastic
    np.testing.assert_allclose(counts.numpy() / 2000, source / 2000, atol=0.02)
    # the iteration the preset's certificate runs (tests/test_presets.py, iteration 0) has ODE steps between SDE steps
    first = select_local_steps(cfg, 0, [(0, 0, 0)], None).stochastic
    assert torch.nonzero(first).flatten().tolist() == [0, 2, 4]


def test_the_draw_and_the_dtype_are_checked_in_one_config_line():
    with pytest.raises(ConfigError, match=r"sample\.sde_steps_drawn"):
        tiny("sample.sde_window=2", "sample.sde_steps_drawn=3")
    with pytest.raises(ConfigError, match=r"algorithm\.flow_dppo\.trust_region_means_dtype"):
        tiny(*DPPO, "algorithm.flow_dppo.trust_region_means_dtype=bf16")
