"""The three update schedules, registered once. Each file states its algorithm and its cost model; ``base.py`` holds
the contract and what they share. Adding a schedule is one new file plus one :data:`SCHEDULES` line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lean.algorithms import ALGORITHMS, FACTS, Algorithm
from lean.config import AUTO, ConfigError  # auto: not a schedule; lean picks one of LEAN_SCHEDULES
from lean.registry import Registry
from lean.schedules.base import IterationContext, IterationCosts, Prediction, Schedule
from lean.schedules.recompute import RECOMPUTE_BATCHINGS, Recompute
from lean.schedules.retain import Retain
from lean.schedules.reweight import Reweight
from lean.sharding import FSDP

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
SCHEDULE_CHOICES = (*SCHEDULES, AUTO)


def algorithm_problem(schedule: type[Schedule], algorithm: type[Algorithm]) -> str | None:
    """Why ``schedule`` cannot reproduce ``algorithm``'s gradient (a fact it needs that the algorithm lacks), or
    None."""
    missing = [FACTS[fact] for fact in sorted(schedule.needs - algorithm.facts)]
    return f"it needs {' and '.join(missing)}, which the algorithm does not declare" if missing else None


def fsdp_problem(cfg: RunConfig) -> str | None:
    """Why ``parallel.shard=fsdp`` cannot run ``cfg``'s schedule (every schedule under ``auto``), or None."""
    m, t = cfg.model, cfg.train
    schedules = SCHEDULES.values() if t.schedule == AUTO else [SCHEDULES[t.schedule]]
    if m.full_finetune and t.schedule != AUTO and SCHEDULES[t.schedule].backward_in_rollout:
        return (
            f"with model.full_finetune, {t.schedule}'s per-trajectory buffers would each be a gradient of the whole "
            "unsharded transformer; use a schedule that backpropagates after the rewards (or LoRA)"
        )
    update_forwards = [s for s in schedules if not s.tracks_rollout_graphs]  # the update recomputes the steps
    if cfg.algorithm.skip_zero_advantage and update_forwards and t.recompute_batching == RECOMPUTE_BATCHINGS.default:
        return (
            f"with algorithm.skip_zero_advantage, {BASELINE}'s update runs as many forwards as a process keeps "
            "samples, and sharded passes must run in lockstep; set algorithm.skip_zero_advantage=false, or "
            "train.recompute_batching=rollout, or a Lean train.schedule"
        )
    return None


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """What the schedule reproduces exactly: the algorithm (its facts), one optimizer step per rollout for the Lean
    schedules, the KL terms it can drop, and what it can run sharded."""
    t, a = cfg.train, cfg.algorithm
    chosen = list(SCHEDULES.values()) if t.schedule == AUTO else [SCHEDULES[t.schedule]]
    algorithm = ALGORITHMS[a.name]
    if t.schedule != AUTO and (problem := algorithm_problem(chosen[0], algorithm)):
        raise ConfigError("train.schedule", t.schedule, f"cannot run algorithm.name={a.name} exactly: {problem}")
    off_policy = [
        f"train.{k}={getattr(t, k)} (set 1)"
        for k in ("optimizer_steps_per_iteration", "num_inner_epochs")
        if getattr(t, k) != 1
    ]
    if any(s.exact_only_on_policy for s in chosen) and off_policy:
        raise ConfigError(
            "train.schedule",
            t.schedule,
            "is exact only on-policy (one optimizer step per rollout "
            f"batch); change {' and '.join(off_policy)}, or use train.schedule={BASELINE}",
        )
    if t.recompute_batching != RECOMPUTE_BATCHINGS.default and off_policy:
        raise ConfigError(
            "train.recompute_batching",
            t.recompute_batching,
            f"batches one on-policy update like the rollout; change {' and '.join(off_policy)}",
        )
    if a.skip_zero_advantage and a.beta > 0 and not all(s.drops_kl_terms for s in chosen):
        raise ConfigError(
            "algorithm.skip_zero_advantage",
            True,
            f"drops samples' KL terms after the rollout, which train.schedule={t.schedule} cannot (it sums them during "
            "the rollout); use train.schedule=recompute or retain, or algorithm.beta=0",
        )
    if cfg.parallel.shard == FSDP and (problem := fsdp_problem(cfg)):
        raise ConfigError("parallel.shard", cfg.parallel.shard, problem)


__all__ = [
    "algorithm_problem",
    "check_config",
    "fsdp_problem",
    "AUTO",
    "BASELINE",
    "LEAN_SCHEDULES",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
    "IterationContext",
    "IterationCosts",
    "Prediction",
    "Schedule",
]
