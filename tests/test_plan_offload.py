"""``lean plan``'s model of Retain's kept graphs offloaded to host memory and partially retained (train.retain,
docs/design/retain-offload.md section 4): the cost formulas, the rows, ``auto``'s choice, and the saved bytes an
offload moves. The published-size rows are asserted in tests/test_layout.py's meta-plan tests (one plan each)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lean.observe.metrics import SavedBytes
from lean.plan.cost import choose, exact_predictions, retain_choice, retain_variants
from lean.schedules import IterationCosts
from lean.schedules.offload import SavedTensorOffload
from lean.schedules.recompute import Recompute
from lean.schedules.retain import Retain

# one process's iteration: 10 steps, 4 trained per sample, 8 samples held at once (slice layout), act 100 MiB a step
COSTS = IterationCosts(
    n=10,
    k=4,
    local=8,
    f=1.0,
    fb=3.0,
    fb_one=0.5,
    ref=0.0,
    score=2.0,
    base_mb=1000.0,
    act_mb=100.0,
    act_one_mb=12.5,
    transient_mb=30.0,
    decode_mb=20.0,
    trainable_mb=10.0,
    train_rows_fraction=1.0,
    kl=False,
    per_row_grads=True,
    act_moved_mb=90.0,  # 10 MiB a step of parameters' views and leaves stay
    act_group_mb=45.0,  # two rollout micro-batches a step
    link_mb_s=1000.0,
)


def test_every_step_kept_on_the_device_is_retain_as_published():
    p = Retain.predict(COSTS)
    assert p.peak_memory_mb == 1000 + 4 * 100 + 30  # base + K act h + max(decode, transient)
    assert p.time_iteration_s == (10 - 4) * 1.0 + 4 * 3.0 + 2.0  # (n - K) f + K fb + score + ref
    assert (p.host_mb, p.d2h_mb, p.h2d_mb, p.exposed_transfer_s) == (0, 0, 0, 0)


@pytest.mark.parametrize("m", [0, 1, 2, 3, 4])
def test_partial_retention_is_linear_in_m_from_recompute_to_retain(m):
    """(n - m) f + K fb + score + ref: m = 0 is Recompute's time; memory holds m steps' graphs or, after them,
    Recompute's update."""
    p = Retain.predict(dataclasses.replace(COSTS, retained=m / 4))
    assert p.time_iteration_s == pytest.approx((10 - m) * 1.0 + 4 * 3.0 + 2.0)
    kept = 1000 + m * 100 + 30
    assert p.peak_memory_mb == (kept if m == 4 else max(kept, 1000 + COSTS.later_update_mb))
    if m == 0:
        assert p.time_iteration_s == pytest.approx(Recompute.predict(COSTS).time_iteration_s)


def test_offloaded_graphs_leave_two_groups_on_the_device_and_the_rest_on_the_host():
    p = Retain.predict(dataclasses.replace(COSTS, offload=True))
    assert p.host_mb == 4 * 90 and p.d2h_mb == p.h2d_mb == 4 * 90  # K act_moved h, moved once each way
    assert p.peak_memory_mb == 1000 + 4 * 10 + 2 * 45 + 30  # base + resident part + two groups + transient
    # a group copies in 45 / 1000 s, well inside a group's forward (f a / act_moved = 0.5 s) and the scoring: hidden
    assert p.exposed_transfer_s == 0 and p.time_iteration_s == Retain.predict(COSTS).time_iteration_s
    slow = Retain.predict(dataclasses.replace(COSTS, offload=True, link_mb_s=45.0))  # a group takes 1 s each way
    groups = 4 * 90 / 45  # 8; the last produced overlaps the scoring (2 s), the others one group's compute each
    d2h = (groups - 1) * (1.0 - 0.5)  # a group's forward: 0.5 s
    h2d = (groups - 1) * max(0.0, 1.0 - 1.0)  # a group's backward: (fb - f) / 2 = 1 s
    assert slow.exposed_transfer_s == pytest.approx(d2h + h2d)
    assert slow.time_iteration_s == pytest.approx(p.time_iteration_s + d2h + h2d)
    # the moved bytes count each view's span, act each storage once: moved can be above act, nothing is left then
    above = Retain.predict(dataclasses.replace(COSTS, offload=True, act_moved_mb=110.0, act_group_mb=55.0))
    assert above.peak_memory_mb == 1000 + 2 * 55 + 30


def test_the_rows_add_the_largest_m_that_fits_where_every_step_does_not():
    """At 1300 MiB every step on the device (1430) does not fit, 2 of 4 steps do (1230: max(1230, Recompute's
    1130)); offloaded, all 4 fit the device but not a 200 MiB host, where m = 2 (180 MiB) does."""
    rows = {(m, o): p for m, o, p in retain_variants(dataclasses.replace(COSTS, host_budget_mb=200.0), 1300.0)}
    assert set(rows) == {("all", "device"), (2, "device"), ("all", "host"), (2, "host")}
    assert rows[2, "device"].peak_memory_mb == 1230 and rows[2, "host"].host_mb == 180
    assert len(retain_variants(COSTS, 1e9)) == 2  # everything fits: m = K on and off the device


