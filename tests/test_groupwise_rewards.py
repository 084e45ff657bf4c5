"""Group-wise rewards (lean/rewards/groupwise.py): Pref-GRPO's pairwise win rate, the group's samples held until it is
complete while the per-sample rewards stream, and the float64 certificate of every schedule on it."""

import pytest
import torch
from helpers import reference_gap, tiny

from lean.config import ConfigError
from lean.rewards import REWARDS, Scorer
from lean.rewards.groupwise import group_pairs, win_rates
from lean.run.async_scoring import RolloutScoring, ScoredBatch
from lean.tools.equivalence import passes, run_equivalence

WIN_RATE = ["reward.weights={win_rate: 1.0, jpeg_compressibility: 0.5}", "reward.win_rate.judge_reward=color_match"]
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def test_pairs_are_each_unordered_pair_once_earlier_first():
    assert group_pairs(3).tolist() == [[0, 1], [0, 2], [1, 2]]  # itertools.combinations: no self-pair, no repeat
    assert group_pairs(1).shape == (0, 2)


def test_win_rate_counts_wins_over_the_other_samples_and_ties_as_halves():
    pairs = group_pairs(3)  # (0,1) 0 wins, (0,2) tie, (1,2) 2 wins
    preferred = torch.tensor([0.9, 0.5, 0.2], dtype=torch.float64)
    assert win_rates(preferred, pairs, 3, "verdict").tolist() == [0.75, 0.0, 0.75]
    expected = torch.tensor([0.9 + 0.5, 0.1 + 0.2, 0.5 + 0.8], dtype=torch.float64) / 2
    torch.testing.assert_close(win_rates(preferred, pairs, 3, "probability"), expected, rtol=0, atol=1e-15)
    assert win_rates(torch.zeros(0), group_pairs(1), 1, "verdict").tolist() == [0.0]  # Pref-GRPO: 0 for no comparison


def test_the_bradley_terry_win_rate_ranks_as_its_reward_and_sums_to_half_the_group():
    cfg = tiny(*WIN_RATE, "reward.win_rate.credit=probability", "reward.win_rate.temperature=0.1")
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    rate = Scorer(cfg.reward, "cpu").rewards["win_rate"](images, [PROMPTS[0]] * 4)
    pointwise = REWARDS["color_match"](images, [PROMPTS[0]] * 4)
    assert torch.equal(rate.argsort(), pointwise.argsort()) and rate.sum().item() == pytest.approx(2.0)


def test_streamed_micro_batches_give_the_whole_batch_scores_and_hold_a_group_until_it_is_complete():
    cfg = tiny(*WIN_RATE)
    scorer = Scorer(cfg.reward, "cpu")
    group_ids = torch.tensor([0, 1, 0, 0, 1, 1])  # groups interleaved, micro-batches of 2 straddle them
    prompts = [PROMPTS[g] for g in group_ids.tolist()]
    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    whole, parts = scorer(images, prompts, group_ids)
    stream = scorer.stream(group_ids)
    scoring = RolloutScoring(lambda x, p: ScoredBatch(x, *_reordered(stream(x, p))), worker=None)
    for start in (0, 2):
        scoring.submit(images[start : start + 2], prompts[start : start + 2])
    partial, _ = scoring.rewards()
    assert partial.isnan().tolist() == [False, True, False, False]  # group 0 complete at row 3, group 1 waits
    scoring.submit(images[4:], prompts[4:])
    streamed = scoring.collect()
    assert torch.equal(streamed.rewards, whole) and all(torch.equal(streamed.parts[k], v) for k, v in parts.items())


