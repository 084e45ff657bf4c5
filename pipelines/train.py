"""Stage ``train``: the GRPO runs of the ``rl`` section from the pretrained base, one per schedule, and the runs of
``rl.recipe`` (the recipe whose on-policy form those are: several updates per rollout, ``recipe-<schedule>``)
(``lean.train.train``, which logs every iteration to MLflow when tracking is on). The runs are independent and
single-threaded, so they run side by side as child processes (``workbench.parallel_runs`` at once,
``lean.workbench.side_by_side``). Their wall-clock times share the cores; each iteration also records its process CPU
time (``cpu_iteration_s``), which the training notebook's time to reward counts; speed is the ``bench_schedules``
stage's to measure.

    python -m pipelines.train --pretrained outputs/prepare/base [--params params.yaml] [--out outputs/train]
    python -m pipelines.train --schedule retain [--recipe] ...   # one run, in this process (what each child runs)

Writes, per run (``<schedule>`` or ``recipe-<schedule>``), OUT/<run>/metrics.json, metrics.csv (one row per
iteration: the reward curve), lora.safetensors (with ema.enabled also lora_ema.safetensors), rollout.safetensors,
config.json, train.log (the child's output), and the evaluations (``rl.run.eval``): eval.csv (one row per
evaluation: the eval-reward curve) and eval/<iteration>/ (images, grid, samples.csv). With evaluation off, eval.csv
is its header alone and eval/ is empty: the stage's declared outputs exist either way, and the report says there is
nothing to show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lean.observe.outputs import write_csv
from lean.schedules import SCHEDULE_CHOICES, SCHEDULES
from lean.workbench.side_by_side import RunFailed, run_side_by_side
from lean.workbench.stage import begin_stage, stage_config

EVAL_COLUMNS = ["iteration", "eval_reward_mean", "eval_reward_std"]  # the header of an eval.csv without evaluations


RECIPE = "recipe"  # the rl section's second set of runs: rl.recipe.run on top of rl.run


def runs(tree: dict) -> dict[str, tuple[str, str | None]]:
    """Every run of the stage: name -> (schedule, variant): each schedule on ``rl.run``, then each of
    ``rl.recipe.schedules`` on ``rl.recipe.run`` as ``recipe-<schedule>``."""
    recipe = (tree.get("rl") or {}).get(RECIPE) or {}
    named = {s: (s, None) for s in SCHEDULES}
    for s in recipe.get("schedules") or []:
        if s not in SCHEDULES:
            raise SystemExit(f"train: rl.recipe.schedules: {s!r} is not one of {', '.join(SCHEDULES)}")
        named[f"{RECIPE}-{s}"] = (s, RECIPE)
    return named


def train_one(params: str, schedule: str, pretrained: str | None, out: Path, variant: str | None = None) -> None:
    """One run, in this process."""
    from lean.train import train  # here: the side-by-side parent starts processes and never trains

    begin_stage(params)
    cfg = stage_config(params, "rl", pretrained=pretrained, schedule=schedule, variant=variant)
    history = train(cfg, out=str(out))
    if not cfg.eval.every:
        write_csv(out / "eval.csv", [], fields=EVAL_COLUMNS)
        (out / "eval").mkdir(exist_ok=True)
    print(f"train[{out.name}]: reward " + " ".join(f"{row['reward_mean']:.4f}" for row in history))


def train_side_by_side(params: str, pretrained: str | None, out: Path) -> None:
    """Every run as a child process of this module, ``workbench.parallel_runs`` at once."""
    tree = begin_stage(params)
    named = runs(tree)
    jobs = (tree.get("workbench") or {}).get("parallel_runs", len(named))
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise SystemExit(f"train: workbench.parallel_runs={jobs!r}: must be a whole number >= 1 (runs at once)")
    commands, logs = {}, {}
    for name, (schedule, variant) in named.items():
        commands[name] = [sys.executable, "-m", "pipelines.train", "--schedule", schedule, "--params", params]
        commands[name] += ["--out", str(out / name)] + (["--recipe"] if variant else [])
        commands[name] += ["--pretrained", pretrained] if pretrained else []
        logs[name] = out / name / "train.log"
    print(f"train: {', '.join(named)} side by side, {jobs} at once (logs: {out}/<run>/train.log)", flush=True)
    try:
        run_side_by_side(commands, logs, jobs)
    except RunFailed as err:
        raise SystemExit(f"train: {err}") from None
    for name in named:  # each run's last line: its reward curve
        print(next(line for line in reversed(logs[name].read_text().splitlines()) if line.startswith("train[")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default=None, choices=SCHEDULE_CHOICES, help="one run (default: every run)")
    p.add_argument("--recipe", action="store_true", help="with --schedule: on rl.recipe.run (the recipe's run)")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--out", default=None, help="default: outputs/train (outputs/train/<schedule> with --schedule)")
    args = p.parse_args()
    if args.schedule is not None:
        name = f"{RECIPE}-{args.schedule}" if args.recipe else args.schedule
        variant = RECIPE if args.recipe else None
        train_one(args.params, args.schedule, args.pretrained, Path(args.out or f"outputs/train/{name}"), variant)
    else:
        train_side_by_side(args.params, args.pretrained, Path(args.out or "outputs/train"))


if __name__ == "__main__":
    main()