def test_auto_resolves_the_kept_steps_and_the_offload_among_every_schedule():
    from helpers import tiny

    cfg = tiny("train.schedule=auto", "train.retain.steps=auto", "train.retain.offload=auto")
    costs = dataclasses.replace(COSTS, host_budget_mb=200.0, trainable_mb=40.0)  # Reweight's 8 buffers: 1450 MiB
    predictions = exact_predictions(cfg, costs)
    assert "recompute" in predictions and "retain" not in predictions  # Recompute stays among the candidates
    assert len([s for s in predictions if s.startswith("retain:")]) == 4 * 2  # m = 1..K x off, host
    # every step offloaded would be fastest but needs 360 MiB of host: m = 2 offloaded fits both (m = 3 needs 270 of
    # host, m = 2 on the device 1230 MiB); at equal times the device's row comes first (nothing to move)
    decision = choose(predictions, 1200.0, costs.host_budget_mb)
    assert retain_choice(decision["choice"], cfg) == {"choice": "retain", "retain_steps": 2, "retain_offload": "host"}
    fastest = retain_choice(choose(predictions, 1e9)["choice"], cfg)
    assert fastest["choice"] in ("retain", "reweight")
    none_fits = retain_choice(choose(predictions, 1.0, 0.0)["choice"], cfg)  # the smallest: Recompute, keys reset
    assert none_fits == {"choice": "recompute", "retain_steps": "all", "retain_offload": "device"}
    explicit = exact_predictions(tiny("train.schedule=retain", "train.retain.offload=auto"), costs)
    assert set(explicit) == {"retain:steps=all:offload=device", "retain:steps=all:offload=host"}


def test_saved_bytes_split_off_what_the_offload_moves():
    """``SavedBytes``'s moved part is the offload hooks' count (the rule of ``stays_on_device``: the weight's view
    and the input leaf stay)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 6)
    saved, offload = SavedBytes(), SavedTensorOffload("count")
    with saved.watching():
        model(x).sum()
    with offload.saving():
        model(x).sum()
    total, moved = saved.take_split()
    assert moved == offload.stats.moved_bytes > 0 and total > moved


def test_train_start_resolves_the_auto_keys_into_the_runs_config():
    """``lean train`` with ``train.retain`` keys on ``auto``: the plan's choice sets them (a schedule other than
    Retain takes the defaults), and the run's pipeline is built from the resolved config."""
    from helpers import tiny

    from lean.parallel.distributed import World
    from lean.train import Trainer, resolve_schedule

    trainer = Trainer(tiny("train.schedule=retain", "train.retain.steps=auto", "train.retain.offload=auto"), World())
    schedule, decision = resolve_schedule(trainer)
    retain = trainer.pipeline.cfg.train.retain
    assert schedule == "retain" and (retain.steps, retain.offload) == (
        decision["retain_steps"],
        decision["retain_offload"],
    )
    assert trainer.cfg is trainer.pipeline.cfg and "auto" not in (retain.steps, retain.offload)


@pytest.mark.parametrize("extra", [[], ["train.retain.steps=1"]])
def test_the_plans_bytes_are_what_an_offloaded_iteration_moves(extra):
    """``offload_bytes`` (the plan's bytes moved each way and held on the host) against one offloaded iteration of tiny
    FLUX (CPU: copy mode), every trained step kept and one of them: the moved bytes, the bytes fetched back and the
    host arena's high water within 10% of the plan (measured: 1370256 moved, 1370112 planned, every step kept), and
    on the device side no moved activation left alive (copy mode: each original is freed when copied; the plan's
    two-group window is the CUDA copies in flight). DanceGRPO's tiny preset (per-sample draws, a hybrid): 3% apart."""
    from helpers import tiny

    from lean.plan.cost import offload_bytes
    from lean.train import Trainer

    cfg = tiny("model.family=flux", "train.schedule=retain", "train.retain.offload=host", *extra)
    metrics = Trainer(cfg).iteration(0, "retain", measure_memory=False).metrics
    planned, mib = offload_bytes(cfg), 2.0**20
    assert planned["d2h_bytes"] == planned["h2d_bytes"]
    assert metrics["offload_moved_mb"] * mib == pytest.approx(planned["d2h_bytes"], rel=0.10)
    assert metrics["offload_fetched_mb"] * mib == pytest.approx(planned["h2d_bytes"], rel=0.10)
    assert metrics["offload_host_mb"] * mib == pytest.approx(planned["host_bytes"], rel=0.10)
    assert metrics["offload_device_live_mb"] == 0


def test_a_meta_count_is_kept_on_disk_for_the_next_process(tmp_path, monkeypatch):
    """lean.plan.count_cache: a count stored under its key (and the code's version) is read back as it was, with
    its integer degrees and boolean checkpointing keys; another key, or the cache off, finds nothing."""
    from lean.plan import count_cache

    monkeypatch.setenv(count_cache.CACHE_ENV, str(tmp_path / "counts"))
    counts = {1: {False: {"t_forward": 2.5e12, "activation_mb": 12.0}, True: {"t_forward": 3e12, "activation_mb": 1}}}
    key = ('{"model": {"family": "flux"}}', (1,), 8, (1,))
    assert count_cache.load(key) is None
    count_cache.store(key, counts)
    assert count_cache.load(key) == counts
    assert count_cache.load((*key[:2], 4, key[3])) is None  # another GPU count: another key
    monkeypatch.setenv(count_cache.CACHE_ENV, "0")
    assert count_cache.load(key) is None
