"""The three update schedules, registered once. Each file states its algorithm and its cost model; ``base.py`` holds
the contract and what they share. Adding a schedule is one new file plus one :data:`SCHEDULES` line."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lean.algorithms import ALGORITHMS, CLEAN_SAMPLES, FACTS, Algorithm
from lean.config import AUTO, ConfigError  # auto: not a schedule; lean picks one of LEAN_SCHEDULES
from lean.config.registry import Registry
from lean.parallel.grad_sync import PER_BACKWARD, PER_UPDATE, resolve_grad_sync, sharded_full_finetune
from lean.parallel.sharding import shards
from lean.schedules.base import IterationContext, IterationCosts, Prediction, RowCounts, Schedule
from lean.schedules.edge_updates import edges_per_update
from lean.schedules.recompute import RECOMPUTE_BATCHINGS, SPLIT_THEN_FILTER, Recompute, splits_first
from lean.schedules.renoised import Renoised
from lean.schedules.retain import ALL_STEPS, DEVICE, UNIT_BACKWARD, Retain
from lean.schedules.reweight import Reweight

if TYPE_CHECKING:
    from lean.config import RunConfig

SCHEDULES: Registry[type[Schedule]] = Registry(
    "schedule",
    [
        ("recompute", Recompute),  # the baseline (FlowGRPO, DanceGRPO), and the default
        ("retain", Retain),
        ("reweight", Reweight),
    ],
)
BASELINE = SCHEDULES.default
LEAN_SCHEDULES = tuple(name for name in SCHEDULES if name != BASELINE)  # the ones that skip the recompute
RETAIN = next(name for name, schedule in SCHEDULES.items() if schedule is Retain)  # whose graphs train.retain sets
REWEIGHT = next(name for name, schedule in SCHEDULES.items() if schedule is Reweight)
SCHEDULE_CHOICES = (*SCHEDULES, AUTO)


def schedule_class(name: str, algorithm: type[Algorithm] | Algorithm) -> type[Schedule]:
    """The class that runs schedule ``name`` for ``algorithm``: for one that trains on re-noised clean samples, the
    baseline is its own update (``renoised.py``; the Lean schedules are refused at configuration)."""
    if algorithm.trains_on == CLEAN_SAMPLES:
        return Renoised
    return SCHEDULES[name]


def algorithm_problem(schedule: type[Schedule], algorithm: type[Algorithm]) -> str | None:
    """Why ``schedule`` cannot reproduce ``algorithm``'s gradient (a fact it needs that the algorithm lacks), or
    None."""
    if algorithm.trains_on == CLEAN_SAMPLES and schedule is not SCHEDULES[BASELINE]:
        return (
            "it trains on re-noised clean samples, so no rollout forward is reused and the saving has nothing to "
            f"act on; its update is {BASELINE}'s (forwards after the rewards)"
        )
    missing = [FACTS[fact] for fact in sorted(schedule.needs - algorithm.facts)]
    return f"it needs {' and '.join(missing)}, which the algorithm does not declare" if missing else None


def algorithm_schedules(cfg: RunConfig) -> list[str]:
    """The registered schedules that compute ``cfg``'s algorithm's gradient (NFT and DPO: the baseline alone),
    whatever else of ``cfg`` may refuse one of them."""
    algorithm = ALGORITHMS[cfg.algorithm.name]
    return [name for name, schedule in SCHEDULES.items() if algorithm_problem(schedule, algorithm) is None]


def whole_gradient_buffers(cfg: RunConfig, name: str) -> str | None:
    """Why the schedule ``name`` cannot run a sharded full fine-tune, or None: its provisional gradients are whole
    (unsharded) per trajectory, corrected before any sync (LeanGRPO Sec. 4.3.2), so FSDP2's reduce-scatter after
    each backward must be off: ``parallel.grad_sync=per_update``."""
    if cfg.model.full_finetune and SCHEDULES[name].backward_in_rollout and resolve_grad_sync(cfg) != PER_UPDATE:
        return (
            f"with model.full_finetune, {name} keeps each trajectory's provisional gradient whole and corrects it "
            "before the sync, so FSDP2 must not reduce-scatter after each backward: set parallel.grad_sync=per_update "
            "(and parallel.layout=shared to hold Q = G / W of them)"
        )
    return None


def fsdp_problem(cfg: RunConfig) -> str | None:
    """Why ``parallel.shard=fsdp`` cannot run ``cfg``'s schedule (every schedule under ``auto``), or None."""
    t, later = cfg.train, several_updates(cfg)
    if t.schedule != AUTO and (problem := whole_gradient_buffers(cfg, t.schedule)):
        return problem
    schedules = [SCHEDULES[name] for name in runnable(cfg)] if t.schedule == AUTO else [SCHEDULES[t.schedule]]
    # the update recomputes the steps: Recompute, and a hybrid's later updates
    update_forwards = [s for s in schedules if not s.tracks_rollout_graphs or (s.exact_only_on_policy and later)]
    if cfg.algorithm.skip_zero_advantage and update_forwards and t.recompute_batching == RECOMPUTE_BATCHINGS.default:
        return (
            f"with algorithm.skip_zero_advantage, {BASELINE}'s update runs as many forwards as a process keeps "
            "samples, and sharded passes must run in lockstep; set algorithm.skip_zero_advantage=false, or "
            "train.recompute_batching=rollout, or a Lean train.schedule"
        )
    return None


