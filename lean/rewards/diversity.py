"""Diversity inside a group: each sample's cosine distance to the nearest other sample of its prompt, in a feature
space of its image. A group-wise reward (:class:`lean.rewards.base.GroupReward`): a sample's value depends on the rest
of its group, so it is computed once the group is complete.

GARDO (yifan123/flow_grpo at 94e23ee) computes it in ``flow_grpo/stat_tracking.py`` (type ``gardo``, :16-18 and
:29-39), from image features (``scripts/train_sd3_gardo.py`` :713, of every rollout micro-batch): the features
L2-normalised (:18), their cosine similarities clipped to [-1, 1] (:32), the distance 1 - cos (:33), and each sample's
minimum over the other samples of its prompt (:34-39):

    f_i = phi(x_i) / ||phi(x_i)||          d_i = min_{j != i, same prompt} (1 - clip(<f_i, f_j>, -1, 1))      [G]

``reward.diversity.features`` names phi (:data:`FEATURES`). lean ships ``pixels``: the decoded image itself, flattened
(a video: all its frames). GARDO's phi is DINOv3 ViT-L/16 (timm ``vit_large_patch16_dinov3.lvd1689m`` with its own
resize and normalisation, train_sd3_gardo.py:624-631), which lean does not ship: a model's feature space is one more
:data:`FEATURES` entry (images [G, 3, H, W] in [0, 1] -> features [G, D]). A group of one has no other sample: d = 0
(the source's ``np.min`` of nothing raises). A zero feature vector (an all-black image in pixel space) keeps cosine 0
to every other (the source divides it by its norm 0: NaN).

Its weight in ``reward.weights`` is usually 0: an algorithm that reads it as a component (GARDO's
``algorithm.gardo.diversity_reward``) sees it, the weighted sum does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.config.checks import choice, choices
from lean.config.registry import Registry
from lean.config.sections import register_options
from lean.rewards.base import GroupReward, RewardFn, register_group

if TYPE_CHECKING:
    from lean.rewards.options import RewardConfig


def pixel_features(images: Tensor) -> Tensor:
    """Each image's (video's) pixels as one vector [G, 3 H W (x F)], float64."""
    return images.flatten(1).to(torch.float64)


FEATURES: Registry[Callable[[Tensor], Tensor]] = Registry(
    "diversity feature space",
    [("pixels", pixel_features)],  # the decoded image itself (GARDO's DINOv3 features: the module docstring)
)


def nearest_distances(features: Tensor) -> Tensor:
    """d_i = min_{j != i} (1 - clip(cos(f_i, f_j), -1, 1)) of every row of ``features`` [G, D]: float64 [G], 0 for a
    group of one."""
    f = torch.nn.functional.normalize(features.to(torch.float64), dim=1)
    if len(f) < 2:
        return torch.zeros(len(f), dtype=torch.float64, device=f.device)
    distance = 1 - (f @ f.T).clamp(-1, 1)
    distance.fill_diagonal_(float("inf"))
    return distance.min(dim=1).values


@register_group("diversity")
class Diversity(GroupReward):
    """Each sample's cosine distance to its nearest neighbour in its group (module docstring), in the feature space
    ``reward.diversity.features``."""

    def __init__(self, cfg: RewardConfig, pointwise: Callable[[str], RewardFn]):
        super().__init__(cfg, pointwise)
        self.features = FEATURES[cfg.diversity.features]

    def score_group(self, images: Tensor, prompt: str) -> Tensor:
        return nearest_distances(self.features(images)).cpu()


@register_options("reward.diversity")
@dataclass
class DiversityConfig:
    """``reward.diversity``: the feature space of the diversity reward (``lean.rewards.diversity``), read only when
    ``reward.weights`` names ``diversity``."""

    features: str = choice("diversity feature space")
    """phi: a name of ``lean.rewards.diversity.FEATURES`` (pixels: the decoded image, flattened)."""

    def validate(self, prefix: str) -> None:
        choices(self, prefix)
