"""TempFlow-GRPO (lean/algorithms/tempflow_grpo.py): its noise weights are the scripts' constants, its advantages the
tracker's, its loss the script's (written here in float64 from Shredded-Pork/TempFlow-GRPO at e66824e:
scripts/train_sd3_pr.py's training loop, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py's step, and
yifan123/flow_grpo at ac4c86e flow_grpo/stat_tracking.py:11-31), a group's branches leave one trunk at the iteration's
step, its schedules certified, its preset cited. Its training on flux, sd3 and wan: tests/test_algorithms.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import preset_value_lines, reference_gap, tiny, uncited

from lean.algorithms import build_algorithm
from lean.algorithms.tempflow_grpo import TempFlowGRPO, branch_steps, noise_weights, transition_stds
from lean.config import ConfigError
from lean.configure import load_config
from lean.sampling.sde import Sde, sde_step_with_logprob, sigma_schedule
from lean.sampling.transition import Transition
from lean.tools.equivalence import run_equivalence

TEMPFLOW = ["algorithm.name=tempflow_grpo", "sample.init_same_noise=true"]


def script_step(v, x, sigmas, j, level, x_next=None):
    """sd3_sde_with_logprob.py's step at the rows' steps ``j`` [B]: (x_next, log-prob, mean, std), std the returned
    std_dev_t x sqrt(-dt); s = level sqrt(sigma / (1 - sigma)), sigma_max = sigmas[1] where sigma = 1."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    sigma, sigma_prev = sigmas[j].view(shape), sigmas[j + 1].view(shape)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma))) * level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if x_next is None:
        x_next = mean + std_dev_t * torch.sqrt(-dt) * torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    std = std_dev_t * torch.sqrt(-dt)
    log_prob = (-((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))).mean(
        dim=tuple(range(1, x.ndim))
    )
    return x_next, log_prob, mean, std


def script_loss(step, old_log_prob, ref_mean, advantages, constant, clip_range, beta):
    """train_sd3_pr.py's per-row loss (before its torch.mean): ``constant`` x std_dev_t on the clipped surrogate
    (2.25 in the script), the KL over std_dev_t^2 unweighted."""
    _, log_prob, mean, std = step
    advantages = torch.clamp(advantages, -5, 5)
    ratio = torch.exp(log_prob - old_log_prob)
    w = constant * std.flatten()
    clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    policy = torch.maximum(-w * advantages * ratio, -w * advantages * clipped)
    kl = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * std.flatten() ** 2)
    return policy + beta * kl


