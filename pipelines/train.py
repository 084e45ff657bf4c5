"""Stage ``train``: every RL run of the ``rl`` section from the pretrained base, side by side. The GRPO runs, one per
schedule (``rl.run``); the runs of ``rl.recipe`` (the recipe whose on-policy form those are: several updates per
rollout, ``recipe-<schedule>``); and each algorithm of ``rl.algorithms`` on the same task (``rl.<algorithm>.run`` on
``rl.run``: its name, its schedule, what it needs to learn at this budget; GRPO's run among them is the ``retain``
run). Each is ``lean.train.train``, which logs every iteration to MLflow when tracking is on. The runs are independent
and single-threaded, so they run as forked children of one pool (``workbench.parallel_runs`` at once,
``lean.workbench.side_by_side``): one pool keeps the cores busy until its last run, where a stage per group of runs
would drain the pool once per group. Their wall-clock times share the cores; each iteration also records its process
CPU time (``cpu_iteration_s``), which the training notebook's time to reward counts; speed is the
``bench_schedules`` stage's to measure.

    python -m pipelines.train --pretrained outputs/prepare/base [--params params.yaml] [--out outputs/train]
                              [--algorithms-out outputs/algorithms]
    python -m pipelines.train --schedule retain [--recipe] ...   # one run, in this process (what each child runs)
    python -m pipelines.train --algorithm nft ...                # one algorithm's run (outputs/algorithms/nft)

Writes, per run (OUT/<schedule>, OUT/recipe-<schedule>, ALGORITHMS_OUT/<algorithm>), metrics.json, metrics.csv (one
row per iteration: the reward curve), lora.safetensors (with ema.enabled also lora_ema.safetensors),
rollout.safetensors, config.json, train.log (the child's output), and the evaluations (``rl.run.eval``): eval.csv (one
row per evaluation: the eval-reward curve) and eval/<iteration>/ (images, grid, samples.csv). With evaluation off,
eval.csv is its header alone and eval/ is empty: the stage's declared outputs exist either way, and the report says
there is nothing to show.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from lean.algorithms import ALGORITHMS
from lean.models.build import import_components
from lean.observe import tracking
from lean.observe.outputs import write_csv
from lean.schedules import SCHEDULE_CHOICES, SCHEDULES
from lean.workbench.side_by_side import RunFailed, parallel_runs, run_side_by_side
from lean.workbench.stage import begin_stage, stage_config

EVAL_COLUMNS = ["iteration", "eval_reward_mean", "eval_reward_std"]  # the header of an eval.csv without evaluations


RECIPE = "recipe"  # the rl section's second set of runs: rl.recipe.run on top of rl.run


@dataclass(frozen=True)
class RLRun:
    """One run of the stage: its folder, and what picks its config: ``rl.run``, then ``rl.<variant>.run`` on top
    (the recipe's or an algorithm's), then the schedule (None: the variant's run sets it, as an algorithm's does)."""

    out: Path
    schedule: str | None = None
    variant: str | None = None

    @property
    def algorithm(self) -> str | None:
        """The algorithm this run is of, when it is one of ``rl.algorithms``' runs."""
        return self.variant if self.variant not in (None, RECIPE) else None


def runs(tree: dict, out: Path, algorithms_out: Path) -> dict[str, RLRun]:
    """Every run of the stage, name -> run, in the order they start: each of ``rl.algorithms`` on
    ``rl.<algorithm>.run`` (ALGORITHMS_OUT/<algorithm>), each schedule on ``rl.run`` (OUT/<schedule>), then each of
    ``rl.recipe.schedules`` on ``rl.recipe.run`` (OUT/recipe-<schedule>). The algorithms first: their costs differ
    most (NFT's update runs three forwards a draw, the longest run), and a pool that starts its long runs first ends
    on short ones, not on one long run alone on a core."""
    rl = tree.get("rl") or {}
    named = {}
    for a in rl.get("algorithms") or []:
        if a not in ALGORITHMS:
            raise SystemExit(f"train: rl.algorithms: {a!r} is not one of {', '.join(ALGORITHMS)}")
        named[a] = RLRun(algorithms_out / a, None, a)
    named.update({s: RLRun(out / s, s) for s in SCHEDULES})
    for s in (rl.get(RECIPE) or {}).get("schedules") or []:
        if s not in SCHEDULES:
            raise SystemExit(f"train: rl.recipe.schedules: {s!r} is not one of {', '.join(SCHEDULES)}")
        named[f"{RECIPE}-{s}"] = RLRun(out / f"{RECIPE}-{s}", s, RECIPE)
    return named


