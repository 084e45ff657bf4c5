"""SDE steps against hand-derived numbers, gradients, batching/noise invariances, schedule and step planning."""

import itertools
import math

import pytest
import torch

from lean.sampling.sde import (
    SDE_KINDS,
    Sde,
    StepRule,
    num_trained_steps,
    ode_step,
    sde_step_with_logprob,
    select_steps,
    sigma_schedule,
)

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def hand_mean_std(kind: str, x: float, v: float, s: float, s_next: float, eta: float, sigma1: float):
    """The transition mean and std of one scalar coordinate, written out from the papers' formulas."""
    if kind == "flow_grpo":
        dt = s_next - s
        scale = math.sqrt(s / (1 - (sigma1 if s == 1 else s))) * eta
        mean = x * (1 + scale**2 / (2 * s) * dt) + v * (1 + scale**2 * (1 - s) / (2 * s)) * dt
        return mean, scale * math.sqrt(-dt)
    if kind == "flow_grpo_linear":  # these schedules end at 0, so s = η·σ_1·σ
        dt = s_next - s
        scale = eta * sigma1 * s
        mean = x * (1 + scale**2 / (2 * s) * dt) + v * (1 + scale**2 * (1 - s) / (2 * s)) * dt
        return mean, scale * math.sqrt(-dt)
    if kind == "cps":
        std = s_next * math.sin(eta * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return x0 * (1 - s_next) + x1 * math.sqrt(max(s_next**2 - std**2, 0.0)), std
    d_sigma = s_next - s
    score = -(x - (x - s * v) * (1 - s)) / s**2
    return x + d_sigma * v - 0.5 * eta**2 * score * d_sigma, eta * math.sqrt(s - s_next)


def hand_log_prob(kind: str, x_next: float, mean: float, std: float) -> float:
    if kind == "cps":
        return -((x_next - mean) ** 2)
    return -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI


# Worked by hand: x = 1, v = 2, σ = 0.5, σ' = 0.25, prev_sample x' = 0.5.
#   flow_grpo, η = 1:   s = sqrt(0.5/0.5) = 1, dt = -0.25, mean = 1·(1 - 0.25) + 2·(1 + 0.5)·(-0.25) = 0, std = 0.5
#   cps, η = 1/3:       std = 0.25·sin(π/6) = 0.125, x̂0 = 0, x̂1 = 2, mean = 2·sqrt(0.0625 - 0.015625) = 0.4330127
#   dance, η = 1:       x̂0 = 0, score = -1/0.25 = -4, mean = 1 - 0.5 + (2)·(-0.25) = 0, std = sqrt(0.25) = 0.5
# Gaussian log p(0.5 | 0, 0.5) = -0.5 + log 2 - log sqrt(2π) = -0.7257913526; cps: -(0.5 - 0.4330127)² = -0.0044873.
@pytest.mark.parametrize(
    "kind, eta, mean, std, log_prob",
    [
        ("flow_grpo", 1.0, 0.0, 0.5, -0.7257913526447274),
        ("cps", 1 / 3, 0.4330127018922193, 0.125, -0.004487298108),
        ("dance", 1.0, 0.0, 0.5, -0.7257913526447274),
    ],
)
def test_worked_example(kind, eta, mean, std, log_prob):
    sigmas = torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    x, v, x_next = (torch.full((1, 2, 2), value, dtype=torch.float64) for value in (1.0, 2.0, 0.5))
    out, lp, m, sd = sde_step_with_logprob(Sde(kind, eta, sigmas), v, x, 1, prev_sample=x_next)
    torch.testing.assert_close(m, torch.full_like(x, mean))
    assert sd.shape == (1, 1, 1) and sd.item() == pytest.approx(std, abs=1e-12)
    assert lp.shape == (1,) and lp.item() == pytest.approx(log_prob, abs=1e-9)
    assert torch.equal(out, x_next)


def test_flow_grpo_sigma_one_uses_sigmas_1():
    # σ = 1, σ' = σ_max = 0.75, η = 0.5: s = 0.5·sqrt(1/(1 - 0.75)) = 1, dt = -0.25,
    # mean = 1·(1 + ½·(-0.25)) + 2·(1 + 0)·(-0.25) = 0.375, std = 1·sqrt(0.25) = 0.5.
    sigmas = torch.tensor([1.0, 0.75, 0.25, 0.0], dtype=torch.float64)
    x, v = torch.ones(1, 3, dtype=torch.float64), torch.full((1, 3), 2.0, dtype=torch.float64)
    _, lp, mean, std = sde_step_with_logprob(Sde("flow_grpo", 0.5, sigmas), v, x, 0, prev_sample=x)
    torch.testing.assert_close(mean, torch.full_like(x, 0.375))
    assert std.item() == pytest.approx(0.5)
    assert torch.isfinite(lp).all() and lp.item() == pytest.approx(hand_log_prob("flow_grpo", 1.0, 0.375, 0.5))


@pytest.mark.parametrize("kind", SDE_KINDS)
@pytest.mark.parametrize("index", [0, 1, 3])
def test_sampled_step_matches_formula_elementwise(kind, index):
    sigmas = torch.tensor([1.0, 0.9, 0.6, 0.3, 0.0], dtype=torch.float64)
    eta = 0.7
    x, v = torch.randn(2, 2, 3, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64).unbind(0)
    out, lp, mean, std = sde_step_with_logprob(
        Sde(kind, eta, sigmas), v, x, index, generator=torch.Generator().manual_seed(7)
    )
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    s, s_next = sigmas[index].item(), sigmas[index + 1].item()
    for b in range(2):
        expected_lp = []
        for i, j in itertools.product(range(3), range(2)):
            m, sd = hand_mean_std(kind, x[b, i, j].item(), v[b, i, j].item(), s, s_next, eta, sigmas[1].item())
            assert mean[b, i, j].item() == pytest.approx(m, abs=1e-12)
            assert std[b].item() == pytest.approx(sd, abs=1e-12)
            assert out[b, i, j].item() == pytest.approx(m + sd * noise[b, i, j].item(), abs=1e-12)
            expected_lp.append(hand_log_prob(kind, out[b, i, j].item(), m, sd))
        assert lp[b].item() == pytest.approx(sum(expected_lp) / len(expected_lp), abs=1e-10)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_scoring_reproduces_sampling(kind):
    sigmas = sigma_schedule(6, 3.0)
    x, v = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(1)).unbind(0)
    out, lp, mean, _ = sde_step_with_logprob(Sde(kind, 0.8, sigmas), v, x, 2, generator=torch.Generator())
    out2, lp2, mean2, _ = sde_step_with_logprob(Sde(kind, 0.8, sigmas), v, x, 2, prev_sample=out)
    assert torch.equal(out, out2) and torch.equal(lp, lp2) and torch.equal(mean, mean2)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_gradient_through_mean_only(kind):
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0], dtype=torch.float64)
    eta, index, d = 0.6, 1, 4
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    v = torch.randn(2, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    x_next = torch.randn(2, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64, requires_grad=True)
    _, lp, mean, _ = sde_step_with_logprob(Sde(kind, eta, sigmas), v, x, index, prev_sample=x_next)
    lp.sum().backward()
    assert x_next.grad is None

    s, s_next = sigmas[index].item(), sigmas[index + 1].item()
    if kind == "flow_grpo":
        scale2 = eta**2 * s / (1 - s)
        dmean_dv = (1 + scale2 * (1 - s) / (2 * s)) * (s_next - s)
    elif kind == "flow_grpo_linear":
        scale2 = (eta * sigmas[1].item() * s) ** 2
        dmean_dv = (1 + scale2 * (1 - s) / (2 * s)) * (s_next - s)
    elif kind == "cps":
        std_c = s_next * math.sin(eta * math.pi / 2)
        dmean_dv = -s * (1 - s_next) + (1 - s) * math.sqrt(s_next**2 - std_c**2)
    else:  # d score/dv = -(1 - σ)/σ
        dmean_dv = (s_next - s) * (1 + 0.5 * eta**2 * (1 - s) / s)
    residual = (x_next - mean).detach()
    # d/dv of mean_d(-(x' - m)²/(2std²)) is (x' - m)/std² · dm/dv / d; cps drops 1/(2std²).
    _, hand_std = hand_mean_std(kind, 0.0, 0.0, s, s_next, eta, sigmas[1].item())
    weight = 2.0 if kind == "cps" else 1.0 / hand_std**2
    torch.testing.assert_close(v.grad, weight * residual * dmean_dv / d)


def test_sampled_prev_sample_is_detached():
    sigmas = sigma_schedule(4, 1.0)
    v = torch.randn(2, 3, requires_grad=True)
    out, lp, mean, _ = sde_step_with_logprob(Sde("flow_grpo", 1.0, sigmas), v, torch.zeros(2, 3), 1)
    assert not out.requires_grad and mean.requires_grad and lp.requires_grad


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_int_and_per_sample_index_agree(kind):
    sigmas = sigma_schedule(5, 3.0)
    x, v = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(5)).unbind(0)
    sde, step = Sde(kind, 0.5, sigmas), dict(prev_sample=x * 0.9)
    same = [sde_step_with_logprob(sde, v, x, idx, **step) for idx in (2, torch.tensor([2, 2, 2]))]
    for a, b in zip(*same):
        torch.testing.assert_close(a.expand_as(b), b)

    mixed = sde_step_with_logprob(sde, v, x, torch.tensor([0, 3, 1]), **step)
    for b, idx in enumerate((0, 3, 1)):
        one = slice(b, b + 1)
        single = sde_step_with_logprob(sde, v[one], x[one], idx, prev_sample=x[one] * 0.9)
        for got, want in zip(mixed, single):
            torch.testing.assert_close(got[b : b + 1], want)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_generator_list_noise_independent_of_batching(kind):
    sigmas = sigma_schedule(5, 3.0)
    x, v = torch.randn(2, 4, 3, 4, generator=torch.Generator().manual_seed(6)).unbind(0)
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    batch, *_ = sde_step_with_logprob(Sde(kind, 0.9, sigmas), v, x, 1, generator=gens([10, 11, 12, 13]))
    alone, *_ = sde_step_with_logprob(Sde(kind, 0.9, sigmas), v[2:3], x[2:3], 1, generator=gens([12]))
    torch.testing.assert_close(batch[2:3], alone)
    assert not torch.allclose(batch[0], batch[1])
    with pytest.raises(ValueError, match="generator"):
        sde_step_with_logprob(Sde(kind, 0.9, sigmas), v, x, 1, generator=gens([1, 2]))


