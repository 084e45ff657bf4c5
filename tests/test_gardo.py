"""GARDO (lean/algorithms/gardo.py): its advantages, gate and loss against the source's, written here in float64 from
yifan123/flow_grpo at 94e23ee (flow_grpo/stat_tracking.py:11-50, scripts/train_sd3_gardo.py:218-237, :787-798,
:825-836, :966-990, :1039-1042); its reference is the snapshot, reset as the script resets it; every schedule is
certified on flux, sd3 and wan; `lean train` runs it; what it cannot run is one config line; its preset is cited."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from helpers import FAST, lean_here, lean_ranks, preset_value_lines, reference_gap, tiny, uncited
from safetensors.torch import load_file

from lean.algorithms import build_algorithm
from lean.algorithms.gardo import GARDO
from lean.cli import main
from lean.config import ConfigError
from lean.configure import load_config
from lean.models.snapshot import swapped_in
from lean.rewards.diversity import nearest_distances
from lean.sampling.rollout import Sampler, policy_step, reference_mean
from lean.sampling.sde import Sde, sde_step_with_logprob, sigma_schedule
from lean.sampling.transition import Transition
from lean.tools.equivalence import run_equivalence
from lean.train import Trainer

# the tiny run's rewards in the script's roles: main (ocr), the gate's two (aesthetic, imagereward), the diversity
REWARDS = [
    "reward.weights={color_match: 1.0, jpeg_compressibility: 0.1, position_match: 0.1, diversity: 0.0}",
    "algorithm.gardo.main_reward=color_match",
    "algorithm.gardo.gate_rewards=[jpeg_compressibility, position_match]",
]
GARDO_SETS = ["algorithm.name=gardo", *REWARDS, "algorithm.beta=0.04", "algorithm.kl_form=flow_grpo"]


# ---------------------------------------------------------------- the source, transcribed (numpy, float64)


def tracker_advantages(prompts, rewards, features):
    """stat_tracking.py:11-50 with type='gardo' (one update after a clear, :856): per prompt, (r - mean) times the
    features' nearest cosine distance over its prompt's mean, or 1 where r is below the mean."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)[:, None]  # :801 repeats over steps
    dists = np.nan_to_num(np.array(features))  # :824
    dists = dists / np.linalg.norm(dists, ord=2, axis=1, keepdims=True)
    advantages = np.zeros_like(rewards)
    for prompt in np.unique(prompts):
        r = rewards[prompts == prompt]
        mean = np.mean(r, axis=0, keepdims=True)
        d = dists[prompts == prompt]
        distance = 1 - np.dot(d, d.T).clip(-1, 1)
        nearest = np.array([np.min(distance[i, np.arange(len(d)) != i]) for i in range(len(d))])
        w = np.repeat(nearest[:, None], r.shape[-1], axis=1)
        w = np.where((r - mean) < 0, np.ones_like(w), w / np.mean(w))
        advantages[prompts == prompt] = (r - mean) * w
    return advantages[:, 0]


class RiskCompensator:
    """train_sd3_gardo.py:218-237."""

    def __init__(self, base=0.1, beta=0.1):
        self.risk_buffer, self.base, self.alpha, self.beta, self.beta_min, self.beta_max = (
            [],
            base,
            0.1,
            beta,
            0.02,
            0.2,
        )

    def update(self, pad_scores):
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        if len(self.risk_buffer) > 20:
            self.risk_buffer = self.risk_buffer[-20:]


def script_gate(rewards: dict, main: str, controller: RiskCompensator) -> np.ndarray:
    """train_sd3_gardo.py:825-836: the uncertainty u, the controller's step, u above its percentile."""
    ranks = []
    for item in ["aesthetic", "imagereward", main]:
        _, indices = torch.sort(torch.tensor(rewards[item]), descending=True)
        r = torch.empty_like(torch.tensor(rewards[item])).long()
        r[indices] = torch.arange(1, len(rewards[item]) + 1)
        ranks.append(r.float())
    u = ranks[-1] - (ranks[0] + ranks[1]) / 2
    controller.update(np.array([p for p in u.cpu().numpy() if p >= 0]))
    threshold = np.percentile(np.array([p for p in u.cpu().numpy() if p >= 0]), 100 - controller.beta * 100)
    return (u > threshold).numpy()


