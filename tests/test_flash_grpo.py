"""Flash-GRPO (lean/algorithms/flash_grpo.py): its rectification weight is the script's table, its loss the script's
(written here in float64 from Shredded-Pork/Flash-GRPO at 8cfc973, train_wanx2_1_flash.py:976-1003 and
wan2_1_pipeline_with_logprob2.py:41-81), one drawn SDE step per rollout, its schedules certified, its preset cited."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import preset_value_lines, reference_gap, tiny, uncited

from lean.algorithms import build_algorithm
from lean.algorithms.flash_grpo import FlashGRPO, rectification
from lean.config import ConfigError
from lean.configure import load_config
from lean.sampling.sde import Sde, sde_step_with_logprob
from lean.sampling.transition import Transition
from lean.tools.equivalence import run_equivalence

FLASH = ["algorithm.name=flash_grpo", "model.dtype=float64"]
# train_wanx2_1_flash.py:984: timestep -> coe on Wan's 20-step grid (the first 10 steps, the drawable ones)
SCRIPT_TABLE = {
    999: 7.4770,
    982: 7.0414,
    963: 6.6112,
    944: 6.1867,
    922: 5.7682,
    899: 5.3559,
    874: 4.9502,
    847: 4.5513,
    817: 4.1596,
    785: 3.7754,
}


def script_grid(num_steps: int = 20, shift: float = 3.0) -> torch.Tensor:
    """UniPCMultistepScheduler's flow sigmas as diffusers 0.33.1 (the source's setup.py:14) sets them: the shifted
    1 - linspace(1, 1/1000, n + 1), descending, without the 0 it starts from, then a final 0."""
    s = 1 - np.linspace(1, 1 / 1000, num_steps + 1)
    s = np.flip(shift * s / (1 + (shift - 1) * s))[:-1]
    return torch.tensor(np.append(s, 0.0), dtype=torch.float64)


def script_step(v, x, sigmas, j, x_next=None):
    """logprob2.py:41-81 (sample.py's is the same): the SDE step at the rows' steps ``j`` [B], its log-prob, mean,
    std_dev_t, sqrt(-dt) and coe."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    sigma, sigma_prev = sigmas[j].view(shape), sigmas[j + 1].view(shape)
    sigma_max, sigma_min = sigmas[1], sigmas[-1]
    dt = sigma_prev - sigma
    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if x_next is None:
        x_next = mean + std_dev_t * torch.sqrt(-dt) * torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    log_prob = (
        -((x_next.detach() - mean) ** 2) / (2 * (std_dev_t * torch.sqrt(-dt)) ** 2)
        - torch.log(std_dev_t * torch.sqrt(-dt))
        - math.log(math.sqrt(2 * math.pi))
    ).mean(dim=tuple(range(1, x.ndim)))
    coe = 1 / (torch.sqrt(-dt) / std_dev_t + (std_dev_t * torch.sqrt(-dt) * (1 - sigma)) / (2 * sigma))
    return x_next, log_prob, mean, std_dev_t, torch.sqrt(-dt), coe.flatten()


def script_loss(step, old_log_prob, ref_mean, advantages, clip_range, beta):
    """train_wanx2_1_flash.py:976-1003 per sample (before its torch.mean), on ``step`` = :func:`script_step`'s
    return: value_tensor = coe at each row's step and w = 1 / mean(value_tensor) (:990, over the batch: here every
    drawable step once, where it equals lean's expectation over the draw)."""
    _, log_prob, mean, std_dev_t, sqrt_dt, coe = step
    advantages = torch.clamp(advantages, -5, 5)
    ratio = torch.exp(log_prob - old_log_prob)
    w = 1 / coe.mean()
    unclipped = -w * coe * advantages * ratio
    clipped = -w * coe * advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    kl = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * (std_dev_t * sqrt_dt).flatten() ** 2)
    return torch.maximum(unclipped, clipped) + beta * kl


def test_the_rectification_is_the_scripts_table():
    sigmas = script_grid()
    timesteps = [int(t) for t in (sigmas[:10] * 1000).float()]  # UniPC's timesteps, as the script keys its table
    assert timesteps == list(SCRIPT_TABLE)
    coe = rectification(Sde("flow_grpo_linear", 1.0, sigmas))[:10]
    torch.testing.assert_close(coe, torch.tensor(list(SCRIPT_TABLE.values()), dtype=torch.float64), atol=6e-5, rtol=0)
    # and the closed form of logprob2.py:81 on every step but the last
    j = torch.arange(19)
    *_, coe_script = script_step(torch.zeros(19, 1), torch.zeros(19, 1), sigmas, j)
    torch.testing.assert_close(rectification(Sde("flow_grpo_linear", 1.0, sigmas)), coe_script, rtol=1e-14, atol=0)


