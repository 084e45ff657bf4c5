"""The data-parallel layout: which samples a process holds, and when its schedule can turn them into gradients.

The global batch of an iteration is P prompt groups x G samples, in group order. ``train.layout``:

    slice   process r holds the contiguous slice r of the N = P G samples (a group may straddle two processes);
            the rewards of all processes are gathered, the advantages computed, then each schedule finishes its
            whole local batch at once: Retain holds the graphs of every local trajectory until then.
    group   process r holds whole groups (P divisible by the number of processes W). A group's advantages depend on
            its own rewards only, so as soon as a group's trajectories are rolled out and scored the schedule
            finishes it (``Schedule.finish_rows``) before the next group rolls out: Retain backpropagates and frees
            that group's graphs, Reweight folds that group's per-trajectory buffers. Gradients still accumulate
            locally and synchronise once per update (delayed sync), so the update is the slice layout's.
    auto    group where it applies (W divides P, the rollout micro-batches do not straddle groups), else slice.

With W | P the two layouts give a process the same samples; what differs is the finishing unit. With
``train.global_std`` every advantage depends on the whole batch's std, so nothing can finish before the last group
is scored: the group layout then finishes at the end, as slice does (``finish_unit`` is None).

The finishing unit: the rows a rollout micro-batch completes. With micro-batches of m samples and groups of G, a
micro-batch of m = c G completes c groups, and m dividing G completes one group every G / m micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lean.registry import Registry
from lean.schedules import AUTO  # the same word as train.schedule's: lean chooses

if TYPE_CHECKING:
    from lean.config import TrainConfig

LAYOUTS: Registry[str] = Registry(
    "layout",
    [
        (AUTO, "group where the groups divide over the processes and the rollout micro-batches, else slice"),
        ("group", "each process holds whole prompt groups and finishes each as soon as it is scored"),
        ("slice", "each process holds a contiguous slice of the batch and finishes it after the whole rollout"),
    ],
)


def _local_and_micro_batch(t: TrainConfig, world_size: int) -> tuple[int, int]:
    """(samples a process holds when the groups divide over the processes, its rollout micro-batch)."""
    local = t.prompts_per_iteration // world_size * t.group_size
    return local, min(t.rollout_batch_size, local)


def group_layout_problem(t: TrainConfig, world_size: int) -> str | None:
    """Why the group layout cannot hold this run (None when it can)."""
    if t.prompts_per_iteration % world_size:
        return f"needs prompts_per_iteration={t.prompts_per_iteration} divisible by the {world_size} processes"
    _, m = _local_and_micro_batch(t, world_size)
    if m % t.group_size and t.group_size % m:
        return (
            f"needs rollout micro-batches that do not straddle groups: train.rollout_batch_size={t.rollout_batch_size} "
            f"must divide group_size={t.group_size} or be a multiple of it"
        )
    return None


def resolve_layout(t: TrainConfig, world_size: int) -> str:
    """``train.layout`` with auto resolved: group where :func:`group_layout_problem` finds none, else slice."""
    if t.layout != AUTO:
        return t.layout
    return "slice" if group_layout_problem(t, world_size) else "group"


def finish_unit(t: TrainConfig, world_size: int) -> int | None:
    """Rows each early finish covers (whole groups, a multiple of G or G itself), or None when the process finishes
    its whole batch after the rollout (slice layout, ``global_std``, or one unit that is the whole local batch)."""
    if resolve_layout(t, world_size) != "group" or t.global_std:
        return None
    local, m = _local_and_micro_batch(t, world_size)
    unit = m if m % t.group_size == 0 else t.group_size
    return unit if unit < local else None