def script_loss(log_p, log_p_old, mean, mean_ref, std_dev_t, advantages, gate, clip_range, beta):
    """train_sd3_gardo.py:966-990, one micro-batch at one step j: the clamped advantages, the clipped surrogate times
    std_dev_t / its mean (:979), plus beta times the KL averaged over the gated rows (:983-986)."""
    advantages = torch.clamp(advantages, -5.0, 5.0)
    ratio = torch.exp(log_p - log_p_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy = (std_dev_t[:, 0, 0, 0] / torch.mean(std_dev_t[:, 0, 0, 0])) * torch.maximum(unclipped, clipped)
    if not gate.any():
        return torch.mean(policy)
    kl = torch.mean(torch.square(mean[gate] - mean_ref[gate]) / (2 * std_dev_t[gate] ** 2))
    return torch.mean(policy) + beta * kl


def script_resets(kl_by_iteration, threshold, reset_freq):
    """The iterations whose update starts from a fresh copy of the reference (:787-798, :1041-1042)."""
    resets, prev_epoch, reset = [], 0, False
    for epoch, kl in enumerate(kl_by_iteration):
        if (epoch != 0 and reset) or (epoch - prev_epoch) > reset_freq:
            resets.append(epoch)
            reset, prev_epoch = False, epoch
        if kl > threshold:
            reset = True
    return resets


# ---------------------------------------------------------------- the formulas in float64


def components(g: torch.Generator, n: int) -> torch.Tensor:
    """Random reward columns [n, 4] (main, the gate's two, diversity) without ties, float64."""
    return torch.rand(n, 4, generator=g, dtype=torch.float64)


def test_the_advantages_are_the_trackers_with_lean_diversity():
    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2])  # groups of 4, 5 and 3
    features = torch.randn(12, 6, generator=g, dtype=torch.float64)
    features[1] = features[0] * 2.5 + 1e-3  # a near-duplicate: a small distance for both
    main = torch.rand(12, generator=g, dtype=torch.float64) * 3  # advantages up to +-1.5 x w: some above the clamp
    diversity = torch.zeros(12, dtype=torch.float64)
    for k in groups.unique():
        rows = groups == k
        diversity[rows] = nearest_distances(features[rows])  # lean's diversity reward of each group
    columns = torch.stack([main, torch.rand(12, generator=g), torch.rand(12, generator=g), diversity], dim=1)
    cfg = tiny(*GARDO_SETS, "algorithm.adv_clip_max=1.0")
    got = build_algorithm(cfg, None).targets(columns.sum(1), groups, columns)
    want = tracker_advantages(groups.tolist(), main.numpy(), features.numpy())
    assert (np.abs(want) > 1).any() and (want < 0).any() and (want > 0).any()
    torch.testing.assert_close(got, torch.from_numpy(np.clip(want, -1, 1)), rtol=1e-13, atol=1e-15)  # :966-970


def test_the_diversity_is_the_nearest_cosine_distance():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(nearest_distances(x), 1 - torch.tensor([1, 1, 1], dtype=torch.float64) / math.sqrt(2))
    assert nearest_distances(x[:1]).tolist() == [0.0]  # a group of one
    assert nearest_distances(torch.zeros(2, 3)).tolist() == [1.0, 1.0]  # zero features: cosine 0


def test_the_gate_and_its_controller_are_the_scripts_over_iterations():
    algorithm = build_algorithm(tiny(*GARDO_SETS), None)
    controller, g = RiskCompensator(), torch.Generator().manual_seed(3)
    gated, fractions = [], []
    for it in range(40):
        columns = components(g, 48)
        # the main reward turns against the gate's (the uncertainty grows, then shrinks): the fraction moves both ways
        a = min(it, 40 - it) / 20
        columns[:, 0] = (1 - a) * columns[:, 0] - a * (columns[:, 1] + columns[:, 2])
        rewards = {"color_match": columns[:, 0], "aesthetic": columns[:, 1], "imagereward": columns[:, 2]}
        want = script_gate({k: v.numpy() for k, v in rewards.items()}, "color_match", controller)
        got = algorithm.gate(columns)
        assert got.tolist() == want.tolist(), it
        assert algorithm.controller.fraction == pytest.approx(float(controller.beta), rel=1e-15)
        gated.append(int(got.sum()))
        fractions.append(algorithm.controller.fraction)
    assert max(fractions) > 0.15 and fractions[-1] < max(fractions) and len(set(gated)) > 3