@pytest.mark.parametrize("kind", SDE_KINDS)
@pytest.mark.parametrize(
    "dtype, lp_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_dtypes(kind, dtype, lp_dtype):
    sigmas = sigma_schedule(5, 3.0)
    x, v = torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(8)).to(dtype).unbind(0)
    out, lp, mean, std = sde_step_with_logprob(Sde(kind, 0.7, sigmas), v, x, 1, generator=torch.Generator())
    assert out.dtype == dtype and mean.dtype == lp.dtype == std.dtype == lp_dtype  # the mean stays unrounded
    assert std.shape == (2, 1, 1) and torch.isfinite(lp).all()
    # Re-scoring the stored (rounded) sample gives the very same log-prob.
    _, lp2, _, _ = sde_step_with_logprob(Sde(kind, 0.7, sigmas), v, x, 1, prev_sample=out)
    assert torch.equal(lp, lp2)


def test_cps_last_step_is_the_deterministic_mean():
    sigmas = sigma_schedule(4, 3.0)
    x, v = torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(9)).unbind(0)
    out, lp, mean, std = sde_step_with_logprob(Sde("cps", 0.5, sigmas), v, x, 3, generator=torch.Generator())
    assert std.eq(0).all() and torch.equal(out, mean) and lp.eq(0).all()
    torch.testing.assert_close(out, x - sigmas[3].float() * v)  # σ' = 0: the predicted x0


