"""Rewards: registries, the built-in functions, CLIP-based model rewards, remote rewards, and a run's
:class:`Scorer`.

    base.py     REWARDS, MODEL_REWARDS (registries), register / register_model, the video rule (mean over frames)
    builtin.py  weight-free rewards: jpeg_(in)compressibility, color_match, position_match
    models.py   clip_score, pickscore, hps, aesthetic: CLIP models from local folders
    imagereward.py  imagereward: BLIP ViT + cross-attending BERT + MLP from a local folder (and its converter)
    hpsv3.py    hpsv3: Qwen2-VL + HPSv3's reward head from a local folder
    ocr.py      ocr: FlowGRPO's text-rendering reward on PP-OCRv5 (the extra ``ocr``)
    groupwise.py  win_rate: Pref-GRPO's pairwise win rate inside a group; the pairwise judges (GroupReward)
    diversity.py  diversity: each sample's cosine distance to its nearest group mate in a feature space (GARDO's)
    http.py     POST with retries, time-outs and one-line errors (every remote reward)
    remote.py   the HTTP client of a reward server and the wire format (PNG in JSON)
    pickle_servers.py  clients of FlowGRPO's own reward servers (GenEval, DeQA, UnifiedReward): pickle over HTTP
    server.py   ``lean reward serve``: any registered reward over HTTP (FastAPI + uvicorn)
    judge_templates.py  VLM judges' question templates (FlowGRPO's UnifiedReward, Qwen-VL) and reward.judges options
    vlm_judge.py        VLMJudge: a VLM at an OpenAI-compatible chat endpoint (vLLM, SGLang) scores each image
    vlm_server.py       ``lean reward serve --vlm``: a transformers VLM folder under the OpenAI chat API
    scorer.py   Scorer: a run's rewards built once, their weighted sum; ScoreStream: a rollout's, as it finishes
"""

from lean.rewards import diversity as diversity  # registers the diversity reward (group-wise)
from lean.rewards import groupwise as groupwise  # registers the group-wise rewards
from lean.rewards import hpsv3 as hpsv3  # registers hpsv3
from lean.rewards import imagereward as imagereward  # registers imagereward
from lean.rewards import models as models  # registers the model rewards
from lean.rewards import ocr as ocr  # registers the ocr reward
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
from lean.rewards.vlm_judge import VLMJudge

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
    "VLMJudge",
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
