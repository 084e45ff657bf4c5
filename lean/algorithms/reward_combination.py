"""How several rewards become one advantage per sample (``algorithm.reward_combination``), float64 throughout.

A run's rewards r_1 .. r_R (``reward.weights``: unweighted columns in the order of its keys, weights w_k) are combined
before or after the group normalisation. With norm_g the group advantage of ``lean.algorithms.groups``,
(x_n - mean_g x) / (std + adv_eps) under ``adv_std`` and ``global_std``, for sample n of group g:

    sum         A_n = norm_g(sum_k w_k r_k)_n                             (FlowGRPO, DanceGRPO: the weighted reward)
    per_reward  A_n = sum_k w_k norm_g(r_k)_n                             (MixGRPO's advantage_aggr)
    gdpo        c_n = sum_k w_k (r_kn - mean_g r_k) / max(std_g r_k, 1e-6),
                A_n = (c_n - mean c) / max(std c, 1e-6)                   (Flow-Factory's default, GDPO)
    pref_gdpo   c_n = sum_k w_k (r_kn - mean_g r_k) / (ustd_g r_k + 1e-8),
                A_n = (c_n - mean c) / (ustd c + 1e-8)                    (Pref-GRPO's GDPO; ustd: unbiased)

then A is clamped to [-adv_clip_max, adv_clip_max]. Sources:

* per_reward: github.com/Tencent-Hunyuan/MixGRPO at e5cdd6a, fastvideo/train_grpo_flux.py:429-456: each reward's
  group std is torch's unbiased one plus 1e-8 (the mixgrpo presets' ``adv_std: unbiased``, ``adv_eps: 1e-8``), the
  normalised rewards weighted and summed, clamped in the loss (:567-571). The script computes in float32 (:411-412).
* gdpo: github.com/X-GenGroup/Flow-Factory at a0b2bc5, src/flow_factory/advantage/advantage_processor.py:451-470
  (``compute_gdpo``): numpy's population std of each reward in its group, floored at 1e-6 (not added), the weights
  applied to the normalised rewards, then every sample of the batch (all processes) renormalised by the batch's mean
  and population std floored at 1e-6 (:242-263, ``_global_mean_std``); the clamp is the trainer's
  (trainers/grpo.py:266-269). Its per-group std and floors are fixed: ``adv_std`` and ``adv_eps`` do not apply, and
  it ignores ``global_std`` (lean refuses it). Flow-Factory computes in float32 and, with whole groups on each
  process, takes the batch's std as sqrt(E[c^2] - E[c]^2) from an all-reduce (:251-259): the same in exact
  arithmetic.
* pref_gdpo: github.com/CodeGoat24/Pref-GRPO at 3e787f6, fastvideo/rewards/dispatcher.py:614-703
  (``compute_weighted_advantages`` with ``apply_gdpo``): each reward normalised in its group by torch's unbiased std
  plus 1e-8 (:628-638), weighted and summed (:697), then the batch's (all processes, :698-702) mean subtracted and
  its unbiased std plus 1e-8 divided out; clamped in the loss (train_flux.py:723-727). In float32 there.

A group whose rewards are all equal carries no signal: its normalised reward is exactly 0 (the sources divide the
rounding residue of its mean by their eps), and under gdpo a sample whose c is exactly 0 keeps A = 0 (the batch mean
it would subtract is 0 up to rounding: every group's normalised rewards sum to 0). So the zero-advantage filter sees
the same samples under every combination. Under gdpo every advantage depends on the whole batch, as under
``global_std``: the group layout finishes after the whole rollout (``lean.parallel.layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.algorithms.groups import group_advantages
from lean.algorithms.options import BATCH_RENORMALISED
from lean.config.registry import Registry

if TYPE_CHECKING:
    from lean.algorithms.options import AlgorithmConfig

REWARD_COMBINATIONS: Registry[str] = Registry(
    "reward combination",
    [
        ("sum", "the weighted sum of the rewards is normalised in its group (FlowGRPO, DanceGRPO)"),
        ("per_reward", "each reward is normalised in its group, then weighted and summed (MixGRPO)"),
        (
            "gdpo",
            "each reward normalised in its group, weighted, summed, then renormalised over the batch (Flow-Factory)",
        ),
        ("pref_gdpo", "gdpo with torch's unbiased std + 1e-8 in the group and over the batch (Pref-GRPO)"),
    ],
)
GDPO_STD_FLOOR = 1e-6  # advantage_processor.py:463 and :259/:262 max(std, 1e-6)
PREF_GDPO_EPS = 1e-8  # Pref-GRPO dispatcher.py:637 and :701 std() + 1e-8


def weighted_normalised(components: Tensor, weights: Sequence[float], group_ids: Tensor, **norm) -> Tensor:
    """sum_k w_k norm_g(r_k) [N] (float64): each reward column of ``components`` [N, R] normalised in its group
    (``group_advantages`` with ``norm``), weighted and summed."""
    combined = torch.zeros(components.shape[0], dtype=torch.float64)
    for k, weight in enumerate(weights):
        combined += group_advantages(components[:, k], group_ids, **norm) * weight
    return combined


def gdpo_advantages(components: Tensor, weights: Sequence[float], group_ids: Tensor) -> Tensor:
    """GDPO's unclipped advantages [N] of rewards ``components`` [N, R] (module docstring)."""
    combined = weighted_normalised(components, weights, group_ids, eps=GDPO_STD_FLOOR, eps_floor=True)
    std = combined.std(unbiased=False).clamp_min(GDPO_STD_FLOOR)
    return torch.where(combined == 0, 0.0, (combined - combined.mean()) / std)


def pref_gdpo_advantages(components: Tensor, weights: Sequence[float], group_ids: Tensor) -> Tensor:
    """Pref-GRPO's GDPO advantages [N], unclipped (module docstring); a sample whose c is exactly 0 (its group's
    rewards all equal) keeps A = 0, as under gdpo."""
    combined = weighted_normalised(components, weights, group_ids, eps=PREF_GDPO_EPS, std_estimator="unbiased")
    return torch.where(combined == 0, 0.0, (combined - combined.mean()) / (combined.std() + PREF_GDPO_EPS))


def combined_advantages(
    cfg: AlgorithmConfig,
    rewards: Tensor,
    group_ids: Tensor,
    components: Tensor | None,
    weights: Sequence[float],
) -> Tensor:
    """Every sample's clamped advantage [N] (float64) under ``cfg.reward_combination``: ``rewards`` [N] the weighted
    sum (what ``sum`` reads), ``components`` [N, R] each reward's unweighted values, columns in ``weights``' order
    (what the others read)."""
    how, clip = cfg.reward_combination, cfg.adv_clip_max
    norm = {"global_std": cfg.global_std, "eps": cfg.adv_eps, "std_estimator": cfg.adv_std}
    if how == "sum":
        return group_advantages(rewards, group_ids, clip=clip, **norm)
    if components is None or components.ndim != 2 or components.shape != (rewards.shape[0], len(weights)):
        got = None if components is None else list(components.shape)
        raise ValueError(
            f"reward_combination={how!r}: needs each reward's values [{len(rewards)}, {len(weights)}], got {got}"
        )
    components = components.to(torch.float64)
    if how in BATCH_RENORMALISED:
        renormalised = gdpo_advantages if how == "gdpo" else pref_gdpo_advantages
        return renormalised(components, weights, group_ids).clamp(-clip, clip)
    return weighted_normalised(components, weights, group_ids, **norm).clamp(-clip, clip)  # per_reward
