"""The meta-device counts of ``lean plan`` kept on disk, so that a second ``lean plan`` of the same model (another GPU,
another budget, a notebook's re-run, another process) reads its count instead of redoing it (seconds at a published
size; ``lean.plan.meta.count_degrees`` keeps it in the process too).

A count is pure: it depends on the config less what it does not read (``lean.plan.meta.count_key``) and on the code
that counts. Each entry is keyed by both: the key's text and :func:`code_version` (every source file of the ``lean``
package, torch's and diffusers' versions), so any change to lean's code or to those packages starts afresh. Entries
are written whole (a temporary file renamed into place), so processes may share a folder.

    LEAN_PLAN_CACHE   the folder (default ~/.cache/lean/plan-counts); "0" or "" keeps counts in the process only
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

CACHE_ENV = "LEAN_PLAN_CACHE"
DEFAULT_DIR = Path.home() / ".cache" / "lean" / "plan-counts"


def cache_dir() -> Path | None:
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return DEFAULT_DIR
    return None if value in ("", "0") else Path(value)


@functools.cache
def code_version() -> str:
    """A digest of every source file of the ``lean`` package, torch's and diffusers' versions."""
    import diffusers
    import torch

    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(f"{torch.__version__} {diffusers.__version__}".encode())
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _path(key: tuple) -> Path | None:
    folder = cache_dir()
    if folder is None:
        return None
    name = hashlib.sha256(json.dumps([code_version(), repr(key)]).encode()).hexdigest()[:32]
    return folder / f"{name}.json"


def load(key: tuple) -> dict[int, dict[bool, dict]] | None:
    """The count stored under ``key`` (sequence-parallel degree -> checkpointing -> figures), or None."""
    path = _path(key)
    if path is None or not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable: count again
        return None
    return {int(d): {on == "true": figures for on, figures in by.items()} for d, by in stored.items()}


def store(key: tuple, counts: dict[int, dict[bool, dict]]) -> None:
    path = _path(key)
    if path is None:
        return
    text = json.dumps({str(d): {str(on).lower(): f for on, f in by.items()} for d, by in counts.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:  # a read-only home: the count stays in the process
        pass
