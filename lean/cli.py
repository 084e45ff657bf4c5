"""The ``lean`` command: train, plan, equivalence, bench {schedules, overlap}, reward {serve, score}, launch, sync, ui,
export, sample.

Configuration errors print one line and exit with status 2, before any model is built.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lean import export
from lean.config import AUTO, ConfigError, suggest
from lean.config.prompts import with_metadata
from lean.configure import load_config, on_policy_form
from lean.models.spec import is_published
from lean.observe import tracking
from lean.parallel.launch import Nodes, launch
from lean.parallel.layout import LAYOUTS
from lean.plan import cost as plan
from lean.plan import meta as meta_plan
from lean.rewards import RewardServerError
from lean.rewards.options import RewardModelConfig
from lean.run.preemption import EXIT_PREEMPTED, Preempted
from lean.schedules import several_updates
from lean.tools import equivalence, sampling
from lean.tools.alignment import deterministic_overrides
from lean.tools.bench import overlap as bench_overlap
from lean.tools.bench.schedules import bench_config, bench_recipe, bench_schedules
from lean.train import train

EXIT_CONFIG, EXIT_NONFINITE, EXIT_COLLECTIVE, EXIT_REWARD_SERVER = 2, 3, 4, 5


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        default=None,
        help="YAML file with the run's sections (model, sample, train, ...; default: ./params.yaml if it exists)",
    )
    p.add_argument("--preset", default=None, help="named recipe from lean/config/presets, applied on top of --params")
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
    """``lean``'s command line: one sub-command per tool, grouped by what they are for."""
    top = argparse.ArgumentParser(prog="lean", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    _training_commands(sub)
    _bench_commands(sub)
    _reward_commands(sub)
    _operations_commands(sub)
    _diffusers_commands(sub)
    return top


def _training_commands(sub) -> None:
    """train, plan, equivalence: a run and what it costs and optimises."""
    p = sub.add_parser("train", help="GRPO training with the configured schedule")
    _add_run_options(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--force", action="store_true", help="with --resume: continue even if the config has changed")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (sets train.threads)")
    p = sub.add_parser("plan", help="predicted peak memory and time per iteration of each schedule")
    _add_run_options(p)
    p.add_argument(
        "--gpu-mem-gb",
        type=float,
        default=None,
        help="plan for GPUs of this memory, counted on the meta device (the default for a published size on a CPU: 80)",
    )
    p.add_argument("--gpus", type=int, default=8, help="with --gpu-mem-gb: the number of GPUs (processes)")
    p.add_argument("--mfu", type=float, default=None, help="with --gpu-mem-gb: the assumed model FLOP utilisation")
    p.add_argument(
        "--gpu",
        choices=sorted(meta_plan.GPUS),
        default=None,
        help=f"plan for this GPU, counted on the meta device: its peak, memory, host link and all-gather bandwidth "
        f"(default for a published size on a CPU: {meta_plan.REFERENCE})",
    )
    p.add_argument(
        "--host-link",
        choices=sorted(meta_plan.HOST_LINK_GB_S),
        default=None,
        help="the GPU's host link for offloaded graphs (default: the --gpu's; train.retain.host_link_gb_s wins)",
    )
    e = sub.add_parser("equivalence", help="one iteration of each schedule from the same weights; gradient differences")
    _add_run_options(e)
    e.add_argument(
        "--save-gradients",
        action="store_true",
        help="also write every schedule's synchronised gradient to OUT/gradients.safetensors",
    )
    e.add_argument(
        "--against",
        default=None,
        help="a gradients.safetensors of another world size or layout: each schedule's gradient must equal it",
    )
    e.add_argument(
        "--deterministic",
        action="store_true",
        help="LeanGRPO's alignment protocol (App. E): deterministic kernels, Recompute at the rollout's micro-batches, "
        "Retain's graphs one backward each; cosine, RelL2, MaxAbs of gradient, update and AdamW moments",
    )


def _bench_commands(sub) -> None:
    """bench schedules | memory | ablation | overlap."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    b = bench.add_parser("schedules", help="the schedules interleaved: speedup, bound, MFU/HFU, peak memory")
    _add_bench_options(b)
    b.add_argument(
        "--threads", type=int, default=None, help="torch threads, 0: torch's default (default: bench.threads)"
    )
    b.add_argument(
        "--cores", type=int, default=None, help="CPUs the process may run on, 0: all (default: bench.cores, 1)"
    )
    b.add_argument(
        "--sweep",
        default=None,
        metavar="KEY=V1,V2,...",
        help="benchmark at each value of one key (e.g. sample.timestep_fraction=0.25,0.5,0.75,1.0): speedup and bound",
    )
    m = bench.add_parser("memory", help="peak memory and time per schedule x layout x activation checkpointing")
    _add_bench_options(m)
    m.add_argument("--threads", type=int, default=None, help="torch threads (default: bench.threads)")
    m.add_argument(
        "--layouts", default=None, help="comma-separated parallel.layout values to measure (default: every applicable)"
    )
    a = bench.add_parser("ablation", help="LeanGRPO's Table 1: native, + shared layout, + coalesced sync, Lean")
    _add_bench_options(a)
    a.add_argument("--threads", type=int, default=None, help="torch threads (default: bench.threads)")
    bench_overlap.add_arguments(bench.add_parser("overlap", help="FlashOverlap ops: collective vs sliced vs flash"))


def _add_bench_options(p: argparse.ArgumentParser) -> None:
    """A benchmark's run options, then its timed and discarded rounds."""
    _add_run_options(p)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default: params.yaml bench.repeats)")
    p.add_argument("--warmup", type=int, default=None, help="discarded rounds (default: bench.warmup)")