def with_schedule(cfg: RunConfig, schedule: str) -> RunConfig:
    """``cfg`` with ``train.schedule=schedule``."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, schedule=schedule))


def run_problem(cfg: RunConfig, name: str, world_size: int) -> str | None:
    """Why a run of ``cfg`` on ``world_size`` processes refuses the schedule ``name`` for where its gradients live
    (a sharded run's rules, :func:`fsdp_problem`; a sync after every backward, :func:`backward_sync_problem`), or None:
    what the certificate and the benchmarks leave out of the schedules they compare, saying why."""
    if shards(cfg.parallel.shard) and world_size > 1 and (why := fsdp_problem(with_schedule(cfg, name))):
        return why
    return backward_sync_problem(cfg, name)


def several_updates(cfg: RunConfig) -> list[str]:
    """``train.<key>=<value>`` of each key that gives a rollout more than one update (empty: one, on-policy)."""
    t = cfg.train
    keys = ("optimizer_steps_per_iteration", "num_inner_epochs")
    later = [f"train.{k}={getattr(t, k)}" for k in keys if getattr(t, k) != 1]
    if (size := edges_per_update(cfg)) is not None:  # a tree's edges, G a step (edge_updates.py)
        later.append(f"train.edges_per_update={size}")
    return later


def schedule_problem(cfg: RunConfig, name: str) -> tuple | None:
    """(key, value, why[, the overrides that fix it]) when the schedule ``name`` cannot run ``cfg`` exactly, or
    None: the algorithm's facts it needs, the first update's samples before the rollout for a Lean schedule's hybrid
    (``hybrid.py``), provisional gradients under a sharded full fine-tune or a per-backward sync."""
    t, a = cfg.train, cfg.algorithm
    schedule = SCHEDULES[name]
    if problem := algorithm_problem(schedule, ALGORITHMS[a.name]):
        return "train.schedule", name, f"cannot run algorithm.name={a.name} exactly: {problem}"
    later = several_updates(cfg)
    # A hybrid (hybrid.py) draws the first update's samples before the rollout: the same local rows on every process
    # (the order's stream is shared, the local batches are equal), so sharded passes stay in lockstep.
    if schedule.exact_only_on_policy and later and a.skip_zero_advantage and not splits_first(cfg, hybrid=True):
        on_policy = "train.on_policy=true (the recipe's one-step form), or " if t.num_inner_epochs == 1 else ""
        return (
            "algorithm.zero_advantage_order",
            a.zero_advantage_order,
            f"splits only the nonzero-advantage samples into the updates (FlowGRPO), so with {' and '.join(later)} "
            f"the first update's samples are known only after the rewards, and train.schedule={name} cannot roll "
            f"them out with gradients; set algorithm.zero_advantage_order=split_then_filter (or auto), or "
            f"{on_policy}use train.schedule={BASELINE}",
            [f"algorithm.zero_advantage_order={SPLIT_THEN_FILTER}"],
        )
    if shards(cfg.parallel.shard) and (problem := whole_gradient_buffers(cfg, name)):
        return "parallel.shard", cfg.parallel.shard, problem, [f"parallel.grad_sync={PER_UPDATE}"]
    if (problem := backward_sync_problem(cfg, name)) is not None:
        return "parallel.grad_sync", cfg.parallel.grad_sync, problem, [f"parallel.grad_sync={PER_UPDATE}"]
    return None


def backward_sync_problem(cfg: RunConfig, name: str) -> str | None:
    """Why the schedule ``name`` cannot sync every backward's gradient (``parallel.grad_sync=per_backward``), or
    None: Reweight's backwards are provisional (LeanGRPO App. C: once synchronised, a sample's gradient is mixed with
    the others' and its advantage cannot be applied); Retain scales its early backwards after the last group when N
    is known only then (the zero-advantage filter)."""
    if resolve_grad_sync(cfg) != PER_BACKWARD or sharded_full_finetune(cfg):
        return None  # per_update; or FSDP2's own reduce-scatters of the shards (fsdp_problem's rules)
    schedule = SCHEDULES[name]
    if schedule.backward_in_rollout:
        return (
            f"{name}'s backwards in the rollout are provisional (advantage 1): synchronised before the advantage is "
            "applied, the samples' gradients mix and cannot be corrected (LeanGRPO App. C); use per_update"
        )
    if schedule is Retain and cfg.algorithm.skip_zero_advantage:
        return (
            f"with algorithm.skip_zero_advantage, {name} scales its gradient by the kept samples' count after the "
            "last group, when the early backwards are synchronised already; use per_update"
        )
    return None


def compared_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` as the certificate runs every schedule on it: ``algorithm.zero_advantage_order: auto`` resolved to the
    hybrids' order when they apply (Recompute then draws its first update as they do, and the gradients compare)."""
    a = cfg.algorithm
    if a.skip_zero_advantage and a.zero_advantage_order == AUTO and several_updates(cfg):
        return dataclasses.replace(cfg, algorithm=dataclasses.replace(a, zero_advantage_order=SPLIT_THEN_FILTER))
    return cfg


def runnable(cfg: RunConfig) -> list[str]:
    """The schedules that run ``cfg`` exactly: those ``train.schedule: auto`` chooses among (the baseline always)."""
    return [name for name in SCHEDULES if schedule_problem(cfg, name) is None]


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """An explicit schedule must run ``cfg`` exactly (:func:`schedule_problem`); ``auto`` takes one that does. Then
    what Recompute's batching and sharding allow."""
    t = cfg.train
    if t.schedule != AUTO and (problem := schedule_problem(cfg, t.schedule)):
        raise ConfigError(*problem)
    if t.recompute_batching != RECOMPUTE_BATCHINGS.default and (later := several_updates(cfg)):
        raise ConfigError(
            "train.recompute_batching",
            t.recompute_batching,
            f"batches one on-policy update like the rollout; change {' and '.join(f'{k} (set 1)' for k in later)}",
        )
    if shards(cfg.parallel.shard) and (problem := fsdp_problem(cfg)):
        raise ConfigError("parallel.shard", cfg.parallel.shard, problem)
    retain_options_problem(cfg)


def retain_options_problem(cfg: RunConfig) -> None:
    """``train.retain``'s keys other than their defaults configure Retain: refused in one line under a schedule that
    keeps no graph."""
    r, schedule = cfg.train.retain, cfg.train.schedule
    if schedule in (RETAIN, AUTO):
        return
    why = "backpropagates each step at once and keeps no graph" if schedule == "reweight" else "keeps no graph"
    for key, default in (("steps", ALL_STEPS), ("offload", DEVICE), ("backward", UNIT_BACKWARD)):
        if getattr(r, key) != default:
            raise ConfigError(
                f"train.retain.{key}",
                getattr(r, key),
                f"applies to train.schedule={RETAIN}; {schedule} {why}",
                [f"train.schedule={RETAIN}"],
            )


__all__ = [
    "algorithm_problem",
    "algorithm_schedules",
    "backward_sync_problem",
    "check_config",
    "compared_config",
    "fsdp_problem",
    "run_problem",
    "runnable",
    "schedule_class",
    "schedule_problem",
    "with_schedule",
    "AUTO",
    "BASELINE",
    "LEAN_SCHEDULES",
    "RETAIN",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
    "IterationContext",
    "IterationCosts",
    "Prediction",
    "RowCounts",
    "Schedule",
]
