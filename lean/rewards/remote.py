"""Rewards over HTTP: the client of ``lean reward serve`` (``lean.rewards.server``) and the wire format both share.

Protocol, JSON both ways (never pickle):

    GET  <url>/health  -> {"status": "ok", "reward": "<name>"}
    POST <url>/score   {"prompts": [B strings], "images": [B base64 PNGs]}   (a video: each sample a list of F PNGs)
                       -> {"scores": [B numbers]}                            (null: a non-finite score)

with ``Authorization: Bearer <token>`` when the server holds a token. Images travel as 8-bit RGB PNG, so the server
scores ``round(255 x) / 255``, as every scorer that takes uint8 images does.

The client (:class:`RemoteReward`) retries as :func:`lean.rewards.http.post_with_retries` does: refused connections,
timeouts, HTTP 5xx / 408 / 429 and answers that are not ``{"scores": [B numbers]}`` are retried with backoff, any
other 4xx is not, and the last failure is a :class:`RewardServerError` naming the URL.
"""

from __future__ import annotations

import base64
import io
import json
import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lean.rewards.base import check_inputs
from lean.rewards.builtin import to_uint8
from lean.rewards.http import json_headers, post_with_retries

if TYPE_CHECKING:
    from lean.rewards.options import RemoteRewardConfig

# ---------------------------------------------------------------- wire format


def encode_png(image: np.ndarray) -> str:
    """uint8 [H, W, 3] -> base64 PNG."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(text: str) -> np.ndarray:
    """base64 PNG -> uint8 [H, W, 3]; ``ValueError`` when it is not one."""
    try:
        with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as image:
            return np.asarray(image.convert("RGB"))
    except Exception as err:  # binascii.Error, PIL's UnidentifiedImageError, truncated files
        raise ValueError(f"not a base64 PNG ({type(err).__name__})") from None


def encode_images(images: Tensor) -> list:
    """[B, 3, H, W] -> B PNGs; [B, 3, F, H, W] -> B lists of F PNGs (values clamped to [0, 1], rounded to 8 bits)."""
    if images.ndim == 4:
        return [encode_png(a) for a in to_uint8(images)]
    return [[encode_png(a) for a in to_uint8(video.transpose(0, 1))] for video in images]


def decode_images(items: list) -> Tensor:
    """The inverse of :func:`encode_images`: float32 in [0, 1], [B, 3, H, W] or [B, 3, F, H, W]."""

    def sample(item) -> np.ndarray:  # [H, W, 3] or [F, H, W, 3]
        if isinstance(item, str):
            return decode_png(item)
        if isinstance(item, list) and item and all(isinstance(f, str) for f in item):
            return np.stack([decode_png(f) for f in item])
        raise ValueError("each image must be a base64 PNG string, or a non-empty list of them (a video's frames)")

    arrays = [sample(item) for item in items]
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"images differ in shape: {sorted({a.shape for a in arrays})}")
    x = torch.from_numpy(np.stack(arrays)).float() / 255  # [B, (F,) H, W, 3]
    return x.permute(0, 4, 1, 2, 3) if x.ndim == 5 else x.permute(0, 3, 1, 2)


def parse_request(body) -> tuple[list[str], Tensor]:
    """(prompts, images) of a /score request body; ``ValueError`` naming what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("prompts"), list) or "images" not in body:
        raise ValueError('need a JSON object {"prompts": [...], "images": [...]}')
    prompts, items = body["prompts"], body["images"]
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be strings")
    if not isinstance(items, list) or len(items) != len(prompts) or not items:
        raise ValueError(f"need one image per prompt, got {len(prompts)} prompts")
    return prompts, decode_images(items)


def parse_scores(answer: bytes, count: int) -> Tensor:
    """float64 [count] from a /score answer (null: nan); ValueError unless it is ``{"scores": [count numbers]}``."""
    try:
        scores = json.loads(answer)["scores"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f'the answer is not JSON {{"scores": [...]}}: {answer[:80]!r}') from None
    numbers = isinstance(scores, list) and all(
        s is None or (isinstance(s, (int, float)) and not isinstance(s, bool)) for s in scores
    )
    if not numbers or len(scores) != count:
        raise ValueError(f"need {count} numbers under scores, got {str(scores)[:80]}")
    return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float64)


def scores_json(scores: Tensor) -> list[float | None]:
    """float [B] -> JSON numbers, None for a non-finite score (JSON has no nan)."""
    return [s if math.isfinite(s) else None for s in scores.double().tolist()]


# ---------------------------------------------------------------- client


class RemoteReward:
    """A reward computed by a ``lean reward serve`` server at ``settings.url``."""

    def __init__(self, name: str, settings: RemoteRewardConfig):
        self.name, self.settings = name, settings
        self.url = settings.url.rstrip("/") + "/score"

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        check_inputs(images, prompts)
        body = json.dumps({"prompts": list(prompts), "images": encode_images(images)}).encode()
        return post_with_retries(
            f"reward {self.name}",
            self.url,
            body,
            json_headers(self.settings.token_env),
            self.settings,
            lambda a: parse_scores(a, len(prompts)),
        )
