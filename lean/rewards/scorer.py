"""A run's rewards, built once: :class:`Scorer` turns ``reward`` config into callables and sums them.

``total = Σ_name weights[name] · r_name(images, prompts)`` (float64 [B]), with every unweighted component. Each
``r_name`` is, in this order: a :class:`lean.rewards.remote.RemoteReward` when ``reward.remote`` names it; a
:class:`lean.rewards.pickle_servers.PickleServerReward` when ``reward.pickle_servers`` does;
:class:`lean.rewards.vlm_judge.VLMJudge` when ``reward.judges`` does; a model reward (``MODEL_REWARDS``) loaded from
``reward.models.<name>`` onto its device; a built-in function (``REWARDS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.rewards.base import MODEL_REWARDS, REWARDS, RewardFn
from lean.rewards.pickle_servers import PickleServerReward
from lean.rewards.remote import RemoteReward
from lean.rewards.vlm_judge import VLMJudge

if TYPE_CHECKING:
    from lean.rewards.options import RewardConfig


def build_reward(name: str, cfg: RewardConfig, device: torch.device | str, remote: bool = True) -> RewardFn:
    """The reward ``name`` of ``cfg`` ready to call (a model reward loads its model here); ``remote=False`` builds
    it in this process even when ``reward.remote`` names it (what its server does)."""
    if remote and name in cfg.remote:
        return RemoteReward(name, cfg.remote[name])
    if remote and name in cfg.pickle_servers:
        return PickleServerReward(name, cfg.pickle_servers[name])
    if name in cfg.judges:
        return VLMJudge(name, cfg.judges[name])
    if name in MODEL_REWARDS:
        if name not in cfg.models:
            raise ValueError(f"reward {name!r} loads a model: set reward.models.{name}.folder")
        return MODEL_REWARDS[name](cfg.models[name], device)
    return REWARDS.get_or_raise(name)


def weighted_sum(
    rewards: Mapping[str, RewardFn], weights: Mapping[str, float], images: Tensor, prompts: list[str]
) -> tuple[Tensor, dict[str, Tensor]]:
    """(``Σ weights[name] · rewards[name](images, prompts)`` float64 [B], each unweighted component on the host)."""
    components = {name: rewards[name](images, prompts).cpu().to(torch.float64) for name in weights}
    total = torch.zeros(images.shape[0], dtype=torch.float64)
    for name, weight in weights.items():
        total += weight * components[name]
    return total, components


class Scorer:
    """The weighted rewards of ``cfg`` (validated), each built once; ``device`` is where model rewards run unless
    their ``reward.models.<name>.device`` says otherwise."""

    def __init__(self, cfg: RewardConfig, device: torch.device | str):
        self.weights = dict(cfg.weights)
        self.rewards = {name: build_reward(name, cfg, device) for name in self.weights}

    def __call__(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        return weighted_sum(self.rewards, self.weights, images, prompts)


def compute_rewards(
    weights: Mapping[str, float], images: Tensor, prompts: list[str]
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`weighted_sum` of built-in (weight-free) rewards; a model reward needs a :class:`Scorer`."""
    unknown = [name for name in weights if name not in REWARDS]
    if unknown:
        kind = "loads a model (use a Scorer)" if unknown[0] in MODEL_REWARDS else "unknown"
        raise ValueError(f"reward {unknown[0]!r}: {kind}; known: {', '.join(sorted(REWARDS))}")
    return weighted_sum(REWARDS, weights, images, prompts)
