"""Independent runs of one stage side by side: one child process each, at most ``jobs`` at once.

DVC runs its stages one after another, and each workbench run uses one torch thread (tiny models are overhead-bound,
``workbench.threads``), so on a 2-core machine one core idles through the RL runs. The ``train`` stage therefore starts
every RL run (the schedules', the recipe's, the algorithms') as child processes of its own, one pool: three
single-threaded runs on two cores take about 1.5 run lengths instead of 3, and a pool drains (leaves a core idle) once,
at its end. Each child writes its own log; a failure stops the others and shows the failed log's tail. The runs are
independent (same base, same seed, no communication): sharing the cores changes their timings, not their numbers.
SIGTERM (what schedulers send) reaches every child.

A run is a command (a new interpreter) or a function, which runs in a forked child of this process: a child then
starts with the parent's imports (torch, diffusers, transformers, peft, MLflow: about 6 s of CPU per interpreter on
this machine) instead of paying them again. Fork before anything opens a store connection or starts threads (the
``train`` stage imports, then forks; it builds nothing).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

POLL_S = 0.5  # how often the finished children are collected
TAIL_LINES = 40  # of a failed child's log


Run = Sequence[str] | Callable[[], object]  # argv of a new process, or a function for a forked child


class RunFailed(RuntimeError):
    """A child run exited non-zero: its name, status and the tail of its log."""


class Forked:
    """A function in a forked child, with ``subprocess.Popen``'s face (poll, returncode, terminate, kill, wait): its
    stdout and stderr go to ``log``; an exception exits 1 with its traceback there, ``SystemExit(n)`` exits n."""

    def __init__(self, target: Callable[[], object], log: Path):
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        self.process = multiprocessing.get_context("fork").Process(target=_in_child, args=(target, str(log)))
        self.process.start()

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("forked run", timeout)
        return self.process.exitcode


def _in_child(target: Callable[[], object], log: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's pool handler
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Python's streams on the new descriptors too (a parent's may write elsewhere, as under pytest's capture)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        target()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def start_run(run: Run, log: Path) -> subprocess.Popen | Forked:
    """``run`` started, writing to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if callable(run):
        return Forked(run, log)
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(list(run), stdout=out, stderr=subprocess.STDOUT)


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


def run_side_by_side(commands: Mapping[str, Run], logs: Mapping[str, Path], jobs: int) -> dict[str, float]:
    """Run ``commands`` (name -> argv or function), ``jobs`` at a time in the given order, each with stdout and stderr
    to ``logs[name]``; returns each run's wall seconds. Raises :class:`RunFailed` at the first failure, after
    terminating the runs still going."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    waiting = list(commands)
    running: dict[str, tuple[subprocess.Popen | Forked, float]] = {}
    seconds: dict[str, float] = {}
    previous = signal.signal(signal.SIGTERM, lambda *_: _stop(running, "terminated"))
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                name = waiting.pop(0)
                running[name] = (start_run(commands[name], logs[name]), time.perf_counter())
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


def _stop(running: dict[str, tuple[subprocess.Popen | Forked, float]], why: str) -> None:
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
