"""AWM (lean/algorithms/awm.py): its loss equals a float64 reference written here from the script
(scxue/advantage_weighted_matching at 12b1397, scripts/train_sd3_awm.py :210-252, :1265-1354) in value and gradient;
its draws, advantages and EMA policy are the script's; its update is certified; the Lean schedules and an
off-policy update are one config line each; the preset cites every value and trains. `lean train` on flux, sd3 and
wan: tests/test_algorithms.py (every algorithm on every family)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import preset_value_lines, tiny, tiny_preset, uncited

from lean.algorithms import build_algorithm
from lean.config import ConfigError
from lean.tools.equivalence import passes, run_equivalence
from lean.train import Trainer

AWM = ["algorithm.name=awm"]


def published_loss(v, v_ref, v_ema, x0, noise, t, advantages, o, clip_max, clip_range):
    """One micro-batch of the script, float64: compute_log_prob_awm (:234-252) with 'Uniform'/'ghuber'/... weighting,
    the exp_first surrogate (:1293-1327), the 'Uniform' KL terms (:1330-1352); [K x B] terms averaged, as :1325."""
    log_prob = -((v.double() - (noise.double() - x0.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if o.weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=torch.float64)
        log_prob = -(torch.pow(-log_prob + 1e-10, o.ghuber_power) - torch.pow(floor, o.ghuber_power)) * t
        log_prob = log_prob / o.ghuber_power
    elif o.weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif o.weighting == "t":
        log_prob = log_prob * t
    elif o.weighting == "t2":
        log_prob = log_prob * t**2
    advantages = torch.clamp(advantages, -clip_max, clip_max) / clip_max * o.advantage_max
    ratio = torch.exp(log_prob - log_prob.detach())  # old_log_probs = this forward, detached (:1282-1284)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.mean(torch.maximum(unclipped, clipped))
    kl = ((v.double() - v_ref.double()) ** 2).mean(dim=(1, 2, 3)).mean()
    ema_kl = ((v.double() - v_ema.double()) ** 2).mean(dim=(1, 2, 3)).mean()
    return loss + o.beta * kl + o.ema_beta * ema_kl


class LinearVelocities:
    """A float64 stand-in for the three weights' velocities (``lean.algorithms.clean_samples.Velocities``):
    v = a x + b t with trained (a, b), the EMA's and the reference's values; the loss's math is what is checked here,
    the model's forwards by the certificate below."""

    def __init__(self, g: torch.Generator):
        self.params = [
            torch.randn(4, 1, 1, generator=g, dtype=torch.float64).requires_grad_(),
            torch.randn(4, 1, 1, generator=g, dtype=torch.float64).requires_grad_(),
        ]
        self.ema = [p.detach() + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in self.params]
        self.ref = [p.detach() + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in self.params]

    @staticmethod
    def _v(a, b, x, t):
        return a * x + b * t.double().view(-1, 1, 1, 1)

    def policy(self, x, t, rows):
        return self._v(*self.params, x, t)

    def snapshot(self, x, t, rows):
        return self._v(*self.ema, x, t)

    def reference(self, x, t, rows):
        return self._v(*self.ref, x, t)


def _grad(total, params):
    return torch.cat([g.flatten() for g in torch.autograd.grad(total, params)])