def _reward_commands(sub) -> None:
    """reward serve | score."""
    reward = sub.add_parser("reward", help="reward servers and re-scoring").add_subparsers(
        dest="reward_command", required=True
    )
    p = reward.add_parser(
        "serve", help="host a registered reward, or a VLM folder under the OpenAI chat API, over HTTP"
    )
    _add_run_options(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--reward", help="the registered reward to serve (its reward.models entry if any)")
    what.add_argument("--vlm", metavar="FOLDER", help="a transformers VLM folder to serve at /v1/chat/completions")
    p.add_argument("--served-model-name", default=None, help="--vlm: the model's name (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--token-env", default=None, help="environment variable holding the bearer token requests need")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE", help="a module registering rewards"
    )
    p = reward.add_parser("score", help="score a saved rollout (<out>/failed_rollouts/<iteration>.safetensors)")
    _add_run_options(p)
    p.add_argument("--rollout", required=True, help="a .safetensors file lean train kept when a reward server failed")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def _operations_commands(sub) -> None:
    """launch (Accelerate), sync (MLflow calls that waited), ui (MLflow's runs view)."""
    p = sub.add_parser("launch", help="run a lean command on N processes through Accelerate (gloo on CPU)")
    p.add_argument("-n", "--num-processes", type=int, required=True, help="processes on this machine")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job (run lean launch on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0..nnodes-1")
    p.add_argument("--master-addr", default=None, help="node 0's address (multi-node)")
    p.add_argument("--master-port", type=int, default=None, help="a free port on node 0 (multi-node)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- <lean command and its options>")

    p = sub.add_parser("sync", help="send a run's MLflow calls that waited for an unreachable store")
    p.add_argument("--out", required=True, help="the run's output folder (holds tracking_pending.jsonl)")

    p = sub.add_parser(
        "ui",
        help="mlflow ui on the workbench's store, with the URL of its runs view (not GenAI)",
        description="Prints the URL of the experiment's runs view (MLflow 3.17 opens an experiment on its GenAI "
        "overview unless the URL says workflowType=machine_learning) and of the saved view 'lean: schedules "
        "compared' (reward curves, speedup, MFU, certificate per schedule), then runs mlflow ui on the store.",
    )
    where = "default: $MLFLOW_TRACKING_URI, else mlflow.db at the repository root"
    p.add_argument("--store", default=None, help=f"MLflow store: a URI or a SQLite file ({where})")
    p.add_argument("--experiment", default=None, help="default: $LEAN_EXPERIMENT, else params.yaml tracking.experiment")
    p.add_argument("--host", default=None, help="address mlflow ui listens on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="its port (default: 5000)")
    p.add_argument("--workers", type=int, default=1, help="its worker processes (default: 1)")
    p.add_argument(
        "--no-serve", "--print-url", dest="serve", action="store_false", help="print the URLs only, start nothing"
    )


def _diffusers_commands(sub) -> None:
    """export (a LoRA or merged diffusers folder), sample (images from one)."""
    _export_command(sub)
    _sample_command(sub)


def _export_command(sub) -> None:
    """export: a run's trained weights as a diffusers LoRA folder, or merged into a whole pipeline folder."""
    p = sub.add_parser(
        "export",
        help="a run's trained weights for diffusers: a LoRA folder (load_lora_weights), or a merged pipeline folder",
    )
    p.add_argument("--run", required=True, help="the output folder of lean train (config.json, lora.safetensors)")
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--ema", action="store_true", help="the EMA weights (lora_ema.safetensors) instead")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a whole diffusers pipeline folder: the base with the trained weights merged (from_pretrained loads it)",
    )


def _sample_command(sub) -> None:
    """sample: images (video frames) from a diffusers pipeline folder; unset options: the run's."""
    p = sub.add_parser(
        "sample",
        help="images (video frames) from a diffusers pipeline folder and a LoRA folder; unset options: the run's "
        "(the export's lean_sampling.json)",
    )
    p.add_argument("--pretrained", required=True, help="a diffusers pipeline folder (e.g. lean export --merge's)")
    p.add_argument("--lora", default=None, help="a diffusers LoRA folder (e.g. <run>/lora): load_lora_weights")
    p.add_argument("--prompts-file", required=True, help="one prompt per line, or a .jsonl with a prompt field")
    p.add_argument("--out", required=True, help="output folder: <k>.png per prompt (video: <k>/ frames, <k>.gif)")
    run = "the run's (lean_sampling.json), else the pipeline's"
    p.add_argument("--num-steps", type=int, default=None, help=f"sampling steps (default: {run})")
    p.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help=f"the pipeline's guidance_scale: CFG for SD3 and Wan, the distilled guidance for FLUX (default: {run})",
    )
    p.add_argument(
        "--guidance-scale-2",
        type=float,
        default=None,
        help=f"Wan2.2-A14B: the low-noise expert's guidance_scale_2 (default: {run})",
    )
    p.add_argument(
        "--true-cfg-scale",
        type=float,
        default=None,
        help=f"FLUX: CFG against the empty prompt (lean's sample.cfg; default: {run})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompt k starts from the eval noise of eval prompt k, sample 0, at this eval.seed "
        "(default: the run's eval.seed, else 0)",
    )
    p.add_argument("--resolution", type=int, default=None, help=f"image side, px (default: {run}; the eval's side)")
    p.add_argument("--width", type=int, default=None, help=f"frame width where not square (default: {run})")
    p.add_argument("--num-frames", type=int, default=None, help=f"video: frames (default: {run})")
    p.add_argument("--shift", type=float, default=None, help=f"a static sigma shift (default: {run})")
    p.add_argument(
        "--sigma-grid",
        default=None,
        help=f"FLUX, SD3: lean's sigma grid (euler, uniform, unipc) as the pipeline's sigmas (default: {run})",
    )
    p.add_argument("--negative-prompt", default=None, help=f"CFG's unconditional prompt (default: {run})")
    p.add_argument(
        "--shift-terminal", type=float, default=None, help=f"with --sigma-grid: its terminal stretch (default: {run})"
    )
    p.add_argument(
        "--reference-resolution",
        type=int,
        default=None,
        help=f"edits: the square side the reference image is resized to, Lanczos (default: {run}, else --resolution)",
    )
    p.add_argument("--dtype", default=None, help="precision (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--device", default=None, help="default: cuda if there is a GPU, else cpu")


