"""Keys that moved to another place: naming the old one is a one-line error that gives the new place."""

from __future__ import annotations

GRPO_KEYS = ("clip_range", "adv_clip_max", "global_std", "adv_std", "adv_eps", "beta", "kl_form", "skip_zero_advantage")
OPTIMIZER_KEYS = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "max_grad_norm")

MOVED: dict[str, str] = {
    **{f"train.{key}": f"algorithm.{key}" for key in GRPO_KEYS},
    **{f"train.{key}": f"parallel.{key}" for key in ("layout", "shard")},
    **{f"model.{key}": f"parallel.{key}" for key in ("sequence_parallel", "overlap")},
    **{f"train.{key}": f"optimizer.{key}" for key in OPTIMIZER_KEYS},
    "train.ema": "ema.enabled",
    **{f"train.ema_{key}": f"ema.{key}" for key in ("decay", "every", "warmup", "repeats")},
    "train.save_every": "checkpoint.every",
    "train.keep_checkpoints": "checkpoint.keep",
}


def relocated(tree: dict) -> dict:
    """A raw config tree written before keys moved (a run's ``config.json``, a checkpoint's config) with each moved
    key at its new place; a copy, the sections' mappings copied too."""
    tree = {name: dict(part) if isinstance(part, dict) else part for name, part in tree.items()}
    for old, new in MOVED.items():
        (section, key), (to, name) = old.split(".", 1), new.split(".", 1)
        if isinstance(tree.get(section), dict) and key in tree[section]:
            tree[to] = tree.get(to) or {}
            tree[to][name] = tree[section].pop(key)
    return tree
