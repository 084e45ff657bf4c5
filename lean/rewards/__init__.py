"""Rewards: registries, the built-in functions, CLIP-based model rewards, remote rewards, and a run's
:class:`Scorer`.

    base.py     REWARDS, MODEL_REWARDS (registries), register / register_model, the video rule (mean over frames)
    builtin.py  weight-free rewards: jpeg_(in)compressibility, color_match, position_match
    models.py   clip_score, pickscore, hps, aesthetic: CLIP models from local folders
    groupwise.py  win_rate: Pref-GRPO's pairwise win rate inside a group; the pairwise judges (GroupReward)
    http.py     POST with retries, time-outs and one-line errors (every remote reward)
    remote.py   the HTTP client of a reward server and the wire format (PNG in JSON)
    server.py   ``lean reward serve``: any registered reward over HTTP (FastAPI + uvicorn)
    scorer.py   Scorer: a run's rewards built once, their weighted sum; ScoreStream: a rollout's, as it finishes
"""

from lean.rewards import groupwise as groupwise  # registers the group-wise rewards
from lean.rewards import models as models  # registers the model rewards
from lean.rewards.base import (
    GROUP_REWARDS,
    MODEL_REWARDS,
    REWARDS,
    GroupReward,
    ModelReward,
    RewardFn,
    check_config,
    check_folder,
    register,
    register_group,
    register_model,
    reward_names,
)
from lean.rewards.builtin import COLORS, parse_colors
from lean.rewards.http import RewardServerError
from lean.rewards.remote import RemoteReward
from lean.rewards.scorer import Scorer, build_reward, compute_rewards, weighted_sum

__all__ = [
    "COLORS",
    "GROUP_REWARDS",
    "GroupReward",
    "MODEL_REWARDS",
    "REWARDS",
    "ModelReward",
    "RemoteReward",
    "RewardFn",
    "RewardServerError",
    "Scorer",
    "build_reward",
    "check_config",
    "check_folder",
    "compute_rewards",
    "parse_colors",
    "register",
    "register_group",
    "register_model",
    "reward_names",
    "weighted_sum",
]
