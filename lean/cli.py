"""The ``lean`` command: train, plan, equivalence, bench {schedules, overlap}, launch, sync.

Configuration errors print one line and exit with status 2, before any model is built.
"""

from __future__ import annotations

import argparse
import os
import sys

from lean.config import ConfigError


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default=None, help="YAML file with model/sample/reward/train sections "
                   "(default: ./params.yaml if it exists)")
    p.add_argument("--preset", default=None, help="named recipe from lean/presets, applied on top of --params")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set model.family=wan (repeatable)")
    p.add_argument("--out", default=None, help="output folder")


def _params(args) -> str | None:
    return args.params if args.params is not None else ("params.yaml" if os.path.exists("params.yaml") else None)


def _config(args):
    from lean.config import load_config

    return load_config(_params(args), args.overrides, preset=args.preset)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lean", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="GRPO training with the configured schedule")
    _add_run_options(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")

    p = sub.add_parser("plan", help="predicted peak memory and time per iteration of each schedule")
    _add_run_options(p)

    p = sub.add_parser("equivalence", help="one iteration of each schedule from the same weights; gradient diffs")
    _add_run_options(p)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("schedules", help="recompute vs retain vs reweight, interleaved")
    _add_run_options(b)
    b.add_argument("--repeats", type=int, default=None, help="timed rounds (default: params.yaml bench.repeats)")
    b.add_argument("--warmup", type=int, default=None, help="discarded rounds (default: bench.warmup)")
    b.add_argument("--threads", type=int, default=None, help="torch threads, 0: torch's default (default: "
                   "bench.threads)")
    bench.add_parser("overlap", help="FlashOverlap ops: collective vs sliced vs flash", add_help=False)

    p = sub.add_parser("launch", help="run a lean command on N processes through Accelerate (gloo on CPU)")
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- <lean command and its options>")

    p = sub.add_parser("sync", help="send a run's MLflow calls that waited for an unreachable store")
    p.add_argument("--out", required=True, help="the run's output folder (holds tracking_pending.jsonl)")

    # `lean bench overlap ...` owns its own option parsing (it re-launches itself on every rank).
    if argv[:2] == ["bench", "overlap"]:
        from lean.overlap.bench import cli_main

        return cli_main(argv[2:])

    args = parser.parse_args(argv)
    try:
        if args.command == "launch":
            from lean.launch import launch

            rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
            if not rest:
                parser.error("launch: give the lean command to run after --")
            if args.num_processes < 1:
                raise ConfigError("--num-processes", args.num_processes, "must be >= 1")
            return launch(args.num_processes, rest)
        if args.command == "sync":
            from pathlib import Path

            from lean import tracking

            if not Path(args.out).is_dir():
                raise ConfigError("--out", args.out, "must be the output folder of a run (it does not exist)")
            pending = tracking.sync(Path(args.out) / tracking.SPOOL)
            print(f"lean sync: {pending} call(s) still pending" if pending else "lean sync: nothing pending")
            return 1 if pending else 0
        if args.command == "bench":  # the bench section of params.yaml holds the benchmark's default config
            from lean.bench import bench_config, bench_schedules

            cfg, opts = bench_config(_params(args), args.overrides, args.preset, repeats=args.repeats,
                                     warmup=args.warmup, threads=args.threads)
            bench_schedules(cfg, out=args.out, repeats=opts.repeats, warmup=opts.warmup, threads=opts.threads)
            return 0
        cfg = _config(args)
        if args.command == "train":
            from lean.train import train

            train(cfg, out=args.out, resume=args.resume)
        elif args.command == "plan":
            from lean.plan import main as plan_main

            plan_main(cfg, out=args.out)
        elif args.command == "equivalence":
            from lean.equivalence import main as equivalence_main

            equivalence_main(cfg, out=args.out)
    except ConfigError as e:
        print(f"lean: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # lean.train.NonFiniteError with train.on_nonfinite=abort
        print(f"lean: rank {os.environ.get('RANK', '0')}: stopped: {e}", file=sys.stderr)
        return 3
    except Exception as e:
        if not _distributed_failure(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"lean: rank {os.environ.get('RANK', '0')}: a collective failed ({first}); a peer process died or "
              f"stalled past train.dist_timeout_s", file=sys.stderr)
        return 4
    return 0


def _distributed_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(k in text for k in ("gloo", "nccl", "connection", "timed out"))


if __name__ == "__main__":
    sys.exit(main())