def tracker_advantages(prompts, rewards):
    """stat_tracking.py:11-31 (global_std False), on rewards [rows, steps]: per prompt, each column against its
    mean and np.std + 1e-4."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    for prompt in np.unique(prompts):
        group = rewards[prompts == prompt]
        advantages[prompts == prompt] = (group - group.mean(axis=0, keepdims=True)) / (
            group.std(axis=0, keepdims=True) + 1e-4
        )
    return advantages


def test_the_noise_weights_are_the_scripts_constants():
    """2.25 (train_sd3_pr.py) and 1.73 (train_flux_pr.py at 28a9b9b) are 1 / mean of std_dev_t sqrt(-dt) over the 9
    trained steps of 10: SD3.5's shift-3 grid at noise 0.7, FLUX's 1024 px grid (mu = 1.15) at 0.9."""
    sd3 = sigma_schedule(10, 3.0, "euler")
    j = torch.arange(9)
    *_, std = script_step(torch.zeros(9, 1), torch.zeros(9, 1), sd3, j, 0.7)
    assert 1 / std.mean().item() == pytest.approx(2.25, abs=3e-3)
    torch.testing.assert_close(transition_stds(Sde("flow_grpo", 0.7, sd3)), std.flatten(), rtol=1e-14, atol=0)
    weights = noise_weights(Sde("flow_grpo", 0.7, sd3), 9)
    torch.testing.assert_close(weights, std.flatten() / std.mean(), rtol=1e-14, atol=0)
    assert weights.argmax() == 1 and weights[-1] < 0.51  # early steps weigh more (sigma_max at step 0)
    flux = sigma_schedule(10, math.exp(1.15), "uniform")
    *_, std = script_step(torch.zeros(9, 1), torch.zeros(9, 1), flux, j, 0.9)
    assert 1 / std.mean().item() == pytest.approx(1.73, abs=5e-3)  # 1.7260


def test_the_advantages_are_the_trackers_per_branch_group():
    """One process's rows: two trunks (groups) of 6 branches at one step; lean's group advantage is the tracker's
    column at that step."""
    cfg = load_config(None, ["model.size=tiny"], preset="tempflowgrpo-sd3")
    algorithm = build_algorithm(cfg, None)
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=g, dtype=torch.float64)
    rewards[6:9] = 0.5  # a tied part of the second group
    groups = torch.arange(2).repeat_interleave(6)
    want = tracker_advantages(["a"] * 6 + ["b"] * 6, rewards[:, None].numpy())[:, 0]
    torch.testing.assert_close(algorithm.targets(rewards, groups), torch.tensor(want), rtol=1e-14, atol=1e-15)


def test_off_policy_the_loss_and_its_gradient_are_the_scripts():
    sigmas = sigma_schedule(10, 3.0, "euler")
    sets = [*TEMPFLOW, "model.dtype=float64", "sample.num_steps=10", "sample.noise_level=0.7", "sample.cfg=false"]
    sets += ["algorithm.beta=0.001", "algorithm.kl_form=exact", "algorithm.clip_range=1e-4"]
    algorithm = build_algorithm(tiny(*sets), sigmas)
    g = torch.Generator().manual_seed(0)
    j = torch.arange(9).repeat(2)[:12]  # rows at every trained step
    x = torch.randn(12, 4, 2, 4, generator=g, dtype=torch.float64)
    v_old = torch.randn(x.shape, generator=g, dtype=torch.float64)
    v_ref = v_old + 0.1 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    scale = torch.tensor([1e-7, 0.3] * 6, dtype=torch.float64).view(-1, 1, 1, 1)  # some ratios leave the clip
    v = (v_old + scale * torch.randn(x.shape, generator=g, dtype=torch.float64)).requires_grad_()
    advantages = torch.linspace(-6, 6, 12, dtype=torch.float64)
    x_next, log_p_old, *_ = script_step(v_old, x, sigmas, j, 0.7)
    _, _, mean_ref, _ = script_step(v_ref, x, sigmas, j, 0.7, x_next)
    *_, std = script_step(torch.zeros(9, 1), torch.zeros(9, 1), sigmas, torch.arange(9), 0.7)
    constant = 1 / std.mean()  # the script's 2.25, unrounded (the preset's header)
    step = script_step(v, x, sigmas, j, 0.7, x_next)
    want = script_loss(step, log_p_old, mean_ref, advantages, constant, 1e-4, 0.001)

    _, log_p, mean, lean_std = sde_step_with_logprob(Sde("flow_grpo", 0.7, sigmas), v, x, j, prev_sample=x_next)
    transition = Transition(index=j, sample=x, next_sample=x_next, log_prob=log_p, mean=mean, std=lean_std)
    transition = Transition(**{**transition.__dict__, "old_log_prob": log_p_old, "ref_mean": mean_ref})
    loss = algorithm.step_loss(transition, advantages.clamp(-5, 5))
    assert 0 < ((loss.ratio - 1).abs() > 1e-4).sum() < 12  # the clip binds on some rows, not all
    got = loss.total(algorithm.kl_weight)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    (grad,) = torch.autograd.grad(got.sum(), v, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want.sum(), v)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-18)


def test_each_rollout_branches_at_one_step_in_turn():
    cfg = tiny(*TEMPFLOW, "sample.num_steps=10")
    assert branch_steps(cfg.sample) == 9  # int(10 x 0.99), the scripts' num_train_timesteps
    for iteration in range(20):
        selection = TempFlowGRPO.steps(cfg, iteration, 6)
        (step,) = selection.stochastic.nonzero().flatten().tolist()  # one SDE step, the others ODE steps
        assert step == iteration % 9 and selection.trained.sum() == 6 and selection.trained[:, step].all()


@pytest.mark.timeout(60)
def test_a_groups_branches_leave_one_trunk_at_the_iterations_step():
    """The ODE steps before k give a group one x_k; its samples draw their own noise at k (the branches)."""
    from lean.schedules import SCHEDULES
    from lean.tools.equivalence import StepRecorder
    from lean.train import Trainer

    cfg = tiny(*TEMPFLOW, "sample.cfg=false")
    pipeline = Trainer(cfg).pipeline
    recorder = StepRecorder()
    rolled = pipeline.roll_out(2, SCHEDULES["recompute"], on_step=recorder)
    assert {s.index for s in recorder.steps} == {2 % branch_steps(cfg.sample)}  # the iteration's step, alone
    step = recorder.steps[0]
    groups = rolled.batch.group_ids()[rolled.batch.local]
    assert groups[0] == groups[1] != groups[2]
    assert torch.equal(step.sample[0], step.sample[1]) and not torch.equal(step.sample[0], step.sample[2])
    assert not torch.equal(step.next_sample[0], step.next_sample[1])


@pytest.mark.timeout(120)
def test_in_float64_every_schedule_is_the_reference_with_the_kl_and_a_later_update():
    cfg = tiny(
        *TEMPFLOW,
        "model.dtype=float64",
        "model.family=sd3",
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
        (["sample.init_same_noise=false"], r"sample\.init_same_noise.*sample\.init_same_noise=true"),
    ],
)
def test_what_it_cannot_run_is_one_config_line(sets, key):
    with pytest.raises(ConfigError, match=key) as err:
        tiny(*TEMPFLOW, *sets)
    assert "\n" not in str(err.value)


def test_the_preset_cites_every_value_and_is_the_published_recipe():
    values = preset_value_lines("tempflowgrpo-sd3")
    assert len(values) >= 40
    assert not uncited(values, "sde_window_max_start: null")
    cfg = load_config(None, [], preset="tempflowgrpo-sd3")
    published = {  # config/dgx.py:pickscore_sd3_pr at 63e4def, the script at e66824e, base.py
        ("model", "family"): "sd3",
        ("model", "resolution"): 512,
        ("model", "lora_rank"): 32,
        ("sample", "num_steps"): 10,
        ("sample", "sde_kind"): "flow_grpo",
        ("sample", "noise_level"): 0.7,
        ("sample", "guidance_scale"): 4.5,
        ("sample", "init_same_noise"): True,
        ("algorithm", "name"): "tempflow_grpo",
        ("algorithm", "clip_range"): 1e-4,
        ("algorithm", "beta"): 0.001,
        ("algorithm", "global_std"): False,
        ("train", "group_size"): 6,
        ("optimizer", "lr"): 3e-4,
    }
    for (section, key), value in published.items():
        assert getattr(getattr(cfg, section), key) == value, (section, key)
    assert branch_steps(cfg.sample) == 9


@pytest.mark.timeout(120)
def test_lean_plan_on_the_preset_counts_the_published_size(tmp_path):
    """The published size, counted on the meta device (the rows on GPUs: tests/test_layout.py's published recipes)."""
    from lean.plan.cost import main as plan

    report = plan(load_config(None, [], preset="tempflowgrpo-sd3"), out=str(tmp_path))["published_size"]
    assert report["transformer_parameters"] == pytest.approx(2.243e9, rel=1e-3)  # SD3.5-Medium's transformer
