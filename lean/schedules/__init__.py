"""The three update schedules, registered once. Each file states its algorithm and its cost model; ``base.py`` holds
the contract and what they share. Adding a schedule is one new file plus one :data:`SCHEDULES` line."""

from lean.registry import Registry
from lean.schedules.base import IterationContext, IterationCosts, Prediction, Schedule
from lean.schedules.recompute import Recompute
from lean.schedules.retain import Retain
from lean.schedules.reweight import Reweight

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
AUTO = "auto"  # not a schedule: `train.schedule: auto` picks one of LEAN_SCHEDULES from the predicted memory
SCHEDULE_CHOICES = (*SCHEDULES, AUTO)

__all__ = [
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
