"""What the tests share: a fast run config."""

from __future__ import annotations

from lean.config import RunConfig, load_config

FAST = [
    "train.prompts_per_iteration=2",
    "train.group_size=2",
    "train.rollout_batch_size=4",
    "train.train_batch_size=4",
    "sample.num_steps=4",
    "train.iterations=1",
]

# The README's CPU run of a preset: tiny model, 2 prompts x 4, 64 px, 16 T5 tokens, 1 iteration.
QUICK = [
    "model.size=tiny",
    "model.resolution=64",
    "model.text_max_length=16",
    "train.prompts_per_iteration=2",
    "train.group_size=4",
    "train.iterations=1",
]


def tiny(*overrides: str) -> RunConfig:
    """A fast run config: tiny model, 4 steps, 2 prompts x 2 samples."""
    return load_config(None, [*FAST, *overrides])