def _params(args) -> str | None:
    return args.params if args.params is not None else ("params.yaml" if os.path.exists("params.yaml") else None)


# ---------------------------------------------------------------- commands


def _train(args) -> int:
    overrides = [*args.overrides, *([f"train.threads={args.threads}"] if args.threads is not None else [])]
    cfg = load_config(_params(args), overrides, preset=args.preset)
    train(cfg, out=args.out, resume=args.resume, force=args.force)
    return 0


def _plan(args) -> int:
    cfg = load_config(_params(args), args.overrides, preset=args.preset)
    published_on_cpu = is_published(cfg.model.size) and not torch.cuda.is_available()
    if args.gpu_mem_gb is None and args.gpu is None and not published_on_cpu:
        plan.main(cfg, out=args.out)
        return 0
    if args.gpus < 1:
        raise ConfigError("--gpus", args.gpus, "must be at least 1")
    if args.gpu_mem_gb is not None and args.gpu_mem_gb <= 0:
        raise ConfigError("--gpu-mem-gb", args.gpu_mem_gb, "must be positive")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError("--mfu", args.mfu, "must be in (0, 1]: the share of the peak FLOP/s a step reaches")
    gpu = args.gpu or meta_plan.REFERENCE
    meta_plan.meta_plan(
        cfg, args.gpus, args.gpu_mem_gb, args.mfu or meta_plan.DEFAULT_MFU, args.out, args.host_link, gpu
    )
    return 0