def _step(v, x, sigmas, j, x_next=None):
    noise = torch.Generator().manual_seed(1) if x_next is None else None
    return sde_step_with_logprob(Sde("flow_grpo", 0.7, sigmas), v, x, j, prev_sample=x_next, generator=noise)


def test_the_loss_and_its_gradient_are_the_scripts_micro_batch():
    """One update of B samples at one step: lean's objective 1/B sum_b [policy_b + beta f_b kl_b] is the script's
    micro-batch loss, the gated KL's mean included; off-policy, so the clip binds on some rows."""
    g = torch.Generator().manual_seed(0)
    sigmas, j, b = sigma_schedule(10, 3.0).double(), 2, 8
    sets = [*GARDO_SETS, "sample.sde_kind=flow_grpo", "algorithm.gardo.gate_max=0.5"]
    algorithm = build_algorithm(tiny(*sets, "algorithm.gardo.gate_fraction=0.5"), sigmas)
    columns, groups = components(g, b), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    advantages = algorithm.targets(columns[:, 0], groups, columns)
    factors = algorithm.regulariser_factors(advantages, columns[:, 0], groups, columns)
    gate = factors > 0
    assert 0 < gate.sum() < b and torch.equal(factors[gate], torch.full_like(factors[gate], b / int(gate.sum())))
    x = torch.randn(b, 4, 8, 8, generator=g, dtype=torch.float64)
    v_old = torch.randn(x.shape, generator=g, dtype=torch.float64)
    v_ref = v_old + 0.05 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    scale = torch.tensor([1e-5, 0.05] * 4, dtype=torch.float64).view(-1, 1, 1, 1)
    v = (v_old + scale * torch.randn(x.shape, generator=g, dtype=torch.float64)).requires_grad_()
    x_next, log_p_old, _, _ = _step(v_old, x, sigmas, j)
    _, _, mean_ref, _ = _step(v_ref, x, sigmas, j, x_next)
    _, log_p, mean, std = _step(v, x, sigmas, j, x_next)
    step = Transition(index=j, sample=x, next_sample=x_next, log_prob=log_p, mean=mean, std=std)
    loss = algorithm.step_loss(dataclasses.replace(step, old_log_prob=log_p_old, ref_mean=mean_ref), advantages)
    assert 0 < ((loss.ratio - 1).abs() > 1e-4).sum() < b  # the clip binds on some rows
    got = (loss.policy + algorithm.kl_weight * factors * loss.kl).mean()
    std_dev_t = std / torch.sqrt(sigmas[j] - sigmas[j + 1])  # the script's std_dev_t: the noise scale
    want = script_loss(log_p, log_p_old, mean, mean_ref, std_dev_t, advantages, gate, 1e-4, 0.04)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    (grad,) = torch.autograd.grad(got, v, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want, v)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-18)


def test_the_reference_resets_as_the_scripts():
    algorithm = build_algorithm(tiny(*GARDO_SETS, "train.optimizer_steps_per_iteration=2"), None)
    kl = [0.0, 1e-4, 5e-4, 0.0, 1e-3, 1e-3] + [0.0] * 30 + [1e-3] + [0.0] * 20
    resets = []
    for e, value in enumerate(kl):
        if algorithm.snapshot_decay(e * 2) == 0.0:  # before the rollout of e, after e x 2 optimizer steps
            resets.append(e)
        algorithm.end_iteration(e, {"kl_weighted_sum": 3 * value, "kl_factor_sum": 3.0})
    assert resets == script_resets(kl, 3e-4, 15) and len(resets) > 4
    state = algorithm.state_dict()
    copy = build_algorithm(tiny(*GARDO_SETS), None)
    copy.load_state_dict(json.loads(json.dumps(state)))  # plain values: a checkpoint holds them
    assert copy.state_dict() == state