def test_off_policy_the_loss_and_its_gradient_are_the_scripts():
    sigmas = script_grid()
    sets = [*FLASH, "sample.num_steps=20", "sample.sde_kind=flow_grpo_linear", "sample.noise_level=1.0"]
    algorithm = build_algorithm(tiny(*sets, "algorithm.beta=0.001", "algorithm.clip_range=1e-3"), sigmas)
    g = torch.Generator().manual_seed(0)
    j = torch.arange(10)  # one row at every drawable step
    x = torch.randn(10, 4, 2, 4, 4, generator=g, dtype=torch.float64)
    v_old = torch.randn(x.shape, generator=g, dtype=torch.float64)
    v_ref = v_old + 0.1 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    # rows moved by different amounts: some ratios stay inside the clip, some leave it
    scale = torch.tensor([1e-5, 0.3] * 5, dtype=torch.float64).view(-1, 1, 1, 1, 1)
    v = (v_old + scale * torch.randn(x.shape, generator=g, dtype=torch.float64)).requires_grad_()
    advantages = torch.linspace(-4.5, 4.5, 10, dtype=torch.float64)
    x_next, log_p_old, *_ = script_step(v_old, x, sigmas, j)
    _, _, mean_ref, *_ = script_step(v_ref, x, sigmas, j, x_next)
    want = script_loss(script_step(v, x, sigmas, j, x_next), log_p_old, mean_ref, advantages, 1e-3, 0.001)

    sde = Sde("flow_grpo_linear", 1.0, sigmas)
    _, lean_log_p, lean_mean, std = sde_step_with_logprob(sde, v, x, j, prev_sample=x_next)
    step = Transition(index=j, sample=x, next_sample=x_next, log_prob=lean_log_p, mean=lean_mean, std=std)
    loss = algorithm.step_loss(
        Transition(**{**step.__dict__, "old_log_prob": log_p_old, "ref_mean": mean_ref}), advantages
    )
    clipped = (loss.ratio - 1).abs() > 1e-3
    assert 0 < clipped.sum() < 10  # the clip binds on some rows, not all
    got = loss.total(algorithm.kl_weight)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    (grad,) = torch.autograd.grad(got.sum(), v, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want.sum(), v)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-18)


def test_each_rollout_trains_one_drawn_step_shared_by_every_sample():
    cfg = tiny(*FLASH, "sample.num_steps=20")
    seen = set()
    for iteration in range(200):
        selection = FlashGRPO.steps(cfg, iteration, 6)
        (step,) = selection.stochastic.nonzero().flatten().tolist()  # one SDE step, the others ODE steps
        assert selection.trained.sum() == 6 and selection.trained[:, step].all()
        assert torch.equal(FlashGRPO.steps(cfg, iteration, 6).stochastic, selection.stochastic)  # every process's
        seen.add(step)
    assert seen == set(range(10))  # uniform over the first 10 (the script :697)
    short = tiny(*FLASH)  # 4 steps: the draw stays before the last one
    assert {int(FlashGRPO.steps(short, i, 2).stochastic.nonzero()) for i in range(60)} == {0, 1, 2}


@pytest.mark.timeout(180)
def test_in_float64_every_schedule_is_the_reference_with_the_kl_and_a_later_update():
    cfg = tiny(
        *FLASH,
        "model.family=wan",
        "algorithm.beta=0.001",
        "train.train_batch_size=2",
        "train.optimizer_steps_per_iteration=2",
    )
    report = run_equivalence(cfg)
    assert set(report["reference"]) == {"recompute", "retain", "reweight"}
    assert reference_gap(report) < 1e-10


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["sample.sde_window=1"], r"sample\.sde_window"),
        (["sample.sde_kind=cps"], r"sample\.sde_kind"),
        (["algorithm.flash_grpo.steps=0"], r"algorithm\.flash_grpo\.steps"),
    ],
)
def test_what_it_cannot_run_is_one_config_line(sets, key):
    with pytest.raises(ConfigError, match=key):
        tiny(*FLASH, *sets)


def test_the_preset_cites_every_value_and_is_the_published_recipe():
    values = preset_value_lines("flashgrpo-wan")
    assert len(values) >= 40
    assert not uncited(values, "sde_window_max_start: null")
    cfg = load_config(None, [], preset="flashgrpo-wan")
    published = {  # config/dgx.py:wan2_1_flash and the script at 8cfc973
        ("model", "family"): "wan",
        ("model", "resolution"): 480,
        ("model", "width"): 832,
        ("model", "num_frames"): 81,
        ("model", "lora_rank"): 16,
        ("sample", "num_steps"): 20,
        ("sample", "sde_kind"): "flow_grpo_linear",
        ("sample", "guidance_scale"): 4.5,
        ("algorithm", "name"): "flash_grpo",
        ("algorithm", "clip_range"): 1e-3,
        ("algorithm", "beta"): 0.001,
        ("algorithm", "global_std"): True,
        ("train", "group_size"): 8,
        ("optimizer", "lr"): 1e-4,
    }
    for (section, key), value in published.items():
        assert getattr(getattr(cfg, section), key) == value, (section, key)
    assert cfg.algorithm.flash_grpo.steps == 10