def _equivalence(args) -> int:
    if args.against and not os.path.isfile(args.against):
        raise ConfigError("--against", args.against, "no such file: a gradients.safetensors of --save-gradients")
    overrides = deterministic_overrides(args.overrides) if args.deterministic else args.overrides
    cfg = load_config(_params(args), equivalence.certificate_overrides(overrides), preset=args.preset)
    equivalence.main(
        cfg, out=args.out, save_gradients=args.save_gradients, against=args.against, deterministic=args.deterministic
    )
    return 0


def _layouts(value: str | None) -> list[str] | None:
    """``--layouts a,b``: names of ``parallel.layout`` (auto is not one), checked before anything is built."""
    if not value:
        return None
    names, known = value.split(","), [name for name in LAYOUTS if name != AUTO]
    if unknown := [n for n in names if n not in known]:
        why = f"{unknown[0]} is not a layout: {', '.join(known)}{suggest(unknown[0], known)}"
        raise ConfigError("--layouts", value, why)
    return names


def _bench(args) -> int:
    if args.bench == "overlap":
        return bench_overlap.main(bench_overlap.options_from_args(args))
    # the params.yaml `bench` section is the benchmark's default config
    chosen = {k: getattr(args, k, None) for k in ("repeats", "warmup", "threads", "cores")}
    if getattr(args, "sweep", None):
        return _bench_sweep(args, chosen)
    cfg, options = bench_config(_params(args), args.overrides, args.preset, **chosen)
    if args.bench == "ablation":
        from lean.tools.bench.ablation import bench_ablation

        bench_ablation(cfg, out=args.out, options=options)
    elif args.bench == "memory":
        from lean.tools.bench.memory import bench_memory

        bench_memory(cfg, out=args.out, options=options, layouts=_layouts(args.layouts))
    elif cfg.parallel.sequence_parallel > 1:  # every schedule x overlap method, exposed communication in ms
        from lean.tools.bench.sequence_parallel import bench_sequence_parallel

        bench_sequence_parallel(cfg, out=args.out, options=options)
    elif several_updates(cfg) and cfg.train.num_inner_epochs == 1:  # a recipe: its hybrids and its on-policy form
        bench_recipe(cfg, out=args.out, options=options)
    else:
        bench_schedules(cfg, out=args.out, options=options)
    return 0


def _bench_sweep(args, chosen: dict) -> int:
    """``lean bench schedules --sweep KEY=V1,V2,...``: the benchmark at each value (``lean.tools.bench.sweep``)."""
    from lean.tools.bench.sweep import bench_sweep, parse_sweep

    key, values = parse_sweep(args.sweep)
    configs = {}
    for value in values:  # every value's config checked before any model is built; a recipe in its on-policy form
        cfg, options = bench_config(_params(args), [*args.overrides, f"{key}={value}"], args.preset, **chosen)
        configs[value] = on_policy_form(cfg) if several_updates(cfg) else cfg

    def run(cfg, folder):
        return bench_schedules(cfg, out=folder, options=options)

    bench_sweep(key, values, configs.__getitem__, run, args.out, int(os.environ.get("RANK", "0")) == 0)
    return 0