# ---------------------------------------------------------------- the reference, and the certificate


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_kl_reference_is_the_snapshot_read_without_writing_the_weights(dtype):
    trainer = Trainer(tiny(*GARDO_SETS, f"model.dtype={dtype}"))
    policy, snapshot = trainer.policy, trainer.pipeline.snapshot
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    snapshot.blend(0.0)
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(2))
    sampler = Sampler(trainer.cfg.sample, trainer.pipeline.sigmas)
    x = policy.init_latents([torch.Generator().manual_seed(k) for k in range(2)])
    emb = policy.encode_prompts(trainer.cfg.train.prompts[:2])
    step = Transition(index=1, sample=x, next_sample=x + 0.1)
    params = [p for _, p in policy.trainable_parameters()]
    versions = [p._version for p in params]
    got = reference_mean(policy, sampler, step, emb)
    assert [p._version for p in params] == versions  # swapped by reference, not copied in
    with torch.no_grad(), swapped_in(params, snapshot.values):
        want = policy_step(policy, sampler, step, emb).mean
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    policy.reference_weights = None
    with torch.no_grad():
        assert not torch.equal(reference_mean(policy, sampler, step, emb), got)  # not the adapter switched off


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_in_float64_every_schedule_is_the_reference_with_the_gate_and_a_later_update(family):
    """Retain and Reweight against Recompute and the float64 reference: the KL on gated samples only, to a snapshot
    that is neither the weights nor the base, zero-advantage samples dropped, and a second, off-policy update."""
    sets = [*GARDO_SETS, "model.dtype=float64", f"model.family={family}", "train.group_size=4"]
    sets += ["algorithm.gardo.gate_fraction=0.5", "algorithm.gardo.gate_max=0.5", "algorithm.skip_zero_advantage=true"]
    cfg = tiny(*sets, "train.train_batch_size=2", "train.optimizer_steps_per_iteration=2")
    trainer = Trainer(cfg)
    trainer.policy.perturb_lora_(0.05, torch.Generator().manual_seed(5))
    trainer.pipeline.snapshot.blend(0.0)  # the reference: neither the base (LoRA B = 0) nor the weights run from
    report = run_equivalence(cfg, trainer)
    assert set(report["reference"]) == {"recompute", "retain", "reweight"}
    for schedule in ("retain", "reweight"):
        assert report[schedule]["max_rel_grad_diff"] < 1e-10, (schedule, report[schedule])
    assert reference_gap(report) < 1e-10
    assert trainer.pipeline.algorithm.state_dict()["controller"]["fraction"] is None  # restored after each schedule


def test_the_gate_is_partial_and_its_factors_average_the_gated_terms():
    cfg = tiny(*GARDO_SETS, "model.dtype=float64", "train.group_size=4", "algorithm.gardo.gate_fraction=0.2")
    trainer = Trainer(cfg)
    trainer.policy.perturb_lora_(0.05, torch.Generator().manual_seed(5))
    pipeline = trainer.pipeline
    from lean.schedules import schedule_class

    rolled = pipeline.roll_out(0, schedule_class("retain", pipeline.algorithm))
    pipeline.advantages(rolled)
    factors = rolled.ctx.kl_factors
    assert 0 < int((factors > 0).sum()) < len(factors)
    assert float(factors.sum()) == pytest.approx(len(factors))  # the gated terms' mean: weights summing to N


# ---------------------------------------------------------------- lean train, config lines, the preset


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_lean_train_runs_reweight_on_every_family(family, tmp_path):
    """Reweight from the command line, its KL buffers per trajectory (tests/test_algorithms.py runs recompute and
    retain with the same settings), and a reset after the first iteration (threshold 0)."""
    sets = [*FAST, *GARDO_SETS, f"model.family={family}", "train.iterations=2", "algorithm.gardo.kl_threshold=0"]
    out = tmp_path / "reweight"
    args = ["train", *(a for s in [*sets, "train.schedule=reweight"] for a in ("--set", s)), "--out", str(out)]
    assert main(args) == 0
    assert json.loads((out / "metrics.json").read_text())["schedule"] == "reweight"
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert len(rows) == 2 and all(math.isfinite(float(row["kl_weighted"])) for row in rows)


@pytest.mark.timeout(300)
def test_two_processes_train_the_weights_one_does(tmp_path):
    """The gate, the diversity and the KL factors are the whole batch's and the reset's KL is summed over processes:
    two ranks (a group each) train what one process does (float64; three iterations, a reset before the third)."""
    sets = [*FAST, *GARDO_SETS, "model.dtype=float64", "train.iterations=3", "train.schedule=retain"]
    # a threshold above the rounding of an on-policy KL (CFG's halves batched differently: ~1e-30), below a real one
    sets += ["algorithm.gardo.kl_threshold=1e-12", "algorithm.gardo.gate_fraction=0.5", "algorithm.gardo.gate_max=0.5"]
    args = [a for s in sets for a in ("--set", s)]
    lean_here("train", *args, "--out", str(tmp_path / "one"))
    lean_ranks(2, "train", *args, "--out", str(tmp_path / "two"))
    for run in ("one", "two"):  # a real KL after the first update, the reference reset before the third
        kl = [float(row["kl_weighted_sum"]) for row in csv.DictReader((tmp_path / run / "metrics.csv").open())]
        assert kl[1] > 1e-12 > 1e-20 > kl[2], (run, kl)
    one, two = (load_file(tmp_path / run / "lora.safetensors") for run in ("one", "two"))
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-9, atol=1e-12)


