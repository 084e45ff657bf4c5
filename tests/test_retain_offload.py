"""Retain at the published sizes (``train.retain``): the kept graphs offloaded to host memory through the saved-tensor
hooks (``lean.schedules.offload``), and partial retention (the last m of each sample's K trained steps kept, the
others recomputed after the rewards). Both end every iteration with Recompute's weights (float64, 1e-10 relative),
for every m, with CFG and KL, per-sample step draws, both layouts and a hybrid (two sharded processes:
tests/test_hybrid.py)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_preset

from lean.config import ConfigError
from lean.schedules import Retain

TOLERANCE = 1e-10
FLOAT64 = ["model.dtype=float64", "sample.num_steps=4"]
ON_POLICY = ["train.on_policy=true"]  # one update per rollout: no hybrid


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _trained(cfg, iterations: int = 2) -> tuple[list[torch.Tensor], list[dict]]:
    """(the trainable weights after ``iterations`` iterations of ``cfg``'s schedule, each iteration's metrics)."""
    from lean.train import Trainer

    trainer = Trainer(cfg)
    metrics = [trainer.iteration(it, cfg.train.schedule).metrics for it in range(iterations)]
    return [p.detach().clone() for p in trainer.params], metrics


def _assert_recomputes_weights(name: str, extra: list[str], variants: list[list[str]]) -> list[list[dict]]:
    reference, _ = _trained(tiny_preset(name, *FLOAT64, *extra, "train.schedule=recompute"))
    seen = []
    for variant in variants:
        weights, metrics = _trained(tiny_preset(name, *FLOAT64, *extra, "train.schedule=retain", *variant))
        assert max(_rel(w, r) for w, r in zip(weights, reference)) < TOLERANCE, variant
        seen.append(metrics)
    return seen


@pytest.mark.timeout(240)
def test_every_m_with_and_without_offload_ends_with_recomputes_weights():
    """FlowGRPO's SD3 recipe on-policy (CFG with its gradient path, KL, K = 3): m = 1, 2 and all, each on the device
    and offloaded."""
    variants = [
        [f"train.retain.steps={m}", f"train.retain.offload={where}"]
        for m in (1, 2, "all")
        for where in ("device", "host")
    ]
    runs = _assert_recomputes_weights("flowgrpo-sd3", [*ON_POLICY, "algorithm.beta=0.04"], variants)
    for variant, metrics in zip(variants, runs):
        offloaded = "train.retain.offload=host" in variant
        assert ("offload_moved_mb" in metrics[0]) == offloaded
        if offloaded:  # copy mode on a CPU: every moved original freed as it was copied; each copy read back once
            first = metrics[0]
            assert first["offload_moved_mb"] > 0 and first["offload_device_live_mb"] == 0
            assert first["offload_fetched_mb"] == first["offload_moved_mb"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name,extra",
    [
        # DanceGRPO's per-sample step draws (rows of one step split into kept and recomputed), in the group layout
        # (each group backpropagated before the next rolls out), KL on, unsharded
        (
            "dancegrpo-flux",
            ["sample.num_steps=8", "parallel.shard=none", "parallel.layout=group", "algorithm.beta=0.01"],
        ),
        ("flowgrpo-sd3", []),  # a hybrid: the first update's kept and recomputed terms, then Recompute's later update
    ],
)
def test_partial_offloaded_retention_ends_with_recomputes_weights(name, extra):
    _assert_recomputes_weights(name, [*extra, *([] if name == "flowgrpo-sd3" else ON_POLICY)], [
        ["train.retain.steps=1", "train.retain.offload=host"],
        ["train.retain.steps=2"],
    ])  # fmt: skip


def test_partial_retention_keeps_the_last_m_trained_steps_of_each_sample():
    """DanceGRPO draws each sample's trained steps: Retain tracks the last m of each, the rest are recomputed, and
    the two sets split the trained terms."""
    from lean.train import Trainer

    sets = [*FLOAT64, *ON_POLICY, "sample.num_steps=8", "parallel.shard=none", "train.schedule=retain"]
    cfg = tiny_preset("dancegrpo-flux", *sets, "train.retain.steps=1")
    trainer = Trainer(cfg)
    tracked = []
    rolled = trainer.pipeline.roll_out(
        0, Retain, on_step=lambda s: tracked.append(s) if s.log_prob.requires_grad else None
    )
    partial, trained = rolled.schedule.partial, rolled.ctx.steps.trained
    assert partial is not None and rolled.ctx.steps_per_sample >= 2
    assert torch.equal(partial.kept | partial.recomputed, trained) and not (partial.kept & partial.recomputed).any()
    assert partial.kept.sum(1).tolist() == [1] * len(trained)
    last = [int(torch.nonzero(row).max()) for row in trained]
    assert [int(torch.nonzero(row)) for row in partial.kept] == last
    rows_at = {(int(r), s.index) for s in tracked for r in torch.arange(len(trained))[s.rows]}
    assert rows_at == {(b, i) for b, i in zip(range(len(trained)), last)}


def test_retain_options_are_refused_where_they_do_not_apply():
    with pytest.raises(ConfigError, match="applies to train.schedule=retain; reweight"):
        tiny_preset("flowgrpo-sd3", "train.schedule=reweight", "train.retain.offload=host")
    with pytest.raises(ConfigError, match="keeps no graph: that is train.schedule=recompute"):
        tiny_preset("flowgrpo-sd3", "train.schedule=retain", "train.retain.steps=0")
    with pytest.raises(ConfigError, match="must be an integer or one of|must be one of all, auto"):
        tiny_preset("flowgrpo-sd3", "train.schedule=retain", "train.retain.steps=most")


def test_an_offload_over_the_host_budget_stops_in_one_line():
    """The arena grows in chunks of 256 MiB: a budget of 1 MiB is passed at the first saved activation."""
    from lean.train import Trainer

    cfg = tiny_preset("flowgrpo-sd3", *FLOAT64, *ON_POLICY, "train.schedule=retain", "train.retain.offload=host")
    cfg.train.retain.host_memory_budget_mb = 1.0
    with pytest.raises(ConfigError, match=r"need more than 1 MiB of host memory per process") as err:
        Trainer(cfg).iteration(0, "retain")
    assert "\n" not in str(err.value) and "train.retain.steps" in str(err.value)


@pytest.mark.timeout(120)
def test_the_certificate_applies_retains_own_keys_to_retain(capsys, tmp_path):
    """`lean equivalence --set train.retain.offload=host` on the default config (train.schedule: recompute): the keys
    configure Retain's run of the certificate instead of being refused, and the report says Retain ran offloaded. An
    explicit other schedule with them is still refused (a run of it would ignore them)."""
    from lean.cli import main
    from lean.tools.equivalence import certificate_overrides

    assert certificate_overrides(["train.retain.offload=host"]) == [
        "train.retain.offload=host",
        "train.schedule=retain",
    ]
    assert (
        certificate_overrides(["train.schedule=reweight", "train.retain.offload=host"])[-1]
        == "train.retain.offload=host"
    )
    assert certificate_overrides(["model.dtype=float64"]) == ["model.dtype=float64"]
    sets = ["model.dtype=float64", "train.retain.offload=host", "sample.num_steps=3", "train.iterations=1"]
    assert main(["equivalence", *(a for s in sets for a in ("--set", s)), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "retain keeps steps=all of its graphs, offload=host" in out and "PASS" in out
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and report["retain_kept"]["offload"] == "host"
    assert report["retain"]["max_rel_grad_diff"] < 1e-10 and report["reweight"]["max_rel_grad_diff"] < 1e-10
