"""Ready for a GPU without one: no device mixing anywhere in an iteration, no host sync inside the rollout loop.

The iteration runs with the policy on the ``meta`` device under ``device_checks.DeviceCheck``, which raises where CUDA
would ("Expected all tensors to be on the same device") and counts where CUDA would make the host wait."""

from __future__ import annotations

import pytest
import torch
from device_checks import META, DeviceCheck, DeviceMixing
from helpers import tiny

from lean.parallel.distributed import World
from lean.run.iteration import IterationPipeline, build_pipeline
from lean.run.optimizer import TrainState
from lean.schedules import SCHEDULES

CASES = {  # guidance, KL, per-sample step selection (CFG); a video latent, an SDE window (no CFG)
    "flux": ["algorithm.beta=0.04", "sample.timestep_selection=random", "sample.timestep_fraction=0.6"],
    "wan": ["model.family=wan", "sample.cfg=false", "sample.sde_window=2", "sample.num_steps=6", "algorithm.beta=0.04"],
}


def meta_pipeline(*overrides: str) -> tuple[IterationPipeline, TrainState]:
    cfg = tiny("reward.weights={jpeg_compressibility: 1.0}", *overrides)  # a reward computed from downloaded pixels
    world = World(device=META)
    pipeline = build_pipeline(cfg, world)
    return pipeline, TrainState(pipeline.policy.trainable_parameters(), cfg.optimizer, cfg.ema, world)


def test_the_check_catches_what_cuda_refuses():
    with DeviceCheck(), pytest.raises(DeviceMixing):
        torch.ones(3, device=META) * torch.ones(3)
    with DeviceCheck(), pytest.raises(DeviceMixing):  # meta alone lets this one through
        torch.ones(2, 3) @ torch.ones(3, 4, device=META)
    with DeviceCheck() as check:
        torch.ones(3, device=META) * torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar: fine on CUDA too
        bool(torch.ones(3, device=META).sum() > 0)
        torch.ones(3, device=META)[torch.tensor([0, 2])]
        torch.ones(3).to(META)
        torch.ones(3).to(META, non_blocking=True)
    assert check.syncs == {"read": 1, "cpu index": 1, "blocking upload": 1}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_an_iteration_never_mixes_devices(case, schedule):
    pipeline, state = meta_pipeline(*CASES[case])
    with DeviceCheck():
        metrics = pipeline.run(0, schedule, state.step, measure_memory=False).metrics
    assert "grad_norm" in metrics


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_rollout_loop_never_waits_for_the_device(schedule):
    """The host syncs of a rollout do not grow with its steps: none inside the loop. Rollouts of 3 and 5 steps (a
    first, middle and last step each; a sync per step, or per middle step, would differ by 2): on the meta device an
    op costs milliseconds of Python, so every step counts."""
    counts = {}
    for steps in (3, 5):
        pipeline, _ = meta_pipeline(f"sample.num_steps={steps}", "algorithm.beta=0.04")
        batch = pipeline.local_batch(0)
        ctx = pipeline.context(batch, pipeline.embed(batch))
        with DeviceCheck(record_where=True) as check:
            pipeline.rollout(batch, ctx, SCHEDULES[schedule](ctx))
        counts[steps] = (sum(check.syncs.values()), check.where)
    assert counts[3][0] == counts[5][0], counts[5][1]
