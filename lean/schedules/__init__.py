"""The three update schedules. Each file states its algorithm; ``base.py`` holds what they share."""

from lean.schedules.base import IterationContext, Schedule
from lean.schedules.recompute import Recompute
from lean.schedules.retain import Retain
from lean.schedules.reweight import Reweight

SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (Recompute, Retain, Reweight)}

__all__ = ["SCHEDULES", "IterationContext", "Schedule", "Recompute", "Retain", "Reweight"]
