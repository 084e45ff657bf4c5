"""Prompt files (``train.prompts_file``, ``eval.prompts_file``, ``lean sample --prompts-file``): a leaf module, so that
configuration reads them without importing the rest of lean."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a file, in file order, as FlowGRPO's scripts read its data sets (scripts/train_sd3.py):

    * ``*.jsonl``, GenEval's ``*_metadata.jsonl`` (``GenevalPromptDataset``): one JSON object per line, its ``prompt``
      field (a string) is the prompt; the other fields are ignored.
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
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError('holds no prompt (one per line, or a .jsonl line per prompt with a "prompt" field)')
    return prompts
