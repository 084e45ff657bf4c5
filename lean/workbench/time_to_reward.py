"""Time to reward: what a user buys is eval reward per hour of compute, not seconds per iteration.

A run's eval curve is its eval reward r_e (``eval.csv``: ODE samples from fixed noise) after i_e iterations; its cost
curve the time T_i spent training the first i iterations (``metrics.csv``: per iteration, process CPU seconds
``cpu_iteration_s``, or wall seconds ``time_iteration_s``; evaluations excluded):

    T_i = sum_{j < i} t_j

The time to reach a target eval reward r* is where the curve (T_{i_e}, r_e) first crosses r*, linear between the two
evaluations around the crossing; None when the run never reaches it. The workbench's target is the base model's eval
reward plus ``rl.time_to_reward_gain``: one number for every run (they share the base and the eval noise).

CPU seconds compare runs that shared the cores (the train stage runs them side by side): each process's own work,
not the time it waited for a core; they are the machine's (a slower core, another ISA's kernels), so the workbench
shows them and checks their ratio to GRPO-Recompute's only as information. Samples are the axis that means the same
on every machine (``SAMPLES``: the rollout samples of the first i iterations, prompts x group size each, a tree's
leaves): runs with the same samples per optimizer step differ per sample only in how each step learns.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

SAMPLES = "samples"
"""The cost key of the samples axis: each iteration's rollout samples (``rollout_samples``), not a metrics column."""


def cumulative(costs: Sequence[float]) -> list[float]:
    """T_i for i = 0..len(costs): the cost of the first i iterations."""
    totals = [0.0]
    for cost in costs:
        totals.append(totals[-1] + cost)
    return totals


def eval_curve(evals: Sequence[dict], iterations: Sequence[dict], key: str = "cpu_iteration_s") -> list[tuple]:
    """(T_{i_e}, r_e) of every evaluation, from ``eval.csv``'s rows and ``metrics.csv``'s (``key``: the cost)."""
    ordered = sorted(iterations, key=lambda row: row["iteration"])
    spent = cumulative([row[key] for row in ordered])
    return [(spent[int(row["iteration"])], row["eval_reward_mean"]) for row in evals]


def time_to_reward(curve: Sequence[tuple], target: float) -> float | None:
    """When the curve ``[(time, reward), ...]`` first reaches ``target`` (linear between evaluations), or None."""
    for (t0, r0), (t1, r1) in zip(curve, curve[1:]):
        if r0 >= target:
            return t0
        if r1 >= target:
            return t0 + (t1 - t0) * (target - r0) / (r1 - r0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def read_numbers(path: str | Path) -> list[dict]:
    """A run's CSV (``metrics.csv``, ``eval.csv``) as numbers, empty cells left out; no rows when it is missing (a
    run without evaluation)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def rollout_samples(folder: str | Path) -> int | None:
    """Samples one iteration of the run in ``folder`` rolls out, from its ``config.json``: prompts per iteration x
    group size (a tree's leaves are its group); None without the file."""
    try:
        train = json.loads((Path(folder) / "config.json").read_text())["train"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(train["prompts_per_iteration"]) * int(train["group_size"])


def run_time_to_reward(folder: str | Path, gain: float, key: str = "cpu_iteration_s") -> float | None:
    """The time to reward of the run in ``folder``: when its eval reward first reaches its first evaluation's (the
    base model's) plus ``gain``, in ``key`` (a ``metrics.csv`` column, or ``SAMPLES``); None without evaluations or
    when it never does."""
    evals, iterations = read_numbers(Path(folder) / "eval.csv"), read_numbers(Path(folder) / "metrics.csv")
    if key == SAMPLES and (per_iteration := rollout_samples(folder)) is not None:
        iterations = [{**row, SAMPLES: float(per_iteration)} for row in iterations]
    if not evals or not iterations or key not in iterations[0]:
        return None
    return time_to_reward(eval_curve(evals, iterations, key), evals[0]["eval_reward_mean"] + gain)
