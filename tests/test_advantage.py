"""Group-relative advantages against hand computations and their invariances."""

import math

import pytest
import torch

from lean.algorithms.groups import group_advantages, group_stats
from lean.parallel.layout import local_slice

EPS = 1e-4


def test_hand_computation():
    # group 0: [1, 2, 3] -> mean 2, population std sqrt(2/3); group 1: [0, 4] -> mean 2, std 2
    rewards = torch.tensor([1.0, 0.0, 2.0, 4.0, 3.0])
    ids = torch.tensor([0, 1, 0, 1, 0])
    s0 = math.sqrt(2 / 3)
    expected = [-1 / (s0 + EPS), -2 / (2 + EPS), 0.0, 2 / (2 + EPS), 1 / (s0 + EPS)]
    adv = group_advantages(rewards, ids)
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx(expected, abs=1e-12)
    # population, not unbiased: the unbiased std of [1, 2, 3] is 1
    assert adv[0].item() != pytest.approx(-1 / (1 + EPS))


def test_global_std():
    rewards = torch.tensor([1.0, 0.0, 2.0, 4.0, 3.0])
    ids = torch.tensor([0, 1, 0, 1, 0])
    std_all = math.sqrt(sum((r - 2.0) ** 2 for r in [1, 0, 2, 4, 3]) / 5)  # mean of all is 2
    expected = [(r - 2.0) / (std_all + EPS) for r in [1, 0, 2, 4, 3]]  # both group means are 2
    assert group_advantages(rewards, ids, global_std=True).tolist() == pytest.approx(expected, abs=1e-12)


def test_clip():
    rewards = torch.tensor([0.0, 0.0, 0.0, 10.0])
    ids = torch.zeros(4, dtype=torch.long)
    raw = group_advantages(rewards, ids)
    assert raw.max() > 1.5
    clipped = group_advantages(rewards, ids, clip=1.0)
    torch.testing.assert_close(clipped, raw.clamp(-1, 1))
    assert clipped.max() == 1.0


def test_zero_variance_group_is_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 5.0, 0.3, 0.3], dtype=torch.float64)
    ids = torch.tensor([2, 2, 2, 9, 4, 4])
    adv = group_advantages(rewards, ids)
    assert adv.eq(0).all()  # three constant groups, one of them a singleton
    stats = group_stats(rewards, ids)
    assert stats["zero_std_fraction"] == 1.0 and stats["std"].eq(0).all()


def test_uneven_interleaved_groups():
    rewards = torch.tensor([3.0, 10.0, 5.0, 20.0, 7.0, 1.0])
    ids = torch.tensor([-3, 42, -3, 42, -3, 7])
    adv = group_advantages(rewards, ids)
    s = math.sqrt(8 / 3)  # group -3: [3, 5, 7]
    assert adv.tolist() == pytest.approx([-2 / (s + EPS), -5 / (5 + EPS), 0.0, 5 / (5 + EPS), 2 / (s + EPS), 0.0])


def test_permutation_invariance():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 5, (24,), generator=g)
    perm = torch.randperm(24, generator=g)
    torch.testing.assert_close(group_advantages(rewards[perm], ids[perm]), group_advantages(rewards, ids)[perm])
    # per group: zero mean and unit population std up to eps
    adv = group_advantages(rewards, ids, eps=0.0)
    for gid in ids.unique():
        members = adv[ids == gid]
        if len(members) > 1:
            assert members.mean().item() == pytest.approx(0, abs=1e-12)
            assert members.std(unbiased=False).item() == pytest.approx(1, abs=1e-12)


def test_group_stats():
    stats = group_stats(torch.tensor([1.0, 0.0, 2.0, 4.0, 3.0, 6.0]), torch.tensor([0, 1, 0, 1, 0, 5]))
    assert stats["group_ids"].tolist() == [0, 1, 5]
    assert stats["mean"].tolist() == pytest.approx([2.0, 2.0, 6.0])
    assert stats["std"].tolist() == pytest.approx([math.sqrt(2 / 3), 2.0, 0.0])
    assert stats["size"].tolist() == [3, 2, 1]
    assert stats["zero_std_fraction"] == pytest.approx(1 / 3)


def test_local_slice():
    assert [local_slice(12, r, 3) for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    gathered = torch.arange(12)
    assert torch.equal(torch.cat([gathered[local_slice(12, r, 4)] for r in range(4)]), gathered)
    with pytest.raises(ValueError, match="n_total"):
        local_slice(10, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        local_slice(12, 3, 3)


def test_bad_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
