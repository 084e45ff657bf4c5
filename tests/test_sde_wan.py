"""The ``flow_grpo_linear`` SDE (FlowGRPO's Wan2.1 noise scale) against hand-derived numbers, and the published
pipelines' sigma grids (``sigma_schedule(..., grid)``) against the diffusers schedulers and formulas they come from."""

import math

import numpy as np
import pytest
import torch

from lean.sampling.sde import SIGMA_GRIDS, Sde, sde_step_with_logprob, sigma_schedule

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def hand_mean_std(x: float, v: float, s: float, s_next: float, eta: float, sigma1: float, sigma_last: float):
    """FlowGRPO's Wan step (wan_pipeline_with_logprob.py) for one scalar coordinate, with noise scale eta."""
    scale = eta * (sigma_last + (sigma1 - sigma_last) * s)
    dt = s_next - s
    mean = x * (1 + scale**2 / (2 * s) * dt) + v * (1 + scale**2 * (1 - s) / (2 * s)) * dt
    return mean, scale * math.sqrt(-dt)


def test_worked_example():
    # x = 1, v = 2, σ = 0.5, σ' = 0.25, σ_1 = 0.5, σ_N = 0, η = 1: s = 0.5·0.5 = 0.25, dt = -0.25,
    # mean = 1·(1 + 0.0625·(-0.25)) + 2·(1 + 0.0625·0.5)·(-0.25) = 0.984375 - 0.515625 = 0.46875,
    # std = 0.25·0.5 = 0.125; log p(0.5) = -(0.03125)²/(2·0.125²) - log 0.125 - log sqrt(2π) = 1.1292530.
    sigmas = torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    x, v, x_next = (torch.full((1, 2, 2), value, dtype=torch.float64) for value in (1.0, 2.0, 0.5))
    _, lp, mean, std = sde_step_with_logprob(Sde("flow_grpo_linear", 1.0, sigmas), v, x, 1, prev_sample=x_next)
    torch.testing.assert_close(mean, torch.full_like(x, 0.46875))
    assert std.item() == pytest.approx(0.125, abs=1e-15)
    assert lp.item() == pytest.approx(-0.5 * 0.03125**2 / 0.125**2 + math.log(8) - LOG_SQRT_2PI, abs=1e-12)
    assert lp.item() == pytest.approx(1.1292530, abs=1e-7)


@pytest.mark.parametrize("sigmas", [[1.0, 0.9, 0.6, 0.3, 0.0], [1.0, 0.8, 0.5, 0.2, 0.1]])
def test_sampled_step_matches_formula(sigmas):
    """Per-sample step indices; a schedule that does not end at 0 exercises the σ_N term."""
    sigmas = torch.tensor(sigmas, dtype=torch.float64)
    eta, index = 0.8, torch.tensor([0, 1, 3])
    x, v = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64).unbind(0)
    out, lp, mean, std = sde_step_with_logprob(
        Sde("flow_grpo_linear", eta, sigmas), v, x, index, generator=torch.Generator().manual_seed(5)
    )
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for b, i in enumerate(index.tolist()):
        s, s_next = sigmas[i].item(), sigmas[i + 1].item()
        expected_lp = []
        for j in range(4):
            m, sd = hand_mean_std(x[b, j].item(), v[b, j].item(), s, s_next, eta, sigmas[1].item(), sigmas[-1].item())
            assert mean[b, j].item() == pytest.approx(m, abs=1e-12) and std[b].item() == pytest.approx(sd, abs=1e-12)
            assert out[b, j].item() == pytest.approx(m + sd * noise[b, j].item(), abs=1e-12)
            expected_lp.append(-((out[b, j].item() - m) ** 2) / (2 * sd**2) - math.log(sd) - LOG_SQRT_2PI)
        assert lp[b].item() == pytest.approx(sum(expected_lp) / 4, abs=1e-10)


def test_gradient_through_mean_only():
    sigmas = sigma_schedule(20, 3.0, "unipc")
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    v = torch.randn(2, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64, requires_grad=True)
    x_next = torch.randn(2, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    _, lp, mean, std = sde_step_with_logprob(Sde("flow_grpo_linear", 1.0, sigmas), v, x, 4, prev_sample=x_next)
    lp.sum().backward()
    assert x_next.grad is None
    s, s_next = sigmas[4].item(), sigmas[5].item()
    scale = sigmas[1].item() * s
    dmean_dv = (1 + scale**2 * (1 - s) / (2 * s)) * (s_next - s)
    torch.testing.assert_close(v.grad, (x_next - mean).detach() / std**2 * dmean_dv / 5)


def test_grids_are_the_pipelines():
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler.set_timesteps(10)
    torch.testing.assert_close(sigma_schedule(10, 3.0, "euler"), euler.sigmas.double(), rtol=0, atol=0)
    # FluxPipeline: sigmas = linspace(1, 1/n, n) handed to the scheduler, which shifts them and appends 0.
    flux = FlowMatchEulerDiscreteScheduler(shift=1.8776105792643432)
    flux.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6))
    uniform = sigma_schedule(6, 1.8776105792643432, "uniform")
    torch.testing.assert_close(uniform, flux.sigmas.double(), rtol=0, atol=1e-6)
    # FLUX.1-dev at 512 px, 6 steps (FlowGRPO): f(s) = 1.8776 s / (1 + 0.8776 s) at s = 1, 5/6, ..., 1/6, 0.
    torch.testing.assert_close(
        uniform,
        torch.tensor([1.0, 0.903736, 0.789705, 0.652489, 0.484218, 0.273003, 0.0], dtype=torch.float64),
        rtol=0,
        atol=1e-6,
    )
    # DanceGRPO: sd3_time_shift(3, linspace(1, 0, 17)) in float32.
    t = torch.linspace(1, 0, 17)
    torch.testing.assert_close(sigma_schedule(16, 3.0, "uniform"), (3 * t / (1 + 2 * t)).double(), rtol=0, atol=0)
    unipc = UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    unipc.set_timesteps(20)
    torch.testing.assert_close(sigma_schedule(20, 3.0, "unipc"), unipc.sigmas.double(), rtol=0, atol=0)
    for grid in SIGMA_GRIDS:
        s = sigma_schedule(7, 2.0, grid)
        assert len(s) == 8 and s[-1] == 0 and (s[1:] < s[:-1]).all() and s[0] > 0.999, grid
    with pytest.raises(ValueError, match="grid"):
        sigma_schedule(4, 3.0, "karras")


def test_config_validates_the_grid():
    from lean.config import ConfigError
    from lean.configure import load_config

    with pytest.raises(ConfigError, match="sample.sigma_grid.*must be one of euler, uniform, unipc"):
        load_config(None, ["sample.sigma_grid=karras"])
    with pytest.raises(ConfigError, match="sample.sigma_grid.*flow_grpo_linear"):
        load_config(None, ["sample.sigma_grid=unipc"])  # flow_grpo's sqrt(σ/(1−σ)) at σ = 1 − 1e-6
    load_config(None, ["sample.sigma_grid=unipc", "sample.sde_kind=flow_grpo_linear"])
