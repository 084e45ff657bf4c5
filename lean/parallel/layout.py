"""The data-parallel layout: which samples a process holds, and when its schedule can turn them into gradients.

The global batch of an iteration is P prompt groups x G samples, in group order. ``parallel.layout``:

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
``algorithm.global_std`` or ``algorithm.reward_combination: gdpo`` every advantage depends on the whole batch's std, so
nothing can finish before the last group is scored: the group layout then finishes at the end, as slice does
(``finish_unit`` is None).

The finishing unit: the rows a rollout micro-batch completes. With micro-batches of m samples and groups of G, a
micro-batch of m = c G completes c groups, and m dividing G completes one group every G / m micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lean.config import AUTO, ConfigError  # auto: the same word as train.schedule's, lean chooses
from lean.config.registry import Registry

if TYPE_CHECKING:
    from lean.config import RunConfig, TrainConfig

LAYOUTS: Registry[str] = Registry(
    "layout",
    [
        (AUTO, "group where the groups divide over the processes and the rollout micro-batches, else slice"),
        ("group", "each process holds whole prompt groups and finishes each as soon as it is scored"),
        ("slice", "each process holds a contiguous slice of the batch and finishes it after the whole rollout"),
    ],
)


def local_slice(n_total: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous block of a batch of ``n_total`` gathered in rank order from ``world_size`` equal
    shares: ``slice(rank·n, (rank+1)·n)`` with ``n = n_total / world_size``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    if n_total % world_size:
        raise ValueError(f"n_total={n_total}: not divisible by world_size={world_size}")
    n = n_total // world_size
    return slice(rank * n, (rank + 1) * n)


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


def resolve_layout(cfg: RunConfig, world_size: int) -> str:
    """``parallel.layout`` with auto resolved: group where :func:`group_layout_problem` finds none, else slice."""
    if cfg.parallel.layout != AUTO:
        return cfg.parallel.layout
    return "slice" if group_layout_problem(cfg.train, world_size) else "group"


def finish_unit(cfg: RunConfig, world_size: int) -> int | None:
    """Rows each early finish covers (whole groups, a multiple of G or G itself), or None when the process finishes
    its whole batch after the rollout (slice layout, advantages that need the whole batch: ``algorithm.global_std``,
    gdpo, or one unit that is the whole local batch)."""
    t = cfg.train
    if resolve_layout(cfg, world_size) != "group" or cfg.algorithm.batch_wide:
        return None
    local, m = _local_and_micro_batch(t, world_size)
    unit = m if m % t.group_size == 0 else t.group_size
    return unit if unit < local else None


def finishing_units(rows: int, unit: int | None) -> list[tuple[slice, bool]]:
    """The ``rows`` of a local batch as finishing units of ``unit`` rows (:func:`finish_unit`), each with whether it
    is finished before the next one rolls out. None: one unit, the whole batch, finished after the rollout. A last
    unit shorter than ``unit`` (micro-batches of c groups that do not divide the batch) is finished after the
    rollout, with the batch."""
    if unit is None:
        return [(slice(0, rows), False)]
    return [(slice(start, min(start + unit, rows)), start + unit <= rows) for start in range(0, rows, unit)]


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """The layout's rules: the batch divides over the data-parallel ranks, the group layout (when asked for) holds
    the run, and every process's samples divide into the optimizer steps."""
    t, p = cfg.train, cfg.parallel
    ranks = p.data_parallel_size(world_size)
    what = "processes" if p.sequence_parallel == 1 else "data-parallel ranks (processes / parallel.sequence_parallel)"
    n = cfg.samples_per_iteration
    if n % ranks:
        raise ConfigError(
            "train.prompts_per_iteration",
            t.prompts_per_iteration,
            f"prompts_per_iteration x group_size = {n} samples must divide over {ranks} {what}",
        )
    if p.layout == "group" and (problem := group_layout_problem(t, ranks)):
        raise ConfigError("parallel.layout", p.layout, problem)
    if (n // ranks) % t.optimizer_steps_per_iteration:
        raise ConfigError(
            "train.optimizer_steps_per_iteration",
            t.optimizer_steps_per_iteration,
            f"must divide the {n // ranks} samples each process holds",
        )
