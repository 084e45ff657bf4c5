"""Group-relative advantages (float64 throughout): GRPO's targets, shared by the algorithms that normalise rewards
within a prompt's group.

Samples of the same prompt form a group. The advantage of sample ``n`` in group ``g`` is
``A_n = (r_n − mean_g) / (std + eps)`` with the std of the group (or of all rewards with ``global_std``): the
population std and eps = 1e-4 as in FlowGRPO, or the unbiased one (Bessel's n − 1) and eps = 1e-8 as in DanceGRPO.
In distributed training the rewards are gathered from all ranks first (groups may span ranks), the advantages
computed on the full batch, and each rank keeps its own block (``lean.parallel.layout.local_slice``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.config.registry import Registry

STD_ESTIMATORS: Registry[str] = Registry(
    "std estimator",
    [
        ("population", "sqrt(sum (r - mean)^2 / n) (FlowGRPO, numpy's default)"),
        ("unbiased", "sqrt(sum (r - mean)^2 / (n - 1)) (DanceGRPO, torch's default)"),
    ],
)


def _groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(r float64, inverse [N] mapping each sample to its group 0..G−1, group sizes [G], group means [G])."""
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        shapes = f"{list(rewards.shape)} and {list(group_ids.shape)}"
        raise ValueError(f"rewards/group_ids: need matching 1-D shapes, got {shapes}")
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.bincount(inverse).to(torch.float64)
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count
    return r, inverse, count, mean


def _group_std(r: Tensor, inverse: Tensor, count: Tensor, mean: Tensor, estimator: str = "population") -> Tensor:
    """Per-group ``sqrt(Σ(r − mean_g)² / n_g)`` [G], or ``/ (n_g − 1)`` for the unbiased estimator."""
    squares = torch.zeros_like(count).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    return (squares / (count if estimator == "population" else count - 1)).sqrt()


def _constant(r: Tensor, inverse: Tensor, count: Tensor) -> Tensor:
    """BoolTensor [G]: the group's rewards are all equal (max == min, immune to rounding in the mean)."""
    hi = torch.full_like(count, -torch.inf).scatter_reduce_(0, inverse, r, "amax")
    lo = torch.full_like(count, torch.inf).scatter_reduce_(0, inverse, r, "amin")
    return hi == lo


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    global_std: bool = False,
    clip: float | None = None,
    eps: float = 1e-4,
    std_estimator: str = "population",
    eps_floor: bool = False,
) -> Tensor:
    """``A_n = clamp((r_n − mean_{g(n)}) / (std + eps), −clip, clip)`` as float64 [N].

    ``std`` is the ``std_estimator`` std (``STD_ESTIMATORS``) of the sample's group, or of all N rewards with
    ``global_std``; with ``eps_floor`` the divisor is ``max(std, eps)`` instead (Flow-Factory's).
    Groups may differ in size and be interleaved in any order. A group whose rewards are all equal gets exactly 0
    (not a rounding residue of its mean divided by ``eps``).
    """
    if std_estimator not in STD_ESTIMATORS:
        raise ValueError(f"std_estimator={std_estimator!r}: must be one of {', '.join(STD_ESTIMATORS)}")
    unbiased = std_estimator == "unbiased"
    r, inverse, count, mean = _groups(rewards, group_ids)
    if unbiased and (count < 2).any():
        raise ValueError("std_estimator='unbiased' needs at least 2 samples per group")
    centered = r - mean[inverse]
    if global_std:
        std = r.std(unbiased=unbiased).expand_as(r)
    else:
        std = _group_std(r, inverse, count, mean, std_estimator)[inverse]
    divisor = std.clamp_min(eps) if eps_floor else std + eps
    advantages = torch.where(_constant(r, inverse, count)[inverse], 0.0, centered / divisor)
    return advantages if clip is None else advantages.clamp(-clip, clip)


def group_stats(rewards: Tensor, group_ids: Tensor) -> dict[str, Tensor | float]:
    """For logging: ``group_ids`` [G] (sorted unique ids), per-group ``mean``, population ``std`` and ``size`` [G],
    and ``zero_std_fraction``, the share of groups whose rewards are all equal (they carry no GRPO signal)."""
    r, inverse, count, mean = _groups(rewards, group_ids)
    constant = _constant(r, inverse, count)
    return {
        "group_ids": torch.unique(group_ids),
        "mean": mean,
        "std": torch.where(constant, 0.0, _group_std(r, inverse, count, mean)),
        "size": count,
        "zero_std_fraction": float(constant.double().mean()),
    }
