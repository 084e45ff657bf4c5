"""The built-in rewards: batched, deterministic, weight-free scores (JPEG size, FlowGRPO's; colour and position
matches, the workbench's synthetic task).

Each takes ``images`` in [0, 1] (float, [B, 3, H, W]) and ``prompts`` (B strings) and returns float64 [B];
:func:`lean.rewards.base.register` makes it accept videos too (the mean over frames).
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lean.rewards.base import register

# RGB in [0, 1]; "grey" is an alias of "gray".
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "magenta": (1.0, 0.0, 1.0),
    "cyan": (0.0, 1.0, 1.0),
    "orange": (1.0, 0.5, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "gray": (0.5, 0.5, 0.5),
    "grey": (0.5, 0.5, 0.5),
}


def to_uint8(images: Tensor) -> np.ndarray:
    """[B, 3, H, W] in [0, 1] -> uint8 [B, H, W, 3] (clamped, rounded)."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def jpeg_kilobytes(images: Tensor, quality: int = 95) -> Tensor:
    """Size in kB (1000 bytes) of each image saved by PIL as JPEG at ``quality``."""
    sizes = []
    for array in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float64)


@register("jpeg_compressibility")
def jpeg_compressibility(images: Tensor, prompts: list[str]) -> Tensor:
    """``−kB / 500`` of the JPEG (quality 95): smaller files score higher. FlowGRPO's definition
    (flow_grpo/rewards.py ``jpeg_compressibility``: the negated size in kB over 500); the scale matters, since the
    advantage's eps (1e-4) is added to group stds of this size."""
    return -jpeg_kilobytes(images) / 500


@register("jpeg_incompressibility")
def jpeg_incompressibility(images: Tensor, prompts: list[str]) -> Tensor:
    """``+kB`` of the JPEG (quality 95): larger, more detailed files score higher (FlowGRPO's
    ``jpeg_incompressibility``, unscaled)."""
    return jpeg_kilobytes(images)


def parse_colors(prompt: str) -> tuple[str | None, str | None]:
    """(object colour, background colour) named in ``prompt``: the colour word right before "background" is the
    background, the first other colour word the object. "a red circle on a white background" -> ("red", "white")."""
    words = re.findall(r"[a-z]+", prompt.lower())
    obj = background = None
    for word, following in zip(words, words[1:] + [""]):
        if word in COLORS:
            if following == "background":
                background = background or word
            else:
                obj = obj or word
    return obj, background


def closeness(pixels: Tensor, color: str) -> Tensor:
    """``1 − mean ‖p − c‖₂ / √3`` over the pixels of each image ([B, 3, ...] -> [B], in [0, 1]): 1 when every pixel
    is the colour, falling linearly with the mean RGB distance (a smooth score GRPO can climb)."""
    c = torch.tensor(COLORS[color], dtype=torch.float64, device=pixels.device).view(1, 3, *([1] * (pixels.ndim - 2)))
    distance = (pixels.to(torch.float64).clamp(0, 1) - c).norm(dim=1)
    return 1 - distance.flatten(1).mean(dim=1) / math.sqrt(3)


def center_mask(h: int, w: int, device: torch.device | str = "cpu") -> Tensor:
    """BoolTensor [H, W]: the central box of half the side length (a quarter of the area)."""
    mask = torch.zeros(h, w, dtype=torch.bool, device=device)
    mask[h // 4 : h - h // 4, w // 4 : w - w // 4] = True
    return mask


def masked_closeness(images: Tensor, mask: Tensor, color: str) -> Tensor:
    """:func:`closeness` of the pixels where ``mask`` [H, W] is True."""
    return closeness(images[:, :, mask], color)


@register("color_match")
def color_match(images: Tensor, prompts: list[str]) -> Tensor:
    """How much the image carries the colours named in the prompt, in [0, 1]: the :func:`closeness` of the central
    box to the object colour, averaged with the closeness of the rest of the image to the background colour when
    one is named. Prompts without a colour word score 0."""
    center = center_mask(*images.shape[-2:], device=images.device)
    scores = torch.zeros(images.shape[0], dtype=torch.float64)
    rows_of: dict[tuple[str | None, str | None], list[int]] = {}  # the images of each colour pair, scored together
    for b, prompt in enumerate(prompts):
        rows_of.setdefault(parse_colors(prompt), []).append(b)
    for (obj, background), rows in rows_of.items():
        parts = []
        if obj is not None:
            parts.append(masked_closeness(images[rows], center, obj))
        if background is not None and not center.all():  # tiny images have no border
            parts.append(masked_closeness(images[rows], ~center, background))
        if parts:
            scores[rows] = torch.stack(parts).mean(dim=0).cpu()
    return scores


def position_mask(prompt: str, h: int, w: int, device: torch.device | str = "cpu") -> Tensor | None:
    """BoolTensor [H, W] of the region the prompt places its object in: "left"/"right" halves, "top"/"bottom"
    (also "upper"/"lower") halves, their intersection for corners ("top right"), the central box for
    "center"/"centre"/"middle"; ``None`` when no usable position is named."""
    words = set(re.findall(r"[a-z]+", prompt.lower()))
    rows, cols = torch.arange(h, device=device).view(h, 1), torch.arange(w, device=device).view(1, w)
    mask = torch.ones(h, w, dtype=torch.bool, device=device)
    named = False
    for keys, region in (
        ({"left"}, cols < w // 2),
        ({"right"}, cols >= w - w // 2),
        ({"top", "upper"}, rows < h // 2),
        ({"bottom", "lower"}, rows >= h - h // 2),
    ):
        if words & keys:
            mask, named = mask & region, True
    if not named and words & {"center", "centre", "middle"}:
        mask, named = center_mask(h, w, device), True
    # "left ... right" leaves nothing; a region covering everything has no outside to compare with.
    return mask if named and mask.any() and not mask.all() else None


@register("position_match")
def position_match(images: Tensor, prompts: list[str]) -> Tensor:
    """Is the object colour where the prompt says? :func:`closeness` of the named region to the object colour minus
    that of the rest of the image, in [−1, 1]. "a red square on the left" prefers red on the left and not on the
    right. Prompts without an object colour or a position score 0."""
    scores = torch.zeros(images.shape[0], dtype=torch.float64)
    for b, prompt in enumerate(prompts):
        obj, _ = parse_colors(prompt)
        region = position_mask(prompt, *images.shape[-2:], device=images.device)
        if obj is None or region is None:
            continue
        inside = masked_closeness(images[b : b + 1], region, obj)
        outside = masked_closeness(images[b : b + 1], ~region, obj)
        scores[b] = (inside - outside).squeeze(0).cpu()
    return scores
