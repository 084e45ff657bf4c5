"""Keys that moved to another place: naming the old one is a one-line error that gives the new place."""

from __future__ import annotations

GRPO_KEYS = ("clip_range", "adv_clip_max", "global_std", "adv_std", "adv_eps", "beta", "kl_form", "skip_zero_advantage")

MOVED: dict[str, str] = {
    **{f"train.{key}": f"algorithm.{key}" for key in GRPO_KEYS},
    **{f"train.{key}": f"parallel.{key}" for key in ("layout", "shard")},
    **{f"model.{key}": f"parallel.{key}" for key in ("sequence_parallel", "overlap")},
}