@pytest.mark.parametrize("kind", ["flow_grpo", "dance"])
def test_last_step_stays_finite(kind):
    sigmas = sigma_schedule(4, 3.0)
    x, v = torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(9)).unbind(0)
    out, lp, _, std = sde_step_with_logprob(Sde(kind, 0.5, sigmas), v, x, 3, generator=torch.Generator())
    assert (std > 0).all() and torch.isfinite(out).all() and torch.isfinite(lp).all()


def test_ode_step():
    sigmas = torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    x, v = torch.tensor([[1.0, -2.0]]), torch.tensor([[2.0, 4.0]])
    torch.testing.assert_close(ode_step(v, x, sigmas, 1), torch.tensor([[0.5, -3.0]]))  # x - 0.25·v
    torch.testing.assert_close(
        ode_step(v.repeat(2, 1), x.repeat(2, 1), sigmas, torch.tensor([0, 2])), torch.tensor([[0.0, -4.0], [0.5, -3.0]])
    )


def test_invalid_arguments():
    sigmas = sigma_schedule(4, 3.0)
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kind"):
        sde_step_with_logprob(Sde("ddim", 0.5, sigmas), x, x, 0)
    for bad in (0.0, -0.1):
        with pytest.raises(ValueError, match="noise_level"):
            sde_step_with_logprob(Sde("cps", bad, sigmas), x, x, 0)
    with pytest.raises(ValueError, match="index"):
        sde_step_with_logprob(Sde("cps", 0.5, sigmas), x, x, 4)


