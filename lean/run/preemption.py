"""Preemption: SIGTERM stops ``lean train`` at the next safe point, with a checkpoint, instead of mid-iteration.

Cluster schedulers (Slurm, Kubernetes, spot instances) send SIGTERM and, after a grace period, SIGKILL. While
:class:`StopOnSigterm` is active the signal only sets a flag; the training loop reads it after each iteration (the
safe point: the optimizer has stepped, nothing is half-updated), writes a checkpoint and raises :class:`Preempted`,
which ``lean`` turns into one line on stderr and exit status 143 (128 + SIGTERM, what a shell reports for a job
SIGTERM ended). ``lean train --resume`` then continues bit-identically. An iteration must fit in the grace period.

With several processes the ranks agree before any of them stops (one small all-reduce per iteration): a scheduler
signals every process, but not at the same instant, and a rank that stopped alone would leave the others waiting in
a collective.
"""

from __future__ import annotations

import signal
import threading

import torch

from lean.parallel.distributed import World

EXIT_PREEMPTED = 128 + signal.SIGTERM


class Preempted(Exception):
    """``lean train`` stopped on SIGTERM after a complete iteration, its checkpoint written."""


class StopOnSigterm:
    """``with StopOnSigterm() as stop:`` SIGTERM sets ``stop.signalled``; the previous handler comes back on exit.
    Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self):
        self.signalled = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    def __enter__(self) -> StopOnSigterm:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def requested(self, world: World) -> bool:
        """Whether any process was signalled (all processes call this at the same point of every iteration)."""
        if world.size == 1:
            return self.signalled
        flag = torch.tensor([float(self.signalled)], device=world.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