def _reordered(scored):
    rows, total, parts = scored
    return total, parts, rows


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["reward.weights={win_rate: 1.0}"], "reward.win_rate.judge_reward"),
        ([*WIN_RATE, "reward.win_rate.judge_reward=win_rate"], "reward.win_rate.judge_reward"),
        ([*WIN_RATE, "reward.remote.win_rate.url=http://127.0.0.1:1"], "reward.remote.win_rate"),
        ([*WIN_RATE, "reward.win_rate.judge_reward=pickscore"], "reward.models.pickscore.folder"),
    ],
)
def test_what_a_group_wise_reward_refuses(sets, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny(*sets)


def test_a_group_wise_reward_needs_whole_groups_on_every_process():
    from lean.configure import validate

    with pytest.raises(ConfigError, match="train.prompts_per_iteration.*scores whole groups"):
        validate(tiny(*WIN_RATE, "train.prompts_per_iteration=3", "train.rollout_batch_size=2"), world_size=2)
    with pytest.raises(ConfigError, match="parallel.split_decode"):  # each process would score a share of a group
        tiny(*WIN_RATE, "parallel.sequence_parallel=2")
    tiny(*WIN_RATE, "parallel.sequence_parallel=2", "parallel.split_decode=false")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout",
    [
        # groups of 2 in micro-batches of 1: Retain and Reweight finish each group as its second sample is scored
        ["parallel.layout=group", "train.rollout_batch_size=1"],
        ["parallel.layout=slice"],  # the flat layout: the whole local batch is the unit
    ],
)
def test_every_schedule_trains_on_a_group_wise_reward_and_the_float64_certificate_passes(layout):
    cfg = tiny("model.dtype=float64", *WIN_RATE, *layout)
    report = run_equivalence(cfg)
    assert {"retain", "reweight"} <= set(report["reference"])
    assert passes(report, cfg.model.torch_dtype)
    assert reference_gap(report) < 1e-10


@pytest.mark.timeout(120)
def test_a_group_wise_reward_scored_beside_the_rollout_finishes_each_group_with_the_rewards_of_scoring_after_it():
    from lean.parallel.distributed import World
    from lean.run.iteration import build_pipeline
    from lean.schedules import SCHEDULES

    # groups of 4 in micro-batches of 2: a group's first micro-batch is held until its second is scored
    sets = [*WIN_RATE, "parallel.layout=group", "train.group_size=4", "train.rollout_batch_size=2"]
    rolled = {}
    for async_scoring in (False, True):
        pipeline = build_pipeline(tiny(*sets, f"reward.async_scoring={async_scoring}"), World())
        rolled[async_scoring] = pipeline.roll_out(0, SCHEDULES["reweight"])
    assert pipeline.scoring(rolled[True].ctx, rolled[True].batch).worker is not None
    assert rolled[True].finished is not None and rolled[True].finished.rows == 8  # each group as it was scored
    assert torch.equal(rolled[False].rewards, rolled[True].rewards) and not rolled[True].rewards.isnan().any()
    win_rate = rolled[True].parts["win_rate"].view(2, 4)
    assert torch.equal(win_rate.sum(dim=1), torch.full((2,), 2.0, dtype=torch.float64))  # G / 2 per group


@pytest.mark.timeout(120)
def test_a_judge_whose_server_is_down_keeps_the_whole_rollout(tmp_path):
    from helpers import free_port
    from safetensors.torch import load_file

    from lean.parallel.distributed import World
    from lean.rewards import RewardServerError
    from lean.run.iteration import build_pipeline
    from lean.schedules import SCHEDULES

    url = f"http://127.0.0.1:{free_port()}"
    served = [f"reward.remote.judge.url={url}", "reward.remote.judge.retries=0"]
    cfg = tiny("reward.weights={win_rate: 1.0}", "reward.win_rate.judge_reward=judge", *served, "parallel.layout=group")
    pipeline = build_pipeline(cfg, World())
    pipeline.failed_rollouts = tmp_path
    with pytest.raises(RewardServerError, match=f"reward judge: server {url}/score"):
        pipeline.roll_out(0, SCHEDULES["reweight"])
    saved = load_file(tmp_path / "0.safetensors")
    assert saved["latents"].shape[0] == saved["images"].shape[0] == cfg.samples_per_iteration