@pytest.mark.parametrize("weighting", ["ghuber", "uniform", "t", "t2", "huber"])
def test_the_loss_and_its_gradient_are_the_scripts(weighting):
    cfg = tiny(*AWM, f"algorithm.awm.weighting={weighting}", "algorithm.clip_range=0.5")
    algorithm, o, a = build_algorithm(cfg, None), cfg.algorithm.awm, cfg.algorithm
    g = torch.Generator().manual_seed(5)
    velocities, x0 = LinearVelocities(g), torch.randn(6, 4, 8, 8, generator=g, dtype=torch.float64)
    rows, targets = torch.arange(6), torch.tensor([7.0, -0.7, 2.0, -6.0, 0.0, 4.0], dtype=torch.float64)
    t = torch.tensor([0.95, 0.6, 0.3, 0.1, 0.8, 0.45], dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    lean = algorithm.unit_loss(velocities, x0, rows, targets, t, noise)
    lean_total = lean.total(algorithm.kl_weight).mean()  # the update's 1/(|C| K) over these 6 terms
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    v, v_ref, v_ema = (f(x_t, t, rows) for f in (velocities.policy, velocities.reference, velocities.snapshot))
    published = published_loss(v, v_ref, v_ema, x0, noise, t, targets, o, a.adv_clip_max, a.clip_range)
    torch.testing.assert_close(lean_total, published, rtol=1e-10, atol=0)
    published_grad = _grad(published, velocities.params)
    torch.testing.assert_close(_grad(lean_total, velocities.params), published_grad, rtol=1e-10, atol=1e-14)
    assert published_grad.abs().min() > 0
    formula = algorithm.reference_unit_loss(velocities, x0, rows, targets, t, noise).mean()  # the certificate's
    torch.testing.assert_close(_grad(formula, velocities.params), published_grad, rtol=1e-10, atol=1e-14)


def test_draws_advantages_and_the_ema_policy_are_the_scripts():
    cfg = tiny(*AWM, "sample.num_steps=14", "sample.timestep_fraction=0.9")
    from lean.sampling.sde import sigma_schedule

    sigmas = sigma_schedule(14, 3.0).double()
    algorithm = build_algorithm(cfg, sigmas)
    levels = algorithm.noise_levels(torch.Generator().manual_seed(0))
    steps = [int((sigmas == s).nonzero()) for s in levels]  # one per stratum [0,2), [2,4), ..., [10,12) (:1172-1180)
    assert len(steps) == 6 and all(2 * k <= i < 2 * k + 2 for k, i in enumerate(steps))
    first = build_algorithm(tiny(*AWM, "algorithm.awm.time_draw=discrete_wo_init"), sigma_schedule(4, 3.0).double())
    assert first.noise_levels(torch.Generator().manual_seed(0)).min() < 1  # never step 0 (sigma_0 = 1): :1198
    assert algorithm.weights(torch.tensor([-7.0, -5.0, 0.0, 2.5, 5.0])).tolist() == [-1.0, -1.0, 0.0, 0.5, 1.0]
    assert [algorithm.snapshot_decay(s) for s in (0, 1, 100, 900)] == [0.0, 0.001, 0.1, 0.3]  # :1412-1413


def test_the_certificate_holds_at_1e10():
    """``lean equivalence --set model.dtype=float64``: the update's gradient is the float64 formula's
    (``reference_unit_loss``) over the same clean samples and draws (1e-15 on flux, sd3 and wan)."""
    cfg = tiny("model.dtype=float64", "model.family=sd3", *AWM, "algorithm.awm.draws=2")
    report = run_equivalence(cfg)
    assert report["trains_on"] == "clean_samples" and "retain" not in report and "reweight" not in report
    assert report["reference"]["recompute"]["max_rel_grad_diff"] <= 1e-10 and passes(report, torch.float64)


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["train.schedule=retain"], r"train\.schedule='retain'.*algorithm\.name=awm.*re-noised"),
        (["train.schedule=reweight"], r"train\.schedule='reweight'.*algorithm\.name=awm.*re-noised"),
        (["train.optimizer_steps_per_iteration=2"], r"optimizer_steps_per_iteration=2.*on-policy.*set 1"),
        (["train.num_inner_epochs=2"], r"num_inner_epochs=2.*no inner epochs"),
        (["sample.sde_window=2"], r"sde_window=2.*ODE steps only"),
    ],
)
def test_what_cannot_run_awm_is_one_config_line(sets, words):
    with pytest.raises(ConfigError, match=words) as err:
        tiny(*AWM, *sets)
    assert "\n" not in str(err.value)


@pytest.mark.timeout(120)
def test_the_preset_cites_every_value_trains_and_moves_its_ema_policy():
    values = preset_value_lines("awm-sd3")
    assert len(values) >= 40 and uncited(values) == []
    trainer = Trainer(tiny_preset("awm-sd3", "sample.num_steps=4", "algorithm.awm.draws=2"))
    pipeline, start = trainer.pipeline, [p.detach().clone() for p in trainer.params]
    assert not pipeline.algorithm.rolls_out_snapshot  # the trained weights roll out (off_policy False, :883-884)
    metrics = trainer.iteration(0, "recompute").metrics
    assert math.isfinite(metrics["policy_loss"]) and math.isfinite(metrics["kl"])
    theta, ema = [p.detach().clone() for p in trainer.params], [v.clone() for v in pipeline.snapshot.values]
    assert any(not torch.equal(p, s) for p, s in zip(theta, start)) and all(map(torch.equal, ema, start))
    pipeline.refresh_snapshot(1)  # the EMA policy after 1 optimizer step: d = min(0.3, 0.001) (:1409-1419)
    for v, e, p in zip(pipeline.snapshot.values, ema, theta):
        torch.testing.assert_close(v, 0.001 * e + 0.999 * p)
