"""Prompt files (``train.prompts_file``, ``eval.prompts_file``, ``lean sample --prompts-file``): a leaf module, so that
configuration reads them without importing the rest of lean."""

from __future__ import annotations

import json
import os
from pathlib import Path


class ImagePrompt(str):
    """An edit instruction with its reference image: the string is the instruction (what text encoders and text
    rewards read), ``image`` the reference image's path. Two image prompts are equal when both agree, so one
    instruction over many images ("make it snowy") is many prompts, each encoded and grouped on its own.

    Plain strings are prompts without a reference; an ``ImagePrompt`` pickles with its image (processes exchange
    prompts)."""

    image: str

    def __new__(cls, text: str, image: str | os.PathLike) -> ImagePrompt:
        prompt = super().__new__(cls, text)
        prompt.image = str(image)
        return prompt

    def __getnewargs__(self) -> tuple[str, str]:
        return str(self), self.image

    def __eq__(self, other) -> bool:
        return str.__eq__(self, other) and reference_image(other) == self.image

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((str(self), self.image))

    # ordered by (instruction, image), so that sorting a prompt set is deterministic across processes
    def __lt__(self, other) -> bool:
        return (str(self), self.image) < (str(other), reference_image(other) or "")

    def __gt__(self, other) -> bool:
        return (str(self), self.image) > (str(other), reference_image(other) or "")

    def __repr__(self) -> str:
        return f"ImagePrompt({str(self)!r}, image={self.image!r})"


def reference_image(prompt: str) -> str | None:
    """The reference image path of an :class:`ImagePrompt`, None for a text prompt."""
    return prompt.image if isinstance(prompt, ImagePrompt) else None


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a file, in file order, as FlowGRPO's scripts read its data sets (scripts/train_sd3.py):

    * ``*.jsonl``, GenEval's ``*_metadata.jsonl`` (``GenevalPromptDataset``): one JSON object per line, its ``prompt``
      field (a string) is the prompt; the other fields are ignored, except ``image``: an edit's reference image, a
      path relative to the file's folder (FlowGRPO's ``GenevalPromptImageDataset`` in scripts/train_flux_kontext.py
      and train_qwenimage_edit.py joins it to the data set folder), read as an :class:`ImagePrompt`.
    * any other file, ``dataset/*/train.txt`` (``TextPromptDataset``): one prompt per line, stripped of surrounding
      whitespace (``line.strip()``); nothing else is parsed, so commas, quotes and numbers stay as written.

    Blank lines are skipped in both. Raises ``ValueError`` (one line, with the line number where there is one) for a
    missing file, a file without any prompt, a line that is not a JSON object or has no string ``prompt``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError("no such file" if not path.exists() else "not a file")
    lines = path.read_text(encoding="utf-8").splitlines()
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line.strip())
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"line {number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'line {number}: needs a "prompt" string field (one JSON object per line)')
        image = record.get("image")
        if image is None:
            prompts.append(record["prompt"])
            continue
        if not isinstance(image, str) or not (path.parent / image).is_file():
            raise ValueError(f'line {number}: "image" {image!r} is not an image file under {path.parent}')
        prompts.append(ImagePrompt(record["prompt"], path.parent / image))
    if not prompts:
        raise ValueError('holds no prompt (one per line, or a .jsonl line per prompt with a "prompt" field)')
    return prompts


def reference_pixels(prompt: str, size: int, lanczos: bool = False):
    """The reference image of an :class:`ImagePrompt` as ``[3, size, size]`` float32 in [0, 1]: RGB, resized to the
    square ``size`` as FlowGRPO's edit scripts resize it to the run's resolution (``ref_image.resize((resolution,
    resolution))``, PIL's default bicubic filter), or with ``lanczos`` PIL's Lanczos filter (the FLUX.2 pipelines'
    ``Flux2ImageProcessor._resize_to_target_area``, for ``model.reference_resolution``). Raises ``ValueError`` for a
    text prompt."""
    import numpy as np
    import torch
    from PIL import Image  # local: this module is read by configuration, which needs neither

    path = reference_image(prompt)
    if path is None:
        raise ValueError(f'prompt {str(prompt)!r} has no reference image (a .jsonl line with an "image" field)')
    resample = Image.Resampling.LANCZOS if lanczos else None
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB").resize((size, size), resample), dtype=np.float32) / 255.0
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def conditioning_pixels(prompt: str, resolution: int, reference_resolution: int | None):
    """The reference of an edit as a run conditions on it: at ``model.reference_resolution``, resized once with
    Lanczos, where set; else at the run's ``resolution`` with FlowGRPO's bicubic (:func:`reference_pixels`)."""
    return reference_pixels(prompt, reference_resolution or resolution, lanczos=reference_resolution is not None)