def test_a_reset_copies_the_trained_weights_into_the_reference():
    trainer = Trainer(tiny(*GARDO_SETS, "algorithm.gardo.kl_threshold=1e-12", "algorithm.gardo.gate_fraction=0.5"))
    snapshot = trainer.pipeline.snapshot
    start = [v.clone() for v in snapshot.values]
    trainer.iteration(0, "recompute")  # on-policy from the snapshot: KL 0 (to rounding), no reset after it
    assert trainer.pipeline.algorithm.state_dict()["kl_exceeded"] is False
    trainer.iteration(1, "recompute")  # the weights moved: KL above the threshold
    assert all(torch.equal(a, b) for a, b in zip(snapshot.values, start))
    before = [p.detach().clone() for p in trainer.params]
    trainer.iteration(2, "recompute")  # reset before its rollout: the reference is the weights it started from
    assert all(torch.equal(a, b) for a, b in zip(snapshot.values, before))
    assert trainer.pipeline.algorithm.state_dict()["last_reset"] == 2


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (
            ["reward.weights={color_match: 1.0}"],
            r"algorithm\.gardo\.gate_rewards='jpeg_compressibility': must be a reward of",
        ),
        (["algorithm.gardo.main_reward=ocr"], r"algorithm\.gardo\.main_reward='ocr'"),
        (["algorithm.gardo.diversity_reward=hps"], r"algorithm\.gardo\.diversity_reward='hps'"),
        (["algorithm.gardo.gate_rewards=[]"], r"algorithm\.gardo\.gate_rewards"),
        (["algorithm.gardo.gate_max=1.5"], r"algorithm\.gardo\.gate_max"),
        (["parallel.shard=fsdp", "model.full_finetune=true"], r"parallel\.shard='fsdp': gardo's reference"),
    ],
)
def test_what_it_cannot_run_is_one_config_line(sets, key):
    with pytest.raises(ConfigError, match=key) as err:
        tiny(*GARDO_SETS, *sets)
    assert "\n" not in str(err.value)


def test_the_preset_cites_every_value_and_is_the_published_recipe():
    values = preset_value_lines("gardo-sd3")
    assert len(values) >= 50
    assert not uncited(values, "sde_window_max_start: null")
    cfg = load_config(None, [], preset="gardo-sd3")
    published = {  # config/grpo_gardo.py:general_ocr_sd3, config/base.py and the script at 94e23ee
        ("model", "family"): "sd3",
        ("model", "resolution"): 512,
        ("model", "lora_rank"): 32,
        ("sample", "num_steps"): 10,
        ("sample", "timestep_fraction"): 0.89,
        ("sample", "guidance_scale"): 4.5,
        ("algorithm", "name"): "gardo",
        ("algorithm", "beta"): 0.04,
        ("algorithm", "kl_form"): "flow_grpo",
        ("algorithm", "clip_range"): 1e-4,
        ("algorithm", "skip_zero_advantage"): True,
        ("train", "group_size"): 24,
        ("train", "prompts_per_iteration"): 48,
        ("train", "optimizer_steps_per_iteration"): 2,
        ("optimizer", "lr"): 3e-4,
    }
    for (section, key), value in published.items():
        assert getattr(getattr(cfg, section), key) == value, (section, key)
    assert cfg.reward.weights == {"ocr": 0.8, "aesthetic": 0.1, "imagereward": 0.1, "diversity": 0.0}
    o = cfg.algorithm.gardo
    assert (o.main_reward, o.gate_rewards, o.kl_threshold, o.reset_every) == (
        "ocr",
        ["aesthetic", "imagereward"],
        3e-4,
        15,
    )
    assert (o.gate_fraction, o.gate_step, o.gate_min, o.gate_max, o.gate_window) == (0.1, 0.1, 0.02, 0.2, 20)
    assert isinstance(build_algorithm(cfg, None), GARDO)
