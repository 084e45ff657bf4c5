"""Scoring during the rollout (``lean.run.async_scoring``, ``reward.async_scoring``): the same rewards and trajectories
as scoring afterwards, the scoring time split into its hidden and exposed parts, and a failed reward server still keeps
the whole rollout."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import free_port, tiny

from lean.parallel.distributed import World
from lean.rewards import RewardServerError
from lean.run.iteration import build_pipeline
from lean.schedules import SCHEDULES

# 2 prompts x 4 samples in micro-batches of 2: four micro-batches, three of them scored while the next rolls out
CHUNKED = ["train.group_size=4", "train.rollout_batch_size=2", "train.train_batch_size=8"]


def roll_out(schedule: str, *overrides: str):
    pipeline = build_pipeline(tiny(*CHUNKED, *overrides), World())
    return pipeline, pipeline.roll_out(0, SCHEDULES[schedule])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "schedule, dtype", [("recompute", "float32"), ("retain", "float32"), ("reweight", "float32"), ("retain", "float64")]
)
def test_async_scoring_gives_the_rewards_of_synchronous_scoring(schedule, dtype):
    # float64: the worker decodes while the rollout's thread is in float64_scope (lean.models.precision), whose
    # Tensor.float patch once reached the worker too and left its images float64 (rewards off by 1e-10)
    _, sync = roll_out(schedule, f"model.dtype={dtype}", "reward.async_scoring=false")
    pipeline, concurrent = roll_out(schedule, f"model.dtype={dtype}")
    assert pipeline.scoring(concurrent.ctx, concurrent.batch).worker is not None  # the run above scored concurrently
    assert torch.equal(sync.final, concurrent.final)
    assert torch.equal(sync.rewards, concurrent.rewards) and sync.rewards.dtype == torch.float64
    assert sync.parts.keys() == concurrent.parts.keys()
    for name in sync.parts:
        assert torch.equal(sync.parts[name], concurrent.parts[name])
    seconds = concurrent.ctx.timer.seconds
    assert seconds["reward"] > 0 and 0 < seconds["reward_exposed"]
    assert sync.ctx.timer.seconds["reward_exposed"] >= sync.ctx.timer.seconds["reward"]  # scored after the rollout


@pytest.mark.timeout(120)
def test_scoring_runs_in_a_worker_thread_while_the_next_micro_batch_rolls_out():
    pipeline = build_pipeline(tiny(*CHUNKED), World())
    decode, seen = pipeline.policy.decode, []

    def recording_decode(final):
        seen.append((threading.current_thread().name, final.shape[0]))
        return decode(final)

    pipeline.policy.decode = recording_decode
    pipeline.roll_out(0, SCHEDULES["retain"])
    assert [size for _, size in seen] == [2, 2, 2, 2]
    assert all(name.startswith("lean-score") for name, _ in seen)


@pytest.mark.timeout(120)
def test_scoring_is_synchronous_with_one_micro_batch_or_when_switched_off():
    pipeline = build_pipeline(tiny(), World())  # 4 samples, rollout micro-batch 4
    batch = pipeline.local_batch(0)
    assert pipeline.scoring(pipeline.context(batch, pipeline.embed(batch)), batch).worker is None
    pipeline = build_pipeline(tiny(*CHUNKED, "reward.async_scoring=false"), World())
    batch = pipeline.local_batch(0)
    assert pipeline.scoring(pipeline.context(batch, pipeline.embed(batch)), batch).worker is None


@pytest.mark.timeout(120)
def test_a_failed_server_during_async_scoring_keeps_the_whole_rollout(tmp_path):
    from safetensors.torch import load_file

    url = f"http://127.0.0.1:{free_port()}"
    cfg = tiny(*CHUNKED, "reward.weights={ocr: 1.0}", f"reward.remote.ocr.url={url}", "reward.remote.ocr.retries=0")
    pipeline = build_pipeline(cfg, World())
    pipeline.failed_rollouts = tmp_path
    with pytest.raises(RewardServerError, match=f"reward ocr: server {url}/score"):
        pipeline.roll_out(0, SCHEDULES["retain"])
    saved = load_file(tmp_path / "0.safetensors")
    assert saved["latents"].shape[0] == saved["images"].shape[0] == cfg.samples_per_iteration


@pytest.mark.parametrize("rows,expected", [(4, [(0, 2), (2, 4)]), (3, [(0, 1), (1, 3)]), (1, [(0, 0), (0, 1)])])
def test_a_sequence_parallel_group_splits_the_decode_in_contiguous_shares(rows, expected):
    """``parallel.split_decode``: each process of a group of 2 takes a contiguous share, sizes differing by at most
    one (an empty share when the micro-batch is smaller than the group); one process takes every row."""
    shares = [World(rank=r, size=4, sequence_parallel=2).sequence_share(rows) for r in (2, 3)]  # group 1: ranks 2, 3
    assert [(s.start, s.stop) for s in shares] == expected
    assert World().sequence_share(rows) == slice(0, rows)


def test_shares_scored_by_the_group_merge_in_row_order_and_an_error_reaches_every_process():
    from lean.run.async_scoring import ScoredBatch, merge_shares

    mine = ScoredBatch(torch.zeros(1, 3, 4, 4), torch.tensor([0.5], dtype=torch.float64), decode_s=0.25)
    every = [
        (torch.tensor([0.1, 0.2], dtype=torch.float64), {"clip": torch.tensor([1.0, 2.0])}, None),
        (torch.zeros(0, dtype=torch.float64), {}, None),  # an empty share
        (torch.tensor([0.5], dtype=torch.float64), {"clip": torch.tensor([3.0])}, None),
    ]
    merged = merge_shares(mine, every)
    assert merged.rewards.tolist() == [0.1, 0.2, 0.5] and merged.parts["clip"].tolist() == [1.0, 2.0, 3.0]
    assert merged.images is mine.images and merged.decode_s == 0.25 and merged.error is None
    failed = merge_shares(mine, [every[0], (None, {}, RewardServerError("server down"))])
    assert isinstance(failed.error, RewardServerError) and failed.rewards is None
