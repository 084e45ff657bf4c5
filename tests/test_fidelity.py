"""Each preset optimises its source's objective: one Recompute update on fixed tensors against the published formula.

For every preset, lean's own update (``Recompute.finish`` through ``Policy.velocity``'s CFG, the SDE step's log-prob,
the KL in ``algorithm.kl_form``, the group advantages and the per-term weights) runs on a toy velocity field with one
trainable tensor theta. The test then writes the published objective itself, from the formulas of the preset's
source (cited per term below), on the same x_j, x_{j+1}, rewards and theta, and compares loss and gradient: to 1e-6 in
float32 and 1e-12 in float64. The formulas are re-derived here, not imported from lean.

Sources (yifan123/flow_grpo at 879042c, whose loss, KL and advantage code the indexed copy at 74db691 shares;
XueZeyue/DanceGRPO at 15cc71d):
  F1  flow_grpo/diffusers_patch/sd3_sde_with_logprob.py  sde_step_with_logprob: the "sde" and "cps" steps, log-probs
  F2  scripts/train_sd3.py, train_flux.py  compute_log_prob (CFG) and the loss: policy + beta kl, kl over std_dev_t^2
  F3  scripts/train_wan2_1.py  the KL over (std_dev_t sqrt(-dt))^2; its SDE with std_dev_t linear in sigma
  F4  flow_grpo/stat_tracking.py  PerPromptStatTracker: (r - mean) / (np.std + 1e-4), per prompt or global
  F5  flow_grpo/rewards.py  jpeg_compressibility = -kB / 500
  D1  fastvideo/train_grpo_flux_lora.py (as train_grpo_flux.py)  flux_step, the dance SDE (:69-108); use_group
      advantages, torch's std + 1e-8 (:477-490); the clamped advantage and clipped loss (:533-547)
  G1  scripts/train_sd3_GRPO_Guard.py (flow_grpo 2e2f712, GRPO-Guard)  RatioNorm (:915-919, its shift averaged over
      the micro-batch and the latent), the clipped loss divided by -dt (:931-932), the KL added after (:934-937)
  M1  Tencent-Hunyuan/MixGRPO e5cdd6a fastvideo/train_grpo_flux.py:429-456  advantage_aggr: each reward's use_group
      advantage (torch's unbiased std + 1e-8), weighted and summed
  X1  X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/advantage/advantage_processor.py:451-470 (GDPO): each reward's
      (r - mean) / max(np.std, 1e-6) per group, weighted, summed, then (c - mean) / max(np.std, 1e-6) over the batch
  R1  CodeGoat24/Pref-GRPO 3e787f6 fastvideo/train_flux.py:729-756 (RatioNorm as G1, its shift averaged over each
      sample's latent, one sample per forward), fastvideo/rewards/dispatcher.py:614-703 (GDPO: each reward's
      (r - mean) / (torch's unbiased std + 1e-8) per group, weighted, summed, then the same over the batch)
  Q1  flow_grpo 9745241 (zhtmike mirror) qwenimage_pipeline_with_logprob.py:138-141  random.seed(process_index), then
      the window start randint(0, num_steps // 2 - window); train_qwenimage.py:657-669 passes no process_index
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

from lean.algorithms import ALGORITHMS, CLEAN_SAMPLES, build_algorithm
from lean.config.presets import PRESETS
from lean.configure import load_config
from lean.models import Guidance, family_spec
from lean.models.policy import Policy
from lean.models.text import PromptEmbeds
from lean.rewards import REWARDS
from lean.sampling.sde import StepSelection, sigma_schedule
from lean.sampling.transition import Transition
from lean.schedules.base import IterationContext
from lean.schedules.recompute import Recompute

SHAPE = (2, 3, 4)  # per-sample latent
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])  # three prompts x three samples; the third scores a constant
TOY_REWARDS = torch.tensor([0.61, 0.55, 0.58, 0.20, 0.31, 0.22, 0.50, 0.50, 0.50], dtype=torch.float64)
# F2b: train_sd3.py:801-821, train_sd3_fast.py:806-826, train_wan2_1.py:846-869 drop the samples whose advantage is 0
# before the update (train_flux.py does not); DanceGRPO does not. The constant is exact in binary: a mean with a
# rounding residue would leave the published advantage at ~1e-12 instead of 0, and the sample in.
DROPS_ZERO_ADVANTAGE = {"flowgrpo-sd3", "flowgrpo-fast", "flowgrpo-wan", "grpo-guard-sd3"}  # + G1 :825-846
DROPS_ZERO_ADVANTAGE |= {"flowgrpo-kontext"}  # train_flux_kontext.py:765-786 at 9745241, as train_sd3.py:801-822
DROPS_ZERO_ADVANTAGE |= {"flowgrpo-ocr-sd3"}  # train_sd3.py:796-817 at ac4c86e: flowgrpo-sd3 on the OCR task
MIXGRPO = {"mixgrpo-flux", "mixgrpo-flash-flux"}  # M1: each reward normalised in its group, then summed
GDPO = {"flowfactory-grpo-flux2", "flowfactory-grpo-flux2-klein", "flowfactory-grpo-wan22", "flowfactory-grpo-z-image"}
GDPO |= {"flowfactory-grpo-wan21-i2v", "flowfactory-grpo-wan22-i2v"}  # wan2{1,2}/i2v.yaml advantage_aggregation
GDPO |= {"flowfactory-grpo-ltx2"}  # ltx2/t2av_pickscore.yaml:44 at a0b2bc5
# D1: torch's unbiased group std + 1e-8 (DanceGRPO, and MixGRPO's fork of it: train_grpo_flux.py:436-449); neither
# has a KL term in its recipes (MixGRPO's kl_coeff 0 weighs a squared log-ratio, not GRPO's KL)
DANCE_FAMILY = {"dancegrpo-flux", "mixgrpo-flux", "mixgrpo-flash-flux"}
# E1: shengjun-zhang/VisualGRPO ae619bf (E-GRPO) fastvideo/workers/rollout_buffer.py:115-124, each group's torch std
# + 1e-8; flux_sampler.py:162-191 FlowGRPO's SDE (F1); grpo_trainer.py:241-256 the clamped, clipped loss, no KL
DANCE_FAMILY |= {"egrpo-flux"}
PREF_GDPO = {"prefgrpo-flux"}  # R1: Pref-GRPO's GDPO and its per-sample RatioNorm
UNIRL = {"unirl-grpo-hunyuan-video15"}  # UniRL's FlowGRPO (Tencent-Hunyuan/UniRL 1a7b501)
FLOW_DPPO = {"unirl-flow-dppo-sd3"}  # P1: UniRL's Flow-DPPO (flowdppo.py at 1a7b501), no KL to a reference
UNIRL |= FLOW_DPPO  # its advantages are UniRL's (rollout_resp.py:318-325)
# the presets whose update trains on the rollout's steps: the ones this file's published GRPO objective covers (NFT
# and DPO train on re-noised clean samples: their float64 formulas are tests/test_clean_samples.py's)
# (BranchGRPO's tree recipe has a target per edge, not per sample: its certificate is tests/test_tree.py's; Flash-GRPO
# weighs its one step by the temporal rectification: its float64 transcription is tests/test_flash_grpo.py's; GARDO's
# diversity-weighted advantages without a std and its gated KL: tests/test_gardo.py's; TempFlow-GRPO weighs its branch
# step by its noise level: tests/test_tempflow_grpo.py's)
OWN_OBJECTIVE = {"flash_grpo", "gardo", "tempflow_grpo"}
STEP_PRESETS = [
    p
    for p in PRESETS
    if ALGORITHMS[load_config(preset=p).algorithm.name].trains_on != CLEAN_SAMPLES
    and not ALGORITHMS[load_config(preset=p).algorithm.name].trains_trees
    and load_config(preset=p).algorithm.name not in OWN_OBJECTIVE
]
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


class ToyPolicy(Policy):
    """A velocity field with one trainable tensor theta and lean's own CFG code (``Policy.velocity``):
    v_cond = theta * x + theta^2 * c, v_uncond = theta * x (both depend on theta, so a detached branch shows);
    the reference (adapter off) uses theta_ref."""

    def __init__(self, theta: torch.Tensor, theta_ref: torch.Tensor, c: torch.Tensor):
        torch.nn.Module.__init__(self)
        self.theta = torch.nn.Parameter(theta.clone())
        self.theta_ref, self.c = theta_ref, c
        self.dtype, self.device, self._use_reference = theta.dtype, theta.device, False
        self.cfg_renorm = False  # plain CFG (a family flag of lean's Policy)
        self.negative_prompt = ""  # CFG against the empty prompt
        self.boundary = None  # one velocity field: sample.guidance_scale_2 (a second expert's scale) does not apply

    def encode_prompts(self, prompts):
        """Token 1 for a prompt, 0 for the empty (unconditional) one."""
        flags = torch.tensor([[[0.0 if p == "" else 1.0]] for p in prompts], dtype=self.dtype)
        return PromptEmbeds(flags)

    def trainable_parameters(self):
        return [("theta", self.theta)]

    @contextlib.contextmanager
    def reference(self):
        self._use_reference = True
        try:
            yield
        finally:
            self._use_reference = False

    def _forward(self, x, sigma, emb, guidance_embed):
        theta = self.theta_ref if self._use_reference else self.theta
        cond = emb.tokens.reshape(-1, *([1] * (x.ndim - 1)))
        return theta * x + cond * theta**2 * self.c


# ---------------------------------------------------------------- the published formulas, written out


def published_velocity(theta, x, c, cfg):
    """F2: v = v_u + g (v_c - v_u) from one [uncond, cond] forward; D1 / FLUX: the conditional forward alone."""
    v_cond = theta * x + theta**2 * c
    if not cfg.cfg:
        return v_cond
    v_uncond = theta * x
    if not cfg.uncond_grad:
        v_uncond = v_uncond.detach()
    return v_uncond + cfg.guidance_scale * (v_cond - v_uncond)


def published_step(v, x, x_next, sigmas, j, cfg):
    """(mean, log p, the std the source's KL divides by) of step j: F1 ("sde", "cps"), F3 (Wan), D1 (dance)."""
    sigma, sigma_next = sigmas[j], sigmas[j + 1]
    dt = sigma_next - sigma
    eta = cfg.noise_level
    dims = tuple(range(1, x.ndim))
    if cfg.sde_kind in ("flow_grpo", "flow_grpo_linear"):
        if cfg.sde_kind == "flow_grpo":  # F1: eta sqrt(sigma / (1 - sigma)), sigmas[1] in place of sigma = 1
            scale = eta * torch.sqrt(sigma / (1 - (sigmas[1] if sigma == 1 else sigma)))
        else:  # F3: eta (sigma_min + (sigma_max - sigma_min) sigma), sigma_max = sigmas[1], sigma_min = sigmas[-1]
            scale = eta * (sigmas[-1] + (sigmas[1] - sigmas[-1]) * sigma)
        mean = x * (1 + scale**2 / (2 * sigma) * dt) + v * (1 + scale**2 * (1 - sigma) / (2 * sigma)) * dt
        std = scale * torch.sqrt(-dt)
        log_p = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
        return mean, log_p.mean(dim=dims), scale, std
    if cfg.sde_kind == "cps":  # F1 "cps": the returned std_dev_t is the transition's own std
        std = sigma_next * math.sin(eta * math.pi / 2)
        mean = (x - sigma * v) * (1 - sigma_next) + (x + (1 - sigma) * v) * torch.sqrt(sigma_next**2 - std**2)
        return mean, (-((x_next - mean) ** 2)).mean(dim=dims), std, std
    # D1 flux_step(sde_solver=True)
    x0 = x - sigma * v
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = x + dt * v + (-0.5 * eta**2 * score) * dt
    std = eta * torch.sqrt(-dt)
    log_p = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return mean, log_p.mean(dim=dims), std, std


def published_per_reward(rewards: np.ndarray, weights: list[float], groups: np.ndarray) -> np.ndarray:
    """M1: sum_k w_k (r_k - mean_g r_k) / (torch's unbiased std_g r_k + 1e-8), the groups in any order; ``rewards``
    [N, R] (float64: the script's float32 widened)."""
    merged = np.zeros(rewards.shape[0])
    for k, weight in enumerate(weights):
        advantages = np.zeros(rewards.shape[0])
        for g in np.unique(groups):
            r = rewards[groups == g, k]
            advantages[groups == g] += (r - r.mean()) / (torch.tensor(r).std().item() + 1e-8)
        merged += advantages * weight
    return merged


def published_gdpo(rewards: np.ndarray, weights: list[float], groups: np.ndarray) -> np.ndarray:
    """X1: c = sum_k w_k (r_k - mean_g r_k) / max(np.std_g r_k, 1e-6), then (c - mean c) / max(np.std c, 1e-6)."""
    per_reward = []
    for k, weight in enumerate(weights):
        advantages = np.zeros(rewards.shape[0])
        for g in np.unique(groups):
            r = rewards[groups == g, k]
            advantages[groups == g] = (r - np.mean(r)) / max(np.std(r), 1e-6)
        per_reward.append(advantages * weight)
    combined = np.sum(per_reward, axis=0)
    return (combined - np.mean(combined)) / max(float(np.std(combined)), 1e-6)


def published_advantages(rewards: np.ndarray, groups: np.ndarray, preset: str, global_std: bool) -> np.ndarray:
    """F4 (FlowGRPO): numpy's population std + 1e-4, per prompt or over the batch; D1 (DanceGRPO): torch's unbiased
    std + 1e-8 per group; U1 (UniRL rollout_resp.py:318-325): the group's mean, torch's unbiased std of the whole
    rollout + 1e-8; X1 (Flow-Factory's GDPO) and M1 (MixGRPO) of the one reward."""
    if preset in GDPO:
        return published_gdpo(rewards[:, None], [1.0], groups)
    if preset in PREF_GDPO:  # R1: the one reward's per_reward advantage, renormalised over the batch
        combined = torch.tensor(published_per_reward(rewards[:, None], [1.0], groups))
        return ((combined - combined.mean()) / (combined.std() + 1e-8)).numpy()
    if preset in MIXGRPO:
        return published_per_reward(rewards[:, None], [1.0], groups)
    out = np.empty_like(rewards)
    for g in np.unique(groups):
        r = rewards[groups == g]
        if preset in DANCE_FAMILY:
            out[groups == g] = (r - r.mean()) / (torch.tensor(r).std().item() + 1e-8)
        elif preset in UNIRL:
            out[groups == g] = (r - r.mean()) / (torch.tensor(rewards).std().item() + 1e-8)
        else:
            std = rewards.std() if global_std else r.std()
            out[groups == g] = (r - r.mean()) / (std + 1e-4)
    return out


def published_loss(theta, theta_ref, c, x, x_next, old_log_p, old_mean, advantages, sigmas, j, cfg, algorithm, preset):
    """F2 / D1: mean over the batch of max(-A r, -A clip(r)) (+ beta KL) with A clamped to +-adv_clip_max;
    the KL's denominator is the source's (F2: std_dev_t^2 before sqrt(-dt); F3: the transition's variance). F2b: the
    batch is the samples with A != 0 where the source filters. G1: GRPO-Guard's ratio and 1 / (-dt)."""
    if preset in DROPS_ZERO_ADVANTAGE:
        keep = advantages != 0
        x, x_next, old_log_p, advantages = x[keep], x_next[keep], old_log_p[keep], advantages[keep]
        old_mean = old_mean[keep]
    v = published_velocity(theta, x, c, cfg)
    mean, log_p, scale, std = published_step(v, x, x_next, sigmas, j, cfg)
    a = advantages.clamp(-algorithm.adv_clip_max, algorithm.adv_clip_max)
    ratio = torch.exp(log_p - old_log_p)
    if algorithm.name == "grpo_guard":  # G1 :915-919: the shift's .mean(dim=()) averages every dimension
        s = std.reshape(-1)[0]  # sqrt_dt.mean() * std_dev_t.mean(): the transition std
        shift = ((mean - old_mean) ** 2).mean()
        if preset in PREF_GDPO:  # R1 :736: each sample's own shift, over its latent
            shift = ((mean - old_mean) ** 2).mean(dim=tuple(range(1, x.ndim)))
        ratio = torch.exp((log_p - old_log_p + shift / (2 * s**2)) * s)
    policy = torch.maximum(-a * ratio, -a * ratio.clamp(1 - algorithm.clip_range, 1 + algorithm.clip_range)).mean()
    if algorithm.name == "flow_dppo":
        policy = published_flow_dppo(ratio, a, mean, old_mean, sigmas, j, cfg, algorithm.flow_dppo.kl_threshold)
    if algorithm.name == "grpo_guard":  # G1 :931-932: divided by sqrt_dt.mean()**2 = -dt
        policy = policy / (sigmas[j] - sigmas[j + 1])
    if algorithm.beta == 0:
        return policy
    with torch.no_grad():
        mean_ref = published_step(published_velocity(theta_ref, x, c, cfg), x, x_next, sigmas, j, cfg)[0]
    divisor = std if preset == "flowgrpo-wan" else scale  # F3 vs F2 (cps: both are the transition std)
    kl = (((mean - mean_ref) ** 2).mean(dim=tuple(range(1, x.ndim))) / (2 * divisor.reshape(-1) ** 2)).mean()
    return policy + algorithm.beta * kl


def published_flow_dppo(ratio, a, mean, old_mean, sigmas, j, cfg, threshold):
    """P1 flowdppo.py:86-111, :319: mean of -A r, zeroed where the KL mean((mu - mu_old)^2) / (2 sigma_t^2) on bf16
    means is not under the threshold and r moves the way A pushes; sigma_t = eta sqrt(s / (1 - min(s, 0.99)))
    sqrt(-dt) (:366-367, which differs from the rollout's std at s = 1 only: there the fixture's KLs are under the
    threshold in both normalisations)."""
    s, dt = sigmas[j], sigmas[j + 1] - sigmas[j]
    sigma_t = cfg.noise_level * torch.sqrt(s / (1 - s.clamp(max=0.99))) * torch.sqrt(-dt)
    # the replay hands both means back in trajectory_precision = bf16 (unirl/models/sd3/diffusion.py:496, the recipe's
    # :36), and :51 takes their difference and its square in it
    sq = ((mean.to(torch.bfloat16) - old_mean.to(torch.bfloat16)) ** 2).to(mean.dtype)
    kl = (sq / (2 * sigma_t**2)).mean(dim=tuple(range(1, mean.ndim)))
    removed = ~(kl < threshold) & (((ratio > 1.0) & (a > 0)) | ((ratio < 1.0) & (a < 0)))
    return torch.where(~removed.detach(), -a * ratio, torch.zeros(())).mean()


# ---------------------------------------------------------------- lean's update on the same tensors


def fixed_inputs(dtype: torch.dtype, j: int, cfg, sigmas):
    """theta (a policy a little off the rollout's), theta_ref, c, x_j, x_{j+1} sampled by the rollout's policy,
    its log-probs and its transition means."""
    g = torch.Generator().manual_seed(0)
    n = len(GROUPS)
    theta = (0.3 + 0.1 * torch.randn(SHAPE, generator=g)).to(dtype)
    theta_ref = (theta + 0.05 * torch.randn(SHAPE, generator=g).to(dtype)).to(dtype)
    theta_old = (theta + 2e-2 * torch.randn(SHAPE, generator=g).to(dtype)).to(dtype)  # off-policy: r != 1
    c = torch.randn(SHAPE, generator=g).to(dtype)
    x = torch.randn((n, *SHAPE), generator=g).to(dtype)
    with torch.no_grad():
        v_old = published_velocity(theta_old, x, c, cfg)
        mean, _, _, std = published_step(v_old, x, x, sigmas, j, cfg)
        x_next = mean + std.reshape(-1, *([1] * len(SHAPE))) * torch.randn((n, *SHAPE), generator=g).to(dtype)
        old_log_p = published_step(v_old, x, x_next, sigmas, j, cfg)[1]
    return theta, theta_ref, c, x, x_next, old_log_p, mean


def lean_update(policy, cfg, sigmas, x, x_next, old_log_p, old_mean, rewards, j):
    """One Recompute update that trains step j of every sample: (loss, theta's gradient)."""
    n = x.shape[0]
    trained = torch.zeros(n, cfg.sample.num_steps, dtype=torch.bool)
    trained[:, j] = True
    steps = StepSelection(stochastic=torch.ones(cfg.sample.num_steps, dtype=torch.bool), trained=trained)
    algorithm = build_algorithm(cfg, sigmas)
    emb = policy.encode_prompts(["p"] * n)
    ctx = IterationContext(policy=policy, cfg=cfg, algorithm=algorithm, sigmas=sigmas, emb=emb, steps=steps)
    schedule = Recompute(ctx)
    rollout_step = Transition(index=j, rows=slice(0, n), sample=x, next_sample=x_next)
    schedule.on_step(dataclasses.replace(rollout_step, old_log_prob=old_log_p, old_mean=old_mean))
    advantages = algorithm.targets(rewards, GROUPS, rewards[:, None]).to(x.dtype)  # one reward, weight 1
    stats = schedule.finish(advantages, lambda: {})
    loss = stats["policy_loss"] + cfg.algorithm.beta * stats.get("kl", 0.0)
    return loss, policy.theta.grad


def preset_config(preset: str, dtype: torch.dtype):
    """The preset's sampler and loss; one update over the toy batch (the update's split does not change the
    objective of one step), and a KL weight where the source has a KL at all."""
    cfg = load_config(preset=preset)
    no_kl = DANCE_FAMILY | FLOW_DPPO | PREF_GDPO  # DanceGRPO, MixGRPO, P1, R1 (its recipe's --kl_beta 0): no KL
    beta = cfg.algorithm.beta or (0.0 if preset in no_kl else 0.04)
    # R1: one sample per forward (its RatioNorm's shift is per sample, lean's per micro-batch)
    micro_batch = 1 if preset in PREF_GDPO else len(GROUPS)
    train = dataclasses.replace(
        cfg.train, optimizer_steps_per_iteration=1, train_batch_size=micro_batch, num_inner_epochs=1
    )
    algorithm = dataclasses.replace(cfg.algorithm, beta=beta)
    if preset in FLOW_DPPO:  # P1: a threshold the toy KLs on bf16 means straddle at j = 2 (6 of 9 above), so the mask
        # drops terms; at j = 0 all are under it in both normalisations (flowdppo.py:366's clamp makes the source's
        # 0.28 x lean's there; lean's largest is 3.4e-6)
        algorithm = dataclasses.replace(
            algorithm, flow_dppo=dataclasses.replace(algorithm.flow_dppo, kl_threshold=4e-6)
        )
    model = dataclasses.replace(cfg.model, dtype="float64" if dtype == torch.float64 else "float32")
    reward = cfg.reward
    if len(reward.weights) > 1:  # the toy batch has one reward: the preset's first, at weight 1
        reward = dataclasses.replace(reward, weights={next(iter(reward.weights)): 1.0})
    return dataclasses.replace(cfg, train=train, algorithm=algorithm, model=model, reward=reward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("j", [0, 2])
@pytest.mark.parametrize("preset", STEP_PRESETS)
def test_recompute_update_equals_published_objective(preset, j, dtype):
    cfg = preset_config(preset, dtype)
    sigmas = sigma_schedule(cfg.sample.num_steps, cfg.sample.shift or 3.0, cfg.sample.sigma_grid).to(
        dtype
    )  # null: the folder's (both sides share the grid)
    theta, theta_ref, c, x, x_next, old_log_p, old_mean = fixed_inputs(dtype, j, cfg.sample, sigmas)
    rewards = TOY_REWARDS
    policy = ToyPolicy(theta, theta_ref, c)
    lean_loss, lean_grad = lean_update(policy, cfg, sigmas, x, x_next, old_log_p, old_mean, rewards, j)

    advantages = published_advantages(rewards.numpy(), GROUPS.numpy(), preset, cfg.algorithm.global_std)
    theta_pub = theta.clone().requires_grad_(True)
    loss = published_loss(
        theta_pub,
        theta_ref,
        c,
        x,
        x_next,
        old_log_p,
        old_mean,
        torch.tensor(advantages, dtype=dtype),
        sigmas,
        j,
        cfg.sample,
        cfg.algorithm,
        preset,
    )
    loss.backward()
    tol = TOLERANCE[dtype]
    assert abs(lean_loss - loss.item()) <= tol * max(1.0, abs(loss.item()))
    torch.testing.assert_close(lean_grad, theta_pub.grad, rtol=tol, atol=tol * float(theta_pub.grad.abs().max()))


def test_the_fixture_exercises_each_term():
    """The check above can fail: the clip binds for some sample, the KL and the detached branch move the gradient."""
    cfg = preset_config("flowgrpo-sd3", torch.float64)
    sigmas = sigma_schedule(cfg.sample.num_steps, cfg.sample.shift or 3.0, cfg.sample.sigma_grid).double()
    theta, theta_ref, c, x, x_next, old_log_p, old_mean = fixed_inputs(torch.float64, 2, cfg.sample, sigmas)
    adv = torch.tensor(published_advantages(TOY_REWARDS.numpy(), GROUPS.numpy(), "", True))

    def grad(sample, algorithm):
        t = theta.clone().requires_grad_(True)
        published_loss(
            t, theta_ref, c, x, x_next, old_log_p, old_mean, adv, sigmas, 2, sample, algorithm, "flowgrpo-sd3"
        ).backward()
        return t.grad

    base = grad(cfg.sample, cfg.algorithm)
    assert not torch.allclose(base, grad(dataclasses.replace(cfg.sample, uncond_grad=False), cfg.algorithm))
    assert not torch.allclose(base, grad(cfg.sample, dataclasses.replace(cfg.algorithm, beta=0.0)))
    assert (adv == 0).sum() == 3  # the constant group: dropped where the source drops it
    log_p = published_step(published_velocity(theta, x, c, cfg.sample), x, x_next, sigmas, 2, cfg.sample)[1]
    ratio = torch.exp(log_p - old_log_p)
    assert ((ratio - 1).abs() > cfg.algorithm.clip_range).any()  # some terms are clipped


def test_kl_forms_differ_by_the_step_size():
    """algorithm.kl_form: flow_grpo divides by the noise scale s^2, exact by the transition variance s^2 |dt|."""
    from lean.algorithms.grpo import kl_step_weights

    sigmas = sigma_schedule(10, 3.0, "euler")
    w = kl_step_weights(sigmas, "flow_grpo", "flow_grpo")
    torch.testing.assert_close(w, sigmas[:-1] - sigmas[1:])
    assert (w < 0.3).all() and (w > 0).all()  # FlowGRPO's KL is 4x to 25x smaller per step than the exact one
    torch.testing.assert_close(kl_step_weights(sigmas, "flow_grpo", "exact"), torch.ones(10, dtype=torch.float64))
    torch.testing.assert_close(kl_step_weights(sigmas, "cps", "flow_grpo"), torch.ones(10, dtype=torch.float64))


def test_jpeg_compressibility_is_flow_grpos():
    """F5: -(size in kB of the quality-95 JPEG of the uint8 image) / 500."""
    g = torch.Generator().manual_seed(1)
    images = torch.rand((2, 3, 32, 32), generator=g)
    expected = []
    for image in images:
        array = (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        expected.append(-buffer.tell() / 1000 / 500)
    torch.testing.assert_close(
        REWARDS["jpeg_compressibility"](images, ["", ""]), torch.tensor(expected, dtype=torch.float64)
    )


# The published LoRA target lists (peft matches a name that equals a target or ends with "." + target).
PUBLISHED_TARGETS = {
    "flowgrpo-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 attn.to_q "
    "attn.to_v",  # train_sd3.py:419-428
    "flowgrpo-ocr-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # train_sd3.py:419-428 at ac4c86e
    "flowgrpo-fast": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # train_sd3_fast.py:424-433
    "flowgrpo-flux": "attn.to_k attn.to_q attn.to_v attn.to_out.0 attn.add_k_proj attn.add_q_proj attn.add_v_proj "
    "attn.to_add_out ff.net.0.proj ff.net.2 ff_context.net.0.proj ff_context.net.2",  # train_flux.py:411-424
    "flowgrpo-wan": "add_k_proj add_q_proj add_v_proj to_add_out to_k to_out.0 to_q to_v",  # train_wan2_1.py:451-460
    "dancegrpo-flux": "to_k to_q to_v to_out.0",  # DanceGRPO train_grpo_flux_lora.py:663
    "grpo-guard-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # train_sd3_GRPO_Guard.py:421-430
    "nft-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # DiffusionNFT train_nft_sd3.py:420-429
    "dpo-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # FlowGRPO train_sd3_dpo.py:389-398
    "flowgrpo-kontext": "attn.to_k attn.to_q attn.to_v attn.to_out.0 attn.add_k_proj attn.add_q_proj attn.add_v_proj "
    "attn.to_add_out ff.net.0.proj ff.net.2 ff_context.net.0.proj ff_context.net.2 proj_mlp",  # :411-425 at 9745241
    "flowgrpo-qwen-image": "attn.to_k attn.to_q attn.to_v attn.to_out.0 attn.add_k_proj attn.add_q_proj "
    "attn.add_v_proj attn.to_add_out img_mlp.net.0.proj img_mlp.net.2 txt_mlp.net.0.proj txt_mlp.net.2",  # :410-423
    "flowgrpo-qwen-image-edit": "attn.to_k attn.to_q attn.to_v attn.to_out.0 attn.add_k_proj attn.add_q_proj "
    "attn.add_v_proj attn.to_add_out img_mlp.net.0.proj img_mlp.net.2 txt_mlp.net.0.proj txt_mlp.net.2",  # :416-429
    "flowfactory-grpo-flux2": "attn.to_q attn.to_k attn.to_v attn.to_out.0 attn.add_q_proj attn.add_k_proj "
    "attn.add_v_proj attn.to_add_out attn.to_qkv_mlp_proj ff.linear_in ff.linear_out ff_context.linear_in "
    "ff_context.linear_out",  # Flow-Factory src/flow_factory/models/flux/flux2.py default_target_modules
    "flowfactory-grpo-flux2-klein": "attn.to_q attn.to_k attn.to_v attn.to_out.0 attn.add_q_proj attn.add_k_proj "
    "attn.add_v_proj attn.to_add_out attn.to_qkv_mlp_proj ff.linear_in ff.linear_out ff_context.linear_in "
    "ff_context.linear_out",  # Flow-Factory flux2_klein.py default_target_modules
    "flowfactory-grpo-z-image": "attention.to_k attention.to_q attention.to_v attention.to_out.0 feed_forward.w1 "
    "feed_forward.w2 feed_forward.w3",  # Flow-Factory src/flow_factory/models/z_image/z_image.py:69-75 at a0b2bc5
    "flowfactory-grpo-wan22": "attn1.to_q attn1.to_k attn1.to_v attn1.to_out.0 attn2.to_q attn2.to_k attn2.to_v "
    "attn2.to_out.0 ffn.net.0.proj ffn.net.2",  # Flow-Factory src/flow_factory/models/wan/wan2_t2v.py:74-85
    "flowfactory-grpo-wan21-i2v": "attn1.to_q attn1.to_k attn1.to_v attn1.to_out.0 attn2.to_q attn2.to_k attn2.to_v "
    "attn2.to_out.0 ffn.net.0.proj ffn.net.2",  # Flow-Factory src/flow_factory/models/wan/wan2_i2v.py:90-101
    "flowfactory-grpo-wan22-i2v": "attn1.to_q attn1.to_k attn1.to_v attn1.to_out.0 attn2.to_q attn2.to_k attn2.to_v "
    "attn2.to_out.0 ffn.net.0.proj ffn.net.2",  # wan2_i2v.py:90-101 (Flow-Factory: the high-noise expert only)
    "flowfactory-grpo-ltx2": " ".join(  # Flow-Factory src/flow_factory/models/ltx2/ltx2_t2av.py:175-218 at a0b2bc5
        [
            f"{a}.{p}"
            for a in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
            for p in ("to_q", "to_k", "to_v", "to_out.0")
        ]
        + ["ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]
    ),  # fmt: skip
    "unirl-flow-dppo-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # sd3_flowdppo.yaml:81-89
    "flashgrpo-wan": "add_k_proj add_q_proj add_v_proj to_add_out to_k to_out.0 to_q to_v",  # :457-466 at 8cfc973
    "awm-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # AWM train_sd3_awm.py:612-622 at 12b1397 (lora_type "attn")
    "gardo-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # FlowGRPO train_sd3_gardo.py:440-449 at 94e23ee
    "tempflowgrpo-sd3": "attn.add_k_proj attn.add_q_proj attn.add_v_proj attn.to_add_out attn.to_k attn.to_out.0 "
    "attn.to_q attn.to_v",  # TempFlow-GRPO train_sd3_pr.py's target_modules at e66824e
    "unirl-grpo-hunyuan-video15": "attn.to_q attn.to_k attn.to_v attn.to_out.0 attn.add_q_proj attn.add_k_proj "
    "attn.add_v_proj attn.to_add_out ff.net.0.proj ff.net.2 ff_context.net.0.proj ff_context.net.2",  # hv15.yaml:84-96
}
ADAPTED = [p for p in PRESETS if p in PUBLISHED_TARGETS]  # MixGRPO fine-tunes the whole transformer


def test_every_lora_preset_names_its_published_modules():
    assert {p for p in PRESETS if not load_config(preset=p).model.full_finetune} == set(ADAPTED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ADAPTED)
def test_lora_adapts_the_published_modules(preset):
    """Each preset's adapter sits on exactly the linear layers its source's target list names (tiny model), and
    starts as its source's does (FlowGRPO: gaussian A; DanceGRPO: peft's default)."""
    from lean.models import build_policy

    cfg = load_config(preset=preset)
    frames = family_spec(cfg.model.family).num_frames or 5  # LTX-2: 8k + 1
    model = dataclasses.replace(
        cfg.model, size="tiny", resolution=32, num_frames=frames, dtype="float32", text_max_length=8
    )
    policy = build_policy(model, ["a prompt"])
    targets = PUBLISHED_TARGETS[preset].split()
    for net in policy.denoisers:  # Wan2.2-A14B: both experts adapted alike
        adapted = {n.removesuffix(".lora_A.default") for n, _ in net.named_modules() if n.endswith("lora_A.default")}
        base = net.get_base_model()  # peft keeps an adapted Linear as <name>.base_layer
        linear = [n.removesuffix(".base_layer") for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
        published = {f"base_model.model.{n}" for n in linear if any(n == t or n.endswith("." + t) for t in targets)}
        assert adapted == published
        a = next(m.weight for n, m in net.named_modules() if n.endswith("lora_A.default"))
        gaussian = abs(a.std().item() - 1 / cfg.model.lora_rank) < 0.5 / cfg.model.lora_rank  # peft: N(0, 1/r)
        assert gaussian == (cfg.model.lora_init == "gaussian")


def test_trained_step_count_of_each_source():
    """FlowGRPO: int(N x fraction) (train_sd3.py:345); DanceGRPO: int((N - 1) x fraction) of the N - 1 kept steps
    (train_grpo_flux_lora.py:514 after the slice at :456)."""
    from lean.sampling.sde import num_trained_steps

    assert num_trained_steps(10, 0.99, "all") == 9 and num_trained_steps(6, 0.99, "all") == 5
    assert num_trained_steps(12, 0.6, "trainable") == 6 and num_trained_steps(12, 0.6, "all") == 7
    assert num_trained_steps(16, 0.6, "trainable") == 9


def test_truncated_timestep_reaches_the_model_only():
    """DanceGRPO feeds int(1000 sigma) / 1000 to the transformer (train_grpo_flux_lora.py:169)."""
    seen = []

    class Recording(ToyPolicy):
        def _forward(self, x, sigma, emb, guidance_embed):
            seen.append(sigma)
            return super()._forward(x, sigma, emb, guidance_embed)

    theta = torch.ones(SHAPE)
    policy = Recording(theta, theta, theta)
    x, emb = torch.zeros((2, *SHAPE)), policy.encode_prompts(["p", "p"])
    sigma = torch.tensor(0.91835, dtype=torch.float32)
    policy.velocity(x, sigma, emb, Guidance(truncate_timestep=True))
    policy.velocity(x, sigma, emb)
    assert seen[0][0].item() == pytest.approx(0.918, abs=1e-7) and seen[1][0].item() == sigma.item()


@pytest.mark.timeout(120)
def test_dance_rollout_shares_x0_and_decodes_the_prediction():
    """sample.init_same_noise: every sample of a group starts from one x_0 (groups differ), the SDE noise still
    differs; reward.decode=x0_prediction hands the decoder x_{N-1} - sigma_{N-1} v (train_grpo_flux_lora.py:192)."""
    from helpers import tiny

    from lean.schedules import SCHEDULES
    from lean.tools.equivalence import StepRecorder
    from lean.train import Trainer

    cfg = tiny("sample.init_same_noise=true", "reward.decode=x0_prediction", "sample.cfg=false")
    pipeline = Trainer(cfg).pipeline
    recorder = StepRecorder()
    rolled = pipeline.roll_out(0, SCHEDULES["recompute"], on_step=recorder)
    first = [s for s in recorder.steps if s.index == 0][0].sample
    groups = rolled.batch.group_ids()[rolled.batch.local]
    assert torch.equal(first[0], first[1]) and groups[0] == groups[1]
    assert not torch.equal(first[0], first[2]) and groups[0] != groups[2]
    after = [s for s in recorder.steps if s.index == 0][0].next_sample
    assert not torch.equal(after[0], after[1])  # the SDE noise is each sample's own
    last = cfg.sample.num_steps - 1
    x = [s for s in recorder.steps if s.index == last][0].sample
    with torch.no_grad():
        v = pipeline.policy.velocity(x, pipeline.sigmas[last], rolled.ctx.emb)
    torch.testing.assert_close(rolled.final, (x - pipeline.sigmas[last] * v).to(x.dtype))


# ---------------------------------------------------------------- how rewards combine (M1, X1)


def two_rewards_with_constant_groups() -> tuple[torch.Tensor, torch.Tensor]:
    """Random rewards [48, 2] of 6 groups of 8 in shuffled order: group 0 constant in both rewards, group 1 in the
    first, group 2 in the second (dyadic constants: every summation order gives their mean exactly, as it would not
    for most constants, where both sources divide a rounding residue by their eps)."""
    g = torch.Generator().manual_seed(3)
    groups = torch.arange(6).repeat_interleave(8)[torch.randperm(48, generator=g)]
    rewards = torch.rand(48, 2, generator=g, dtype=torch.float64)
    rewards[groups == 0] = torch.tensor([0.75, 0.25], dtype=torch.float64)
    rewards[groups == 1, 0] = 0.5
    rewards[groups == 2, 1] = 1.0
    return rewards, groups


@pytest.mark.parametrize("preset", sorted(MIXGRPO | GDPO))
def test_reward_combination_equals_the_sources(preset):
    """M1 (MixGRPO: per_reward) and X1 (Flow-Factory: gdpo) on two weighted rewards with constant groups, through
    the preset's own targets: equal to 1e-12 after the clamp; a group constant in both rewards gets exactly 0."""
    cfg = load_config(preset=preset)
    weights = {"color_match": 0.7, "jpeg_compressibility": 0.3}
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, weights=weights))
    components, groups = two_rewards_with_constant_groups()
    total = components @ torch.tensor(list(weights.values()), dtype=torch.float64)
    lean = build_algorithm(cfg, None).targets(total, groups, components)
    published = (published_gdpo if preset in GDPO else published_per_reward)(
        components.numpy(), list(weights.values()), groups.numpy()
    )
    clip = cfg.algorithm.adv_clip_max
    np.testing.assert_allclose(lean.numpy(), np.clip(published, -clip, clip), rtol=0, atol=1e-12)
    assert (lean[groups == 0] == 0).all() and (lean[groups != 0] != 0).all()
    summed = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, reward_combination="sum"))
    assert (build_algorithm(summed, None).targets(total, groups) - lean).abs().max() > 0.1  # what the key changes


def test_gdpo_with_one_reward_is_the_group_advantage_over_its_batch_std():
    """The issue's case: one reward, a quarter of the groups constant: GDPO = the population-normalised group
    advantage / sqrt(3/4), 1.155 times it."""
    g = torch.Generator().manual_seed(4)
    groups = torch.arange(8).repeat_interleave(4)
    rewards = torch.rand(32, generator=g, dtype=torch.float64)
    rewards[groups < 2] = 0.5
    cfg = load_config(preset="flowfactory-grpo-flux2-klein")  # one reward (PickScore), gdpo
    gdpo = build_algorithm(cfg, None).targets(rewards, groups, rewards[:, None])
    np.testing.assert_allclose(
        gdpo.numpy(), published_gdpo(rewards[:, None].numpy(), [1.0], groups.numpy()), atol=1e-12
    )
    r, ids = rewards.numpy(), groups.numpy()
    plain = np.array([(r[n] - r[ids == ids[n]].mean()) / max(r[ids == ids[n]].std(), 1e-6) for n in range(len(r))])
    np.testing.assert_allclose(gdpo.numpy(), plain / math.sqrt(3 / 4), atol=1e-12)


# ---------------------------------------------------------------- Qwen-Image's window (Q1), Kontext's filter (F2b)


def source_qwen_image_window_start(num_steps: int, window: int, process_index: int = 0) -> int:
    """Q1: random.seed(process_index) then random.randint(0, num_steps // 2 - window), as each rollout of
    train_qwenimage.py draws it (a fresh ``random.Random(seed)`` draws what the re-seeded global one does)."""
    return random.Random(process_index).randint(0, num_steps // 2 - window)


def test_qwen_image_window_is_the_sources_at_every_iteration():
    """Over 50 iterations the stochastic and trained steps of every sample are the source's: 3 and 4 of 10."""
    from helpers import tiny_preset

    from lean.run.iteration import select_local_steps

    cfg = tiny_preset("flowgrpo-qwen-image")
    s, samples = cfg.sample, [(0, 0, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1)]
    window = set()
    for iteration in range(50):
        start = source_qwen_image_window_start(s.num_steps, s.sde_window)
        window.add(tuple(range(start, start + s.sde_window)))
        steps = select_local_steps(cfg, iteration, samples, None)
        assert torch.equal(steps.trained, steps.stochastic.expand(len(samples), -1))
        assert tuple(torch.nonzero(steps.stochastic).flatten().tolist()) == (start, start + 1)
    assert window == {(3, 4)}
    drawn = load_config(None, ["sample.sde_window_start=null"], preset="flowgrpo-qwen-image")
    starts = {select_local_steps(drawn, i, samples, None).window_start for i in range(50)}
    assert starts == {0, 1, 2, 3}  # null: drawn at each iteration, as Flow-GRPO-Fast


@pytest.mark.parametrize(
    "preset,sde_steps",
    [
        ("flowfactory-grpo-flux2", {1, 2, 3}),
        ("flowfactory-grpo-flux2-klein", {1, 2}),
        ("flowfactory-grpo-wan22", {1, 2, 3}),
        ("flowfactory-grpo-z-image", {1, 2, 3}),  # z_image_turbo/default.yaml:82
        ("flowfactory-grpo-wan21-i2v", {1, 2, 3}),  # wan21/i2v.yaml:89
        ("flowfactory-grpo-wan22-i2v", {1}),  # wan22/i2v.yaml:98
    ],
)
def test_flowfactory_window_starts_are_its_sde_steps(preset, sde_steps):
    """Flow-Factory draws the SDE step from its sde_steps list (t2i.yaml:91, default.yaml:92, t2v.yaml:98 at a0b2bc5;
    flow_match_euler_discrete.py:150-160), which starts at 1: over 200 iterations lean's drawn starts are exactly it."""
    from lean.run.iteration import select_local_steps

    cfg = load_config(None, preset=preset)
    starts = {select_local_steps(cfg, i, [(0, 0, 0)], None).window_start for i in range(200)}
    assert starts == sde_steps


@pytest.mark.timeout(120)
def test_qwen_image_rollouts_train_steps_3_and_4():
    """A tiny flowgrpo-qwen-image run's rollouts at two iterations take their SDE (trained) steps at 3 and 4 only."""
    from helpers import tiny_preset

    from lean.schedules import SCHEDULES
    from lean.tools.equivalence import StepRecorder
    from lean.train import Trainer

    pipeline = Trainer(tiny_preset("flowgrpo-qwen-image")).pipeline
    for iteration in (0, 1):
        recorder = StepRecorder()
        rolled = pipeline.roll_out(iteration, SCHEDULES["recompute"], on_step=recorder)
        assert sorted({step.index for step in recorder.steps}) == [3, 4]
        assert torch.nonzero(rolled.batch.steps.trained.any(dim=0)).flatten().tolist() == [3, 4]


def test_kontext_drops_zero_advantage_samples_as_train_sd3():
    """F2b: train_sd3.py:801-822 keeps the samples whose advantages, summed in absolute value over the trained steps,
    are not 0 (train_flux_kontext.py:765-786 the same); flowgrpo-kontext keeps the same ones, with flowgrpo-sd3's
    filter keys (lean does not pad the kept samples with random dropped ones, docs/coming-from-flowgrpo.md)."""
    sd3, kontext = (load_config(preset=p) for p in ("flowgrpo-sd3", "flowgrpo-kontext"))
    for key in ("skip_zero_advantage", "all_zero_advantage", "zero_advantage_order"):
        assert getattr(kontext.algorithm, key) == getattr(sd3.algorithm, key)
    algorithm = build_algorithm(kontext, None)
    kept, count = algorithm.kept_samples(algorithm.targets(TOY_REWARDS, GROUPS))
    published = published_advantages(TOY_REWARDS.numpy(), GROUPS.numpy(), "flowgrpo-kontext", global_std=True)
    trained_steps = 5  # int(6 x 0.99), the advantage repeated over them (train_flux_kontext.py:709)
    mask = np.abs(np.repeat(published[:, None], trained_steps, axis=1)).sum(axis=1) != 0
    assert kept.tolist() == mask.tolist() and int(count) == mask.sum() == 6


# Flow-Factory (X-GenGroup/Flow-Factory at a0b2bc5): FF1 src/flow_factory/ema/ema_utils.py:38-52 power_warmup_decay,
# min(d, (1 + t) / (warmup_steps + t)), warmup_steps 10 by default (:158); FF2 ema/ema.py:102-127 step: an update when
# (t + 1) % update_step_interval == 0, ema <- decay ema + (1 - decay) param; FF3 trainers/grpo.py:85-91: each epoch's
# gradient_step_per_epoch optimizer steps, then ema_step(step=epoch), epoch counted from 0; FF4 models/abc.py:899-904,
# :929-935 every LoRA LoraConfig(init_lora_weights="gaussian"): peft's A ~ N(0, (1/r)^2), B = 0.
FLOWFACTORY_EMA = {  # the published ema_decay, ema_update_interval (t2i.yaml:71-72, default.yaml:72-73, t2v.yaml:84-85)
    "flowfactory-grpo-flux2": (0.9, 4),
    "flowfactory-grpo-flux2-klein": (0.9, 4),
    "flowfactory-grpo-wan22": (0.9, 4),
    "flowfactory-grpo-z-image": (0.9, 4),  # z_image_turbo/default.yaml:73-74
    "flowfactory-grpo-wan21-i2v": (0.9, 4),  # wan21/i2v.yaml:73-74
    "flowfactory-grpo-wan22-i2v": (0.9, 4),  # wan22/i2v.yaml:82-83
    "flowfactory-grpo-ltx2": (0.9, 4),  # ltx2/t2av_pickscore.yaml:88-89
}


def flowfactory_ema(params_per_step: list[list[np.ndarray]], decay: float, interval: int, steps_per_epoch: int):
    """FF1-FF3 in float64: the EMA after every optimizer step, from the weights after each step."""
    ema = [p.copy() for p in params_per_step[0]]  # cloned from the initial weights (ema.py:72-73)
    after = []
    for s, params in enumerate(params_per_step[1:], start=1):
        epoch, last = (s - 1) // steps_per_epoch, s % steps_per_epoch == 0
        if last and (epoch + 1) % interval == 0:
            d = min(decay, (1 + epoch) / (10 + epoch))
            ema = [d * e + (1 - d) * p for e, p in zip(ema, params)]
        after.append([e.copy() for e in ema])
    return after


@pytest.mark.parametrize("preset", list(FLOWFACTORY_EMA))
def test_flowfactory_ema_is_its_source_schedule_step_by_step(preset):
    """The preset's EMA (``lean.run.optimizer.TrainState``, driven as ``Trainer.iteration`` drives it) equals FF1-FF3
    after every one of 200 optimizer steps (100 iterations: the decay reaches 0.9 at iteration 83): which steps
    update, and by how much."""
    from lean.parallel.distributed import World
    from lean.run.optimizer import TrainState

    cfg = load_config(preset=preset)
    steps_per_epoch = cfg.train.optimizer_steps_per_iteration * cfg.train.num_inner_epochs
    assert steps_per_epoch == 2  # gradient_step_per_epoch = 2 (t2i.yaml:60, default.yaml:61, t2v.yaml:72)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64)) for shape in ((3, 4), (5,))]
    state = TrainState(list(zip(["a", "b"], params)), cfg.optimizer, cfg.ema, World())
    weights, lean_ema = [[p.detach().numpy().copy() for p in params]], []
    for iteration in range(100):
        state.iteration = iteration
        for _ in range(steps_per_epoch):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            state.step()
            if state.steps % steps_per_epoch == 0:
                state.end_iteration()  # Trainer.iteration, after the pipeline's last step
            weights.append([p.detach().numpy().copy() for p in params])
            lean_ema.append([e.numpy().copy() for e in state.ema])
    published = flowfactory_ema(weights, *FLOWFACTORY_EMA[preset], steps_per_epoch)
    for s, (mine, theirs) in enumerate(zip(lean_ema, published, strict=True)):
        for m, t in zip(mine, theirs):
            np.testing.assert_allclose(m, t, rtol=0, atol=1e-12, err_msg=f"{preset} after optimizer step {s + 1}")
    assert not np.array_equal(published[-1][0], weights[0][0])  # the fixture updates the EMA


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset", ["flowfactory-grpo-flux2", "flowfactory-grpo-flux2-klein"])
def test_flowfactory_lora_starts_from_peft_gaussian(preset):
    """FF4: every A of the preset's adapter is drawn from N(0, (1/r)^2) (a Kolmogorov-Smirnov test against that
    law, and its standard deviation to 2%), every B is 0."""
    from scipy import stats

    from lean.models import build_policy

    cfg = load_config(preset=preset)
    model = dataclasses.replace(cfg.model, size="tiny", resolution=32, dtype="float32", text_max_length=8)
    net = build_policy(model, ["a prompt"]).denoisers[0]
    a = (
        torch.cat([m.weight.flatten() for n, m in net.named_modules() if n.endswith("lora_A.default")])
        .detach()
        .double()
    )
    b = [m.weight for n, m in net.named_modules() if n.endswith("lora_B.default")]
    std = 1 / cfg.model.lora_rank
    assert a.numel() > 10_000 and all(torch.count_nonzero(w) == 0 for w in b)
    assert abs(a.std().item() / std - 1) < 0.02
    assert stats.kstest(a.numpy(), stats.norm(scale=std).cdf).pvalue > 1e-3
