"""A procedural text-to-image data set: one coloured shape on a coloured background, and a caption that names them.

A scene is (object colour, shape, position, background colour). Its caption reads
"a red circle on a blue background" for a centred shape, "a red circle on the left on a blue background" otherwise,
so the captions of centred scenes are exactly the library's default GRPO prompts (``lean.config.DEFAULT_PROMPTS``)
and the rewards of ``lean.rewards`` parse them: ``color_match`` scores the central box against the object colour and
the border against the background, ``position_match`` the named half against the object colour.

Images are float32 ``[3, H, W]`` in [0, 1]; the shape spans half the side (the central box of ``color_match``) and a
positioned shape sits in the middle of its half. Rendering is a pure function of the scene and the resolution; a
data set is a seeded sample of scenes. Videos (``frames > 1``) repeat the still image: the scene does not move.

Prompt files (``train.prompts_file``) are read by ``lean.config.prompts``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from lean.rewards import COLORS

PALETTE = ("red", "green", "blue", "yellow", "white", "black", "magenta", "cyan")  # corners of the RGB cube
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("center", "left", "right", "top", "bottom")
# Centre of the shape as a fraction of (width, height).
_OFFSETS = {"center": (0.5, 0.5), "left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75)}


@dataclass(frozen=True)
class Scene:
    color: str
    shape: str
    position: str
    background: str

    @property
    def caption(self) -> str:
        where = "" if self.position == "center" else f" on the {self.position}"
        return f"a {self.color} {self.shape}{where} on a {self.background} background"


def all_scenes() -> list[Scene]:
    """Every scene with distinct object and background colours (8 x 7 x 3 x 5 = 840)."""
    return [Scene(c, s, p, b) for c in PALETTE for b in PALETTE if b != c for s in SHAPES for p in POSITIONS]


def vocabulary() -> list[str]:
    """Captions of all scenes: what a tokenizer must be trained on to read every prompt of this task."""
    return [scene.caption for scene in all_scenes()]


def shape_mask(shape: str, position: str, resolution: int) -> Tensor:
    """BoolTensor [H, W] of the shape's pixels: side (or diameter) = half the image, centred at its position."""
    n = resolution
    cx, cy = (f * n for f in _OFFSETS[position])
    coords = torch.arange(n, dtype=torch.float32) + 0.5  # pixel centres
    y, x = coords.view(n, 1), coords.view(1, n)
    r = n / 4  # half the side
    if shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r**2
    if shape == "square":
        return ((x - cx).abs() <= r) & ((y - cy).abs() <= r)
    if shape == "triangle":  # apex up, base at the bottom of the box
        top, height = cy - r, 2 * r
        inside_rows = (y >= top) & (y <= cy + r)
        return inside_rows & ((x - cx).abs() <= (y - top) / height * r)
    raise ValueError(f"shape={shape!r}: must be one of {', '.join(SHAPES)}")


def render(scene: Scene, resolution: int) -> Tensor:
    """The scene as float32 ``[3, H, W]`` in [0, 1]."""
    obj, bg = (torch.tensor(COLORS[c], dtype=torch.float32).view(3, 1, 1) for c in (scene.color, scene.background))
    return torch.where(shape_mask(scene.shape, scene.position, resolution), obj, bg)


def sample_scenes(n: int, seed: int) -> list[Scene]:
    """``n`` scenes drawn uniformly with replacement from :func:`all_scenes` (Python's RNG seeded with ``seed``)."""
    scenes = all_scenes()
    rng = random.Random(seed)
    return [rng.choice(scenes) for _ in range(n)]


def make_dataset(n: int, resolution: int, seed: int, frames: int = 1) -> tuple[Tensor, list[str]]:
    """``n`` rendered scenes and their captions: images ``[n, 3, H, W]`` (videos ``[n, 3, frames, H, W]``)."""
    scenes = sample_scenes(n, seed)
    images = torch.stack([render(s, resolution) for s in scenes])
    if frames > 1:
        images = images.unsqueeze(2).expand(-1, -1, frames, -1, -1).contiguous()
    return images, [s.caption for s in scenes]


def edit_scenes() -> list[tuple[Scene, Scene]]:
    """(reference, target) pairs of a recolouring task, one per palette colour c_k: the target a centred shape (the
    shapes in turn) of colour c_k on the background c_(k+4), the reference the same scene in the next colour that is
    neither. The instruction is the target's caption, which ``color_match`` scores."""
    pairs = []
    for k, color in enumerate(PALETTE):
        background, shape = PALETTE[(k + 4) % len(PALETTE)], SHAPES[k % len(SHAPES)]
        before = next(c for c in PALETTE[k + 1 :] + PALETTE if c not in (color, background))
        pairs.append((Scene(before, shape, "center", background), Scene(color, shape, "center", background)))
    return pairs


def write_edit_dataset(folder, resolution: int = 64) -> None:
    """The recolouring task of :func:`edit_scenes` as FlowGRPO's edit data sets are laid out:
    ``train_metadata.jsonl`` (``prompt``, ``image`` relative to the folder) and ``images/<k>.png``."""
    import json
    from pathlib import Path

    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for k, (reference, target) in enumerate(edit_scenes()):
        pixels = (render(reference, resolution).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / "images" / f"{k}.png")
        lines.append(json.dumps({"prompt": target.caption, "image": f"images/{k}.png"}))
    (folder / "train_metadata.jsonl").write_text("\n".join(lines) + "\n")
