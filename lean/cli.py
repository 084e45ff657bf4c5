"""The ``lean`` command: train, plan, equivalence, bench {schedules, overlap}, launch, sync.

Configuration errors print one line and exit with status 2, before any model is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist

from lean import equivalence, plan, tracking
from lean.bench import overlap as bench_overlap
from lean.bench.schedules import bench_config, bench_schedules
from lean.config import ConfigError, load_config
from lean.launch import launch
from lean.train import train

EXIT_CONFIG, EXIT_NONFINITE, EXIT_COLLECTIVE = 2, 3, 4


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        default=None,
        help="YAML file with model/sample/reward/train/eval sections (default: ./params.yaml if it exists)",
    )
    p.add_argument("--preset", default=None, help="named recipe from lean/presets, applied on top of --params")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set model.family=wan (repeatable)",
    )
    p.add_argument("--out", default=None, help="output folder")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="lean", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="GRPO training with the configured schedule")
    _add_run_options(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--force", action="store_true", help="with --resume: continue even if the config has changed")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (sets train.threads)")
    _add_run_options(sub.add_parser("plan", help="predicted peak memory and time per iteration of each schedule"))
    _add_run_options(
        sub.add_parser("equivalence", help="one iteration of each schedule from the same weights; gradient differences")
    )

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    b = bench.add_parser("schedules", help="the schedules interleaved: speedup, bound, MFU/HFU, peak memory")
    _add_run_options(b)
    b.add_argument("--repeats", type=int, default=None, help="timed rounds (default: params.yaml bench.repeats)")
    b.add_argument("--warmup", type=int, default=None, help="discarded rounds (default: bench.warmup)")
    b.add_argument(
        "--threads", type=int, default=None, help="torch threads, 0: torch's default (default: bench.threads)"
    )
    bench_overlap.add_arguments(bench.add_parser("overlap", help="FlashOverlap ops: collective vs sliced vs flash"))

    p = sub.add_parser("launch", help="run a lean command on N processes through Accelerate (gloo on CPU)")
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- <lean command and its options>")

    p = sub.add_parser("sync", help="send a run's MLflow calls that waited for an unreachable store")
    p.add_argument("--out", required=True, help="the run's output folder (holds tracking_pending.jsonl)")
    return top


def _params(args) -> str | None:
    return args.params if args.params is not None else ("params.yaml" if os.path.exists("params.yaml") else None)


# ---------------------------------------------------------------- commands


def _train(args) -> int:
    overrides = [*args.overrides, *([f"train.threads={args.threads}"] if args.threads is not None else [])]
    cfg = load_config(_params(args), overrides, preset=args.preset)
    train(cfg, out=args.out, resume=args.resume, force=args.force)
    return 0


def _plan(args) -> int:
    plan.main(load_config(_params(args), args.overrides, preset=args.preset), out=args.out)
    return 0


def _equivalence(args) -> int:
    equivalence.main(load_config(_params(args), args.overrides, preset=args.preset), out=args.out)
    return 0


def _bench(args) -> int:
    if args.bench == "overlap":
        return bench_overlap.main(bench_overlap.options_from_args(args))
    # the params.yaml `bench` section is the benchmark's default config
    cfg, options = bench_config(
        _params(args), args.overrides, args.preset, repeats=args.repeats, warmup=args.warmup, threads=args.threads
    )
    bench_schedules(cfg, out=args.out, options=options)
    return 0


def _launch(args) -> int:
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if not rest:
        raise ConfigError("launch", "", "give the lean command to run after --")
    if args.num_processes < 1:
        raise ConfigError("--num-processes", args.num_processes, "must be >= 1")
    return launch(args.num_processes, rest)


def _sync(args) -> int:
    if not Path(args.out).is_dir():
        raise ConfigError("--out", args.out, "must be the output folder of a run (it does not exist)")
    pending = tracking.sync(Path(args.out) / tracking.SPOOL)
    print(f"lean sync: {pending} call(s) still pending" if pending else "lean sync: nothing pending")
    return 1 if pending else 0


COMMANDS = {
    "train": _train,
    "plan": _plan,
    "equivalence": _equivalence,
    "bench": _bench,
    "launch": _launch,
    "sync": _sync,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"lean: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except FloatingPointError as e:  # lean.iteration.NonFiniteError with train.on_nonfinite=abort
        print(f"lean: rank {rank}: stopped: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Exception as e:
        if not _distributed_failure(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"lean: rank {rank}: a collective failed ({first}); a peer process died or stalled past "
            "train.dist_timeout_s",
            file=sys.stderr,
        )
        return EXIT_COLLECTIVE


def _distributed_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(k in text for k in ("gloo", "nccl", "connection", "timed out"))


if __name__ == "__main__":
    sys.exit(main())
