"""Independent runs of one stage side by side: one child process each, at most ``jobs`` at once.

DVC runs its stages one after another, and each workbench run uses one torch thread (tiny models are overhead-bound,
``workbench.threads``), so on a 2-core machine one core idles through the RL runs. The ``train`` stage therefore starts
every RL run (the schedules', the recipe's, the algorithms') as child processes of its own, one pool: three
single-threaded runs on two cores take about 1.5 run lengths instead of 3, and a pool drains (leaves a core idle) once,
at its end. Each child writes its own log; a failure stops the others and shows the failed log's tail. The runs are
independent (same base, same seed, no communication): sharing the cores changes their timings, not their numbers.
SIGTERM (what schedulers send) reaches every child.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

POLL_S = 0.5  # how often the finished children are collected
TAIL_LINES = 40  # of a failed child's log


class RunFailed(RuntimeError):
    """A child run exited non-zero: its name, status and the tail of its log."""


def parallel_runs(tree: Mapping, default: int) -> int:
    """How many runs a stage starts at once: params.yaml's ``workbench.parallel_runs`` (``default`` without one)."""
    jobs = (tree.get("workbench") or {}).get("parallel_runs", default)
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"workbench.parallel_runs={jobs!r}: must be a whole number >= 1 (runs at once)")
    return jobs


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_side_by_side(commands: Mapping[str, Sequence[str]], logs: Mapping[str, Path], jobs: int) -> dict[str, float]:
    """Run ``commands`` (name -> argv), ``jobs`` at a time in the given order, each with stdout and stderr to
    ``logs[name]``; returns each run's wall seconds. Raises :class:`RunFailed` at the first failure, after
    terminating the runs still going."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    waiting = list(commands)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    seconds: dict[str, float] = {}
    previous = signal.signal(signal.SIGTERM, lambda *_: _stop(running, "terminated"))
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                name = waiting.pop(0)
                logs[name].parent.mkdir(parents=True, exist_ok=True)
                with open(logs[name], "w") as log:  # the child keeps its own descriptor
                    child = subprocess.Popen(list(commands[name]), stdout=log, stderr=subprocess.STDOUT)
                running[name] = (child, time.perf_counter())
            time.sleep(POLL_S)
            for name, (child, start) in list(running.items()):
                if child.poll() is None:
                    continue
                del running[name]
                if child.returncode != 0:
                    _stop(running, f"{name} failed")
                    raise RunFailed(f"{name} exited with status {child.returncode}; {logs[name]}:\n{tail(logs[name])}")
                seconds[name] = time.perf_counter() - start
                print(f"{name}: done in {seconds[name]:.0f} s", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return seconds


def _stop(running: dict[str, tuple[subprocess.Popen, float]], why: str) -> None:
    """Terminate the children still running (then kill those that outlive 20 s)."""
    for child, _ in running.values():
        child.terminate()
    for child, _ in running.values():
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if why == "terminated":
        sys.exit(128 + signal.SIGTERM)
