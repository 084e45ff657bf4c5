"""The data-parallel layout: which samples a process holds, and when its schedule can turn them into gradients.

The global batch of an iteration is P prompt groups x G samples. ``parallel.layout``:

    shared  LeanGRPO's layout (arXiv 2609.03528, Sec. 4.1, App. A): the ranks generate different samples of the SAME
            prompt. With W data-parallel ranks and G >= W (W | G), every rank holds Q = G / W samples of every prompt
            (generation m on rank m mod W: App. A's round q = m div W); with G < W (G | W) the ranks form W / G
            worker groups of G ranks, each on its own prompt (Q = 1); in general a wave is the c = W / gcd(G, W)
            prompts whose samples deal out evenly (:class:`SharedShape`). Per wave: roll out the wave's Q samples
            per rank -> gather the wave's rewards -> its groups' advantages -> the schedule finishes the wave's rows
            (Retain: backward and free; Reweight: fold its buffers) -> the next wave. So Retain holds the graphs of Q
            samples and Reweight Q trajectories' buffers: c G / W where the group layout holds G (1/W of it for
            c = 1). The rewards of a wave are all-gathered over the data-parallel ranks (a few scalars per rank: one
            collective for all worker groups, the same bytes as one inside each).
    group   process r holds whole groups (P divisible by the number of processes W). A group's advantages depend on
            its own rewards only, so as soon as a group's trajectories are rolled out and scored the schedule
            finishes it (``Schedule.finish_rows``) before the next group rolls out: Retain backpropagates and frees
            that group's graphs, Reweight folds that group's per-trajectory buffers. It holds G trajectories.
    slice   process r holds the contiguous slice r of the N = P G samples in group order (a group may straddle two
            processes); the rewards of all processes are gathered, the advantages computed, then each schedule
            finishes its whole local batch at once: Retain holds the graphs of every local trajectory until then.
    auto    group where it applies (W divides P, the rollout micro-batches do not straddle groups), else slice.

Every layout gives the same gradient (App. A, Eqs. 9-11: a bijective re-indexing of the (prompt, sample) pairs; the
random streams are keyed by the sample, not by its place). Gradients accumulate locally and synchronise once per
update (delayed sync) in all three. The global order of the samples (``lean.run.iteration.local_batch``) is
rank-major: rank r's share is the contiguous block r of it, so a gather in rank order is the global batch.

With ``algorithm.global_std`` or ``algorithm.reward_combination: gdpo`` (or ``pref_gdpo``) every advantage depends on
the whole batch's std, so nothing can finish before the last group is scored: the group and shared layouts then
finish at the end, as slice does (``finish_unit`` is None); so does a k-update hybrid (its first update's rows are
spread over the groups).

The finishing unit: group layout, the rows a rollout micro-batch completes (m = c G completes c groups, m dividing G
one group every G / m micro-batches); shared layout, one wave's Q rows (rolled out in micro-batches of at most Q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lean.config import AUTO, ConfigError  # auto: the same word as train.schedule's, lean chooses
from lean.config.registry import Registry

if TYPE_CHECKING:
    from lean.config import RunConfig, TrainConfig

LAYOUTS: Registry[str] = Registry(
    "layout",
    [
        (
            AUTO,
            "where lean plans at train start (train.schedule: auto, or a memory budget): the layout whose schedule "
            "is predicted fastest among those that fit; else group where the groups divide over the processes and "
            "the rollout micro-batches, else slice",
        ),
        ("group", "each process holds whole prompt groups and finishes each as soon as it is scored"),
        ("shared", "the processes share each prompt's samples (LeanGRPO's layout) and finish prompt by prompt"),
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


GROUP, SHARED, SLICE = "group", "shared", "slice"


@dataclass(frozen=True)
class SharedShape:
    """The shared layout's waves over W data-parallel ranks and groups of G samples (App. A, generalised): a wave is
    the fewest prompts whose samples deal out evenly, c = W / gcd(G, W), and each rank holds Q = c G / W of them.
    G >= W with W | G: one prompt a wave, Q = G / W (App. A's rounds). G < W with G | W: W / G prompts a wave, one
    per worker group of G ranks, Q = 1. Otherwise (DanceGRPO's 12 samples on 8 ranks) c prompts share the ranks:
    2 prompts a wave, 3 samples each rank."""

    prompts_per_wave: int  # c
    per_rank: int  # Q

    @classmethod
    def of(cls, group_size: int, ranks: int) -> SharedShape:
        c = ranks // math.gcd(group_size, ranks)
        return cls(prompts_per_wave=c, per_rank=c * group_size // ranks)


def shared_order(prompts: int, group_size: int, ranks: int) -> list[int]:
    """The global batch (group order: sample m of prompt b at b G + m) laid out rank-major for the shared layout: in
    wave w (prompts w c .. w c + c - 1, their samples numbered k = (b - w c) G + m), rank d holds k = d, d + W, ...,
    d + (Q - 1) W, in that order (App. A: round q, rank d -> generation q W + d). Returns the group-order index of
    every position."""
    shape = SharedShape.of(group_size, ranks)
    c, q = shape.prompts_per_wave, shape.per_rank
    return [w * c * group_size + d + i * ranks for d in range(ranks) for w in range(prompts // c) for i in range(q)]


def _local_and_micro_batch(t: TrainConfig, world_size: int) -> tuple[int, int]:
    """(samples a process holds, its rollout micro-batch)."""
    local = t.prompts_per_iteration * t.group_size // world_size
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
    """Rows each early finish covers, or None when the process finishes its whole batch after the rollout (slice
    layout; advantages that need the whole batch: ``algorithm.global_std``, gdpo; one unit that is the whole local
    batch). Group layout: whole groups (a multiple of G, or G itself); shared layout: one wave, Q rows."""
    t, layout = cfg.train, resolve_layout(cfg, world_size)
    if layout == SLICE or cfg.algorithm.batch_wide:
        return None
    local, m = _local_and_micro_batch(t, world_size)
    if layout == SHARED:
        unit = SharedShape.of(t.group_size, world_size).per_rank
    else:
        unit = m if m % t.group_size == 0 else t.group_size
    return unit if unit < local else None


def wave_gathered(layout: str) -> bool:
    """Whether a finishing unit's advantages need the other ranks' rewards (a collective per unit): the shared
    layout's, whose groups span the ranks."""
    return layout == SHARED


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
    if p.layout == GROUP and (problem := group_layout_problem(t, ranks)):
        raise ConfigError("parallel.layout", p.layout, problem)
    if (n // ranks) % t.optimizer_steps_per_iteration:
        raise ConfigError(
            "train.optimizer_steps_per_iteration",
            t.optimizer_steps_per_iteration,
            f"must divide the {n // ranks} samples each process holds",
        )
