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
    metadata: dict | None = None  # the record of a .jsonl line with more fields (GenEval's), as MetadataPrompt's

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


class MetadataPrompt(str):
    """A prompt with its data set record: the string is the prompt, ``metadata`` the whole JSON object of its
    ``.jsonl`` line (GenEval's ``tag``, ``include``, ``exclude``, ``prompt``), which FlowGRPO's ``GenevalPromptDataset``
    hands to the rewards beside the prompt (scripts/train_sd3.py:59-76 at ac4c86e) and its GenEval server needs.

    It is its string for everything else (equality, hashing, ordering, text encoders), so a prompt set of these
    samples, groups and sorts as the plain strings do; it pickles with its metadata (processes exchange prompts)."""

    metadata: dict

    def __new__(cls, text: str, metadata: dict) -> MetadataPrompt:
        prompt = super().__new__(cls, text)
        prompt.metadata = metadata
        return prompt

    def __getnewargs__(self) -> tuple[str, dict]:
        return str(self), self.metadata

    def __repr__(self) -> str:
        return f"MetadataPrompt({str(self)!r}, metadata={self.metadata!r})"


def prompt_metadata(prompt: str) -> dict | None:
    """The record of a ``.jsonl`` prompt (:class:`MetadataPrompt`, or an :class:`ImagePrompt` read from a line with
    more fields), None for a prompt without one."""
    return getattr(prompt, "metadata", None)


def with_metadata(texts: list[str], records: list[dict | None] | None) -> list[str]:
    """The prompts ``texts`` with the records :func:`prompt_metadata` gave them (a rollout kept as JSON, re-read)."""
    if records is None:
        return list(texts)
    return [
        text if record is None else MetadataPrompt(text, record) for text, record in zip(texts, records, strict=True)
    ]


def reference_image(prompt: str) -> str | None:
    """The reference image path of an :class:`ImagePrompt`, None for a text prompt."""
    return prompt.image if isinstance(prompt, ImagePrompt) else None


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a file, in file order, as FlowGRPO's scripts read its data sets (scripts/train_sd3.py):

    * ``*.jsonl``, GenEval's ``*_metadata.jsonl`` (``GenevalPromptDataset``): one JSON object per line, its ``prompt``
      field (a string) is the prompt; ``image`` is an edit's reference image, a path relative to the file's folder
      (FlowGRPO's ``GenevalPromptImageDataset`` in scripts/train_flux_kontext.py and train_qwenimage_edit.py joins it
      to the data set folder), read as an :class:`ImagePrompt`; a line with other fields (GenEval's ``tag``,
      ``include``...) keeps its whole record as the prompt's ``metadata`` (:class:`MetadataPrompt`), for the rewards
      that read it (FlowGRPO's GenEval server).
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
        prompts.append(_jsonl_prompt(record, path.parent, number))
    if not prompts:
        raise ValueError('holds no prompt (one per line, or a .jsonl line per prompt with a "prompt" field)')
    return prompts


def _jsonl_prompt(record: dict, folder: Path, number: int) -> str:
    """The prompt of one ``.jsonl`` record: with an ``image``, an :class:`ImagePrompt`; with other fields besides
    ``prompt`` (GenEval's metadata), it carries the record as ``metadata``; else the plain string."""
    image = record.get("image")
    if image is not None and (not isinstance(image, str) or not (folder / image).is_file()):
        raise ValueError(f'line {number}: "image" {image!r} is not an image file under {folder}')
    prompt = record["prompt"] if image is None else ImagePrompt(record["prompt"], folder / image)
    if set(record) - {"prompt", "image"}:
        if image is None:
            return MetadataPrompt(prompt, record)
        prompt.metadata = record
    return prompt


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