def train_one(params: str, run: RLRun, pretrained: str | None) -> None:
    """One run, in this process."""
    from lean.train import train  # here: the side-by-side parent starts processes and never trains

    begin_stage(params)
    cfg = stage_config(params, "rl", pretrained=pretrained, schedule=run.schedule, variant=run.variant)
    if run.algorithm is not None and cfg.algorithm.name != run.algorithm:
        raise SystemExit(f"train: rl.{run.algorithm}.run sets algorithm.name={cfg.algorithm.name}")
    history = train(cfg, out=str(run.out))
    if not cfg.eval.every:
        write_csv(run.out / "eval.csv", [], fields=EVAL_COLUMNS)
        (run.out / "eval").mkdir(exist_ok=True)
    print(f"train[{run.out.name}]: reward " + " ".join(f"{row['reward_mean']:.4f}" for row in history))


def train_side_by_side(params: str, pretrained: str | None, out: Path, algorithms_out: Path) -> None:
    """Every run as a forked child of this process, ``workbench.parallel_runs`` at once: the parent imports what a
    run builds with (and MLflow when tracking), then forks, so that no child imports it again."""
    tree = begin_stage(params)
    named = runs(tree, out, algorithms_out)
    try:
        jobs = parallel_runs(tree, default=len(named))
    except ValueError as err:
        raise SystemExit(f"train: {err}") from None
    import_components(stage_config(params, "rl", pretrained=pretrained).model.family)
    tracking.import_client()
    commands = {name: partial(train_one, params, run, pretrained) for name, run in named.items()}
    logs = {name: run.out / "train.log" for name, run in named.items()}
    print(f"train: {', '.join(named)} side by side, {jobs} at once (logs: <run>/train.log)", flush=True)
    try:  # the store made ready in a child of its own: the parent opens no connection that its forks would share
        run_side_by_side({"store": tracking.ready_store}, {"store": out / "store.log"}, jobs=1)
        run_side_by_side(commands, logs, jobs)
    except RunFailed as err:
        raise SystemExit(f"train: {err}") from None
    for name in named:  # each run's last line: its reward curve
        print(next(line for line in reversed(logs[name].read_text().splitlines()) if line.startswith("train[")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    one = p.add_mutually_exclusive_group()
    one.add_argument("--schedule", default=None, choices=SCHEDULE_CHOICES, help="one run (default: every run)")
    one.add_argument("--algorithm", default=None, choices=list(ALGORITHMS), help="one algorithm's run (rl.<algorithm>)")
    p.add_argument("--recipe", action="store_true", help="with --schedule: on rl.recipe.run (the recipe's run)")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--out", default=None, help="default: outputs/train (one run: its folder, as the stage writes it)")
    p.add_argument("--algorithms-out", default="outputs/algorithms", help="the algorithms' runs' folder")
    args = p.parse_args()
    if args.schedule is not None:
        variant = RECIPE if args.recipe else None
        name = f"{RECIPE}-{args.schedule}" if args.recipe else args.schedule
        train_one(
            args.params, RLRun(Path(args.out or f"outputs/train/{name}"), args.schedule, variant), args.pretrained
        )
    elif args.algorithm is not None:
        out = Path(args.out or Path(args.algorithms_out) / args.algorithm)
        train_one(args.params, RLRun(out, None, args.algorithm), args.pretrained)
    else:
        train_side_by_side(args.params, args.pretrained, Path(args.out or "outputs/train"), Path(args.algorithms_out))


if __name__ == "__main__":
    main()
