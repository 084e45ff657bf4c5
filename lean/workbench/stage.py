"""A DVC stage's set-up: its process settings from ``params.yaml`` and its run config."""

from __future__ import annotations

import os
from pathlib import Path

from lean.config import RunConfig, read_params
from lean.configure import load_config
from lean.observe import tracking
from lean.parallel.distributed import set_threads


def begin_stage(params: str | Path) -> dict:
    """Process set-up of a stage from ``params``' ``workbench`` and ``tracking`` sections; returns the whole file.

    Torch threads: tiny models are bound by per-op overhead, and on a shared 2-core machine a second thread that waits
    for a busy core makes every op slower, not faster (``workbench.threads``, 0: torch's default). Tracking:
    ``tracking.enabled`` unless ``LEAN_TRACKING`` is set in the environment, which wins."""
    tree = read_params(params)
    set_threads(int((tree.get("workbench") or {}).get("threads", 0)))
    section = tree.get("tracking") or {}
    if "LEAN_TRACKING" not in os.environ:
        tracking.configure(enabled=bool(section.get("enabled", False)))
    tracking.configure(experiment=section.get("experiment"))
    return tree


def stage_config(
    params: str | Path,
    section: str | None = None,
    *,
    pretrained: str | None = None,
    schedule: str | None = None,
    dtype: str | None = None,
    variant: str | None = None,
) -> RunConfig:
    """The run config of a stage: ``params``' run sections, then ``<section>.run`` on top (and
    ``<section>.<variant>.run``, e.g. ``rl.recipe.run``), then the stage's own choices (the pretrained base the
    ``prepare`` stage made, the schedule of a matrix stage, a precision)."""
    overrides = [] if dtype is None else [f"model.dtype={dtype}"]
    if pretrained is not None:
        overrides.append(f"model.pretrained={pretrained}")
    if schedule is not None:
        overrides.append(f"train.schedule={schedule}")
    return load_config(params, overrides, stage=section, variant=variant)