def test_sigma_schedule_is_the_schedulers():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for steps, shift in ((10, 3.0), (4, 1.0)):
        sigmas = sigma_schedule(steps, shift)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
        scheduler.set_timesteps(steps)
        assert sigmas.dtype == torch.float64 and sigmas.shape == (steps + 1,)
        torch.testing.assert_close(sigmas, scheduler.sigmas.double(), rtol=0, atol=0)
        assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas.diff() < 0).all()
    # shift 1: a plain linspace of t from 1 to sigma_min (1/1000 for 1000 training steps)
    torch.testing.assert_close(
        sigma_schedule(3, 1.0)[:-1], torch.tensor([1.0, 0.5005, 0.001], dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_plan_first():
    assert [num_trained_steps(10, f) for f in (0.99, 1.0, 0.5, 0.01)] == [9, 9, 5, 1]
    assert num_trained_steps(100, 0.29) == 29
    plan = select_steps(StepRule(10, timestep_fraction=0.99, selection="first"), 3)
    assert plan.stochastic.all() and plan.window_start is None
    assert plan.trained.shape == (3, 10) and plan.trained[:, :9].all() and not plan.trained[:, 9:].any()
    assert select_steps(StepRule(10, timestep_fraction=0.5), 2).trained.sum(1).tolist() == [5, 5]


def test_plan_random_per_sample():
    gens = lambda: [torch.Generator().manual_seed(100 + b) for b in range(16)]  # noqa: E731
    plan = select_steps(StepRule(8, timestep_fraction=0.5, selection="random"), 16, sample_generators=gens())
    assert plan.stochastic.all()
    assert plan.trained.sum(1).eq(4).all() and not plan.trained[:, -1].any()
    assert len({tuple(row.tolist()) for row in plan.trained}) > 1  # samples draw their own steps
    assert torch.equal(
        plan.trained,
        select_steps(StepRule(8, timestep_fraction=0.5, selection="random"), 16, sample_generators=gens()).trained,
    )
    # sample b's steps depend on its generator only, not on the batch around it
    alone = select_steps(StepRule(8, timestep_fraction=0.5, selection="random"), 1, sample_generators=gens()[5:6])
    assert torch.equal(alone.trained[0], plan.trained[5])
    assert torch.equal(plan.grad_steps, plan.trained.any(0))
    tiny = select_steps(StepRule(8, timestep_fraction=0.01, selection="random"), 2, sample_generators=gens()[:2])
    assert tiny.trained.sum(1).tolist() == [1, 1]


def test_plan_window():
    starts = set()
    for seed in range(60):
        generator = torch.Generator().manual_seed(seed)
        plan = select_steps(StepRule(10, timestep_fraction=0.99, sde_window=2), 2, window_generator=generator)
        s = plan.window_start
        expected = torch.zeros(10, dtype=torch.bool)
        expected[s : s + 2] = True
        assert torch.equal(plan.stochastic, expected) and torch.equal(plan.trained, expected.expand(2, 10))
        starts.add(s)
    assert starts == {0, 1, 2, 3}  # default: the window stays in the first half (steps < 5)
    plan = select_steps(
        StepRule(10, sde_window=3, sde_window_max_start=6), 1, window_generator=torch.Generator().manual_seed(0)
    )
    assert 0 <= plan.window_start <= 6 and not plan.trained[:, -1].any()
    with pytest.raises(ValueError, match="sde_window_max_start"):
        select_steps(StepRule(10, sde_window=3, sde_window_max_start=7), 1)
    with pytest.raises(ValueError, match="sde_window"):
        select_steps(StepRule(10, sde_window=10), 1)
    with pytest.raises(ValueError, match="selection"):
        select_steps(StepRule(10, selection="last"), 1)
