"""Crash-safe checkpoints: atomic writes, integrity check, keep the last K, resume from the newest complete one.

A checkpoint is two files in ``<out>/checkpoints/``: ``iter-000007.pt`` (``torch.save`` of the state) and
``iter-000007.sha256`` (its digest). Each is written to a temporary name, fsync'ed, then renamed, and the digest is
written last, so a checkpoint without a matching digest is partial or corrupted: ``latest`` skips it with a warning.
The trajectories of an iteration are a pure function of (seed, iteration), so weights + optimizer + EMA + iteration
are all the state a bit-identical resume needs; the torch RNG state is saved too, for anything that draws from it.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from pathlib import Path

import torch

PATTERN = re.compile(r"iter-(\d{6})\.pt$")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(folder: Path, iteration: int, state: dict, keep: int) -> Path:
    """Write the checkpoint of ``iteration`` (refusing non-finite tensors), then prune to the newest ``keep``."""
    for name, value in _tensors(state):
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise FloatingPointError(f"refusing to checkpoint iteration {iteration}: {name} is not finite")
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({**state, "iteration": iteration, "torch_rng": torch.get_rng_state()}, buffer)
    payload = buffer.getvalue()
    path = folder / f"iter-{iteration:06d}.pt"
    _atomic_write(path, payload)
    _atomic_write(path.with_suffix(".sha256"), hashlib.sha256(payload).hexdigest().encode())
    for old in sorted(_candidates(folder))[:-keep]:
        old[1].unlink(missing_ok=True)
        old[1].with_suffix(".sha256").unlink(missing_ok=True)
    return path


def latest(folder: Path) -> dict | None:
    """The newest complete, intact checkpoint's state, or None. Partial or corrupted ones are skipped (warned)."""
    for _, path in sorted(_candidates(folder), reverse=True):
        digest = path.with_suffix(".sha256")
        payload = path.read_bytes()
        if not digest.exists() or digest.read_text().strip() != hashlib.sha256(payload).hexdigest():
            warnings.warn(
                f"skipping checkpoint {path.name}: incomplete or corrupted (digest missing or wrong)", stacklevel=2
            )
            continue
        # map to the CPU: every rank would otherwise get rank 0's cuda:0 tensors; loading copies them to each device
        state = torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")
        torch.set_rng_state(state["torch_rng"])
        return state
    return None


def _candidates(folder: Path) -> list[tuple[int, Path]]:
    if not folder.exists():
        return []
    return [(int(m.group(1)), p) for p in folder.iterdir() if (m := PATTERN.match(p.name))]


def _tensors(tree, prefix: str = "state"):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}[{i}]")
