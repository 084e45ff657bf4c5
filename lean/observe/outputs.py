"""Writing a command's declared outputs: JSON summaries, CSV tables, and the flat numbers that go to MLflow."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any) -> None:
    """``data`` as indented JSON at ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_csv(path: str | Path, rows: list[Mapping[str, Any]], fields: list[str] | None = None) -> None:
    """One row per mapping; columns ``fields`` (default: the first row's keys); keys outside them are dropped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


class JsonLines:
    """A file that gets one JSON line per measurement as soon as it is made (a run that times out keeps them);
    ``None`` as the path: nothing is written."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def append(self, row: Mapping[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")


def numbers(tree: Mapping[str, Any]) -> dict[str, float]:
    """The top-level numbers of a summary (what goes to MLflow as metrics); bools and strings are left out."""
    return {k: v for k, v in tree.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