def _reward(args) -> int:
    from lean import rewards

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for module in getattr(args, "imports", []):  # before the config is read: they register reward names
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError("--import", module, str(err)) from None
    if args.reward_command == "serve" and args.token_env is not None and not os.environ.get(args.token_env):
        raise ConfigError("--token-env", args.token_env, "this environment variable is not set")
    if args.reward_command == "serve" and args.vlm is not None:
        return _serve_vlm(args, device)
    cfg = load_config(_params(args), args.overrides, preset=args.preset)
    if args.reward_command == "score":
        rollout = Path(args.rollout)
        if not rollout.is_file() or not rollout.with_suffix(".json").is_file():
            raise ConfigError("--rollout", args.rollout, "needs the .safetensors file and its .json beside it")
        images = load_file(rollout)["images"]
        kept = json.loads(rollout.with_suffix(".json").read_text())
        prompts = with_metadata(kept["prompts"], kept.get("metadata"))
        total, parts = rewards.Scorer(cfg.reward, device)(images, prompts)
        print(json.dumps({"total": total.tolist(), **{k: v.tolist() for k, v in parts.items()}}))
        return 0
    if args.reward not in rewards.reward_names():
        known = rewards.reward_names()
        raise ConfigError(
            "--reward", args.reward, f"unknown reward; known: {', '.join(known)}" + suggest(args.reward, known)
        )
    if args.reward in rewards.MODEL_REWARDS:  # checked here even when the config's reward.remote names it
        entry = cfg.reward.models.get(args.reward, RewardModelConfig())
        entry.validate(f"reward.models.{args.reward}")
        rewards.check_folder(f"reward.models.{args.reward}.folder", args.reward, entry.folder)
    reward = rewards.build_reward(args.reward, cfg.reward, device, remote=False)
    from lean.rewards.server import serve  # local: fastapi and uvicorn are optional

    serve(args.reward, reward, args.host, args.port, args.token_env)
    return 0


def _serve_vlm(args, device: str) -> int:
    """lean reward serve --vlm FOLDER: the folder checked, then served until interrupted."""
    from lean.rewards.vlm_server import folder_problem, serve_vlm  # local: transformers is slow to import

    if (problem := folder_problem(Path(args.vlm))) is not None:
        raise ConfigError("--vlm", args.vlm, problem)
    name = args.served_model_name or Path(args.vlm).resolve().name
    serve_vlm(args.vlm, name, device, args.host, args.port, args.token_env)
    return 0


def _launch(args) -> int:
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if not rest:
        raise ConfigError("launch", "", "give the lean command to run after --")
    if args.num_processes < 1:
        raise ConfigError("--num-processes", args.num_processes, "must be >= 1")
    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    if (problem := nodes.problem()) is not None:
        raise ConfigError(*problem)
    return launch(args.num_processes, rest, nodes=nodes)


def _sync(args) -> int:
    if not Path(args.out).is_dir():
        raise ConfigError("--out", args.out, "must be the output folder of a run (it does not exist)")
    pending = tracking.sync(Path(args.out) / tracking.SPOOL)
    print(f"lean sync: {pending} call(s) still pending" if pending else "lean sync: nothing pending")
    return 1 if pending else 0


def _ui(args) -> int:
    from lean.tools import ui  # local: nothing else needs it

    return ui.main(args.store, args.experiment, args.host, args.port, args.workers, serve_ui=args.serve)


def _export(args) -> int:
    what = export.export_run(args.run, args.out, ema=args.ema, merge=args.merge)
    print(f"lean export: {args.out}: {what}")
    return 0


def _sample(args) -> int:
    options = sampling.SampleOptions(**{f.name: getattr(args, f.name) for f in fields(sampling.SampleOptions)})
    files = sampling.sample(args.pretrained, args.lora, args.prompts_file, args.out, options)
    print(f"lean sample: {len(files)} sample(s) in {args.out}")
    return 0


COMMANDS = {
    "train": _train,
    "plan": _plan,
    "equivalence": _equivalence,
    "bench": _bench,
    "reward": _reward,
    "launch": _launch,
    "sync": _sync,
    "ui": _ui,
    "export": _export,
    "sample": _sample,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"lean: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except Preempted as e:  # SIGTERM: stopped after a whole iteration, checkpoint written
        print(f"lean: rank {rank}: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except RewardServerError as e:  # the rollout was kept under <out>/failed_rollouts (lean train)
        print(f"lean: rank {rank}: {e}", file=sys.stderr)
        return EXIT_REWARD_SERVER
    except FloatingPointError as e:  # lean.run.iteration.NonFiniteError with train.on_nonfinite=abort
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
