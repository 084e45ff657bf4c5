"""DiffusionNFT and online DPO (lean/algorithms/nft.py, dpo.py): each loss equals its float64 formula reference,
written in another arrangement, in value and gradient; the pairs and the optimality probability are the sources';
the old policy and the reference move as the sources move them; what cannot run them is one config line."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from lean.algorithms import build_algorithm
from lean.algorithms.dpo import best_and_worst
from lean.algorithms.nft import old_policy_decay
from lean.config import ConfigError
from lean.tools.equivalence import TwinVelocities, run_equivalence
from lean.train import Trainer

F64 = ["model.dtype=float64", "model.family=sd3"]


def _twin_setup(*sets: str):
    trainer = Trainer(tiny(*F64, *sets))
    policy = trainer.policy
    g = torch.Generator().manual_seed(3)
    policy.perturb_lora_(0.05, g)
    params = [p for _, p in policy.trainable_parameters()]
    snapshot = [p.detach() + 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    emb = policy.encode_prompts(trainer.cfg.train.prompts[:4])
    velocities = TwinVelocities(policy, emb, trainer.cfg, snapshot)
    algorithm = build_algorithm(trainer.cfg, trainer.pipeline.sigmas.double())
    x0 = torch.randn(4, *policy.init_latents([g] * 1, torch.float64).shape[1:], generator=g, dtype=torch.float64)
    return algorithm, velocities, params, x0, g


def _both(algorithm, velocities, params, x0, rows, targets, t, noise):
    out = {}
    for name, fn in (("lean", algorithm.unit_loss), ("formula", algorithm.reference_unit_loss)):
        loss = fn(velocities, x0, rows, targets, t, noise)
        total = loss.total(algorithm.kl_weight) if hasattr(loss, "total") else loss
        grads = torch.autograd.grad(total.sum(), params)
        out[name] = (total.detach(), torch.cat([g.flatten() for g in grads]))
    return out


def test_nft_loss_equals_its_velocity_form_with_an_old_policy_apart():
    algorithm, velocities, params, x0, g = _twin_setup("algorithm.name=nft", "algorithm.nft.beta=0.3")
    rows, targets = torch.arange(4), torch.tensor([2.0, -0.7, 6.0, 0.0], dtype=torch.float64)
    t = torch.tensor([0.9, 0.5, 0.2, 1.0], dtype=torch.float64)
    out = _both(algorithm, velocities, params, x0, rows, targets, t, torch.randn(x0.shape, generator=g))
    torch.testing.assert_close(out["lean"][0], out["formula"][0], rtol=1e-10, atol=0)
    torch.testing.assert_close(out["lean"][1], out["formula"][1], rtol=1e-10, atol=1e-14)
    assert out["lean"][1].abs().max() > 0


def test_dpo_loss_equals_its_per_sample_softplus_form():
    algorithm, velocities, params, x0, g = _twin_setup("algorithm.name=dpo", "algorithm.dpo.beta=30")
    rows, targets = torch.arange(4), torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    t = torch.tensor([0.8, 0.3], dtype=torch.float64)
    out = _both(algorithm, velocities, params, x0, rows, targets, t, torch.randn((2, *x0.shape[1:]), generator=g))
    torch.testing.assert_close(out["lean"][0], out["formula"][0], rtol=1e-10, atol=0)
    torch.testing.assert_close(out["lean"][1], out["formula"][1], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", ["nft", "dpo"])
def test_the_certificate_passes_for_the_update_and_fails_a_wrong_one(name, monkeypatch):
    cfg = tiny(*F64, f"algorithm.name={name}", "train.group_size=3")
    report = run_equivalence(cfg)
    own = report["reference"]["recompute"]
    assert own["max_rel_grad_diff"] <= 1e-10 and "retain" not in report and report["trains_on"] == "clean_samples"
    cls = type(build_algorithm(cfg, None))
    original = cls.unit_loss

    def off(self, *args):  # a loss 1% off: the certificate must see it
        loss = original(self, *args)
        loss.policy = loss.policy * 1.01
        return loss

    monkeypatch.setattr(cls, "unit_loss", off)
    assert run_equivalence(cfg)["reference"]["recompute"]["max_rel_grad_diff"] > 1e-3


def test_dpo_pairs_the_best_and_the_worst_as_flow_grpo_does():
    rewards = torch.tensor([0.1, 0.9, 0.9, 0.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    targets = best_and_worst(rewards, groups)
    # first index on a tie; a group of equal rewards still pairs its second (chosen) with its first (rejected)
    assert targets.tolist() == [0, 1, 0, -1, -1, 1, 0, 0]
    algorithm = build_algorithm(tiny("algorithm.name=dpo"), None)
    assert algorithm.units(targets, groups).tolist() == [[1, 3], [5, 4]]


def test_nft_optimality_and_old_policy_decays_are_the_scripts():
    algorithm = build_algorithm(tiny("algorithm.name=nft"), None)
    r = algorithm.optimality(torch.tensor([-7.0, -5.0, 0.0, 2.5, 5.0]))
    assert r.tolist() == [0.0, 0.0, 0.5, 0.75, 1.0]
    assert [old_policy_decay("linear_capped", s) for s in (0, 100, 900)] == [0.0, 0.1, 0.5]
    assert [old_policy_decay("delayed", s) for s in (74, 75, 95, 500)] == [0.0, 0.0, 0.0075 * 20, 0.999]


def test_nft_samples_with_its_old_policy_which_follows_the_trained_one():
    trainer = Trainer(tiny("algorithm.name=nft", "algorithm.nft.old_decay=linear_capped", "train.iterations=1"))
    pipeline, state = trainer.pipeline, trainer.state
    assert state.snapshot is pipeline.snapshot and "snapshot" in state.state_dict()
    trainer.iteration(0, "recompute")
    theta = [p.detach().clone() for p in trainer.params]
    old = [v.clone() for v in pipeline.snapshot.values]
    assert any((a - b).abs().max() > 0 for a, b in zip(theta, old))  # the update moved theta, not the old policy
    pipeline.refresh_snapshot(1)  # after 1 optimizer step: eta = 0.001
    for v, a, b in zip(pipeline.snapshot.values, old, theta):
        torch.testing.assert_close(v, 0.001 * a + 0.999 * b)


@pytest.mark.parametrize(("name", "schedule"), [("nft", "retain"), ("dpo", "reweight")])
def test_what_cannot_run_a_clean_sample_algorithm_is_one_config_line(name, schedule):
    with pytest.raises(ConfigError, match=rf"train\.schedule='{schedule}'.*algorithm\.name={name}.*re-noised"):
        tiny(f"algorithm.name={name}", f"train.schedule={schedule}")


@pytest.mark.parametrize(
    ("sets", "terms", "schedules"),
    [
        (["algorithm.name=nft"], 3, {"recompute"}),  # int(4 x 0.99) = 3 draws, its own update only
        (["algorithm.name=dpo"], 3, {"recompute"}),
        (["algorithm.name=mixgrpo", "algorithm.mixgrpo.window=2"], 2, {"recompute", "retain", "reweight"}),
    ],
)
def test_plan_counts_each_algorithms_terms_and_schedules(sets, terms, schedules):
    """lean plan's cost model: K is the algorithm's (NFT's and DPO's draws, MixGRPO's window), and the schedules it
    predicts for are those that compute the algorithm's gradient."""
    from lean.plan.cost import combinations, iteration_costs, probe

    trainer = Trainer(tiny(*sets))
    inp = trainer.plan_input()
    measured = probe(inp)
    assert iteration_costs(inp, measured).k == terms
    rows = combinations(inp, {("none", False): measured})
    assert {r["schedule"] for r in rows} == schedules


def test_dpo_needs_whole_groups_on_every_process():
    from lean.configure import validate

    cfg = tiny("algorithm.name=dpo", "train.prompts_per_iteration=3")
    validate(cfg, world_size=3)
    with pytest.raises(ConfigError, match=r"train\.prompts_per_iteration=3.*whole groups.*2 data ranks"):
        validate(cfg, world_size=2)
