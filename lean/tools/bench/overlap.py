"""``lean bench overlap``: every overlap op x method x shape, measured on N processes, next to the timeline model.

    lean bench overlap [--nproc 2] [--out DIR] [--shapes a,b | --quick] [--ops a,b] [--repeats 7] [--warmup 2]
                       [--methods collective,sliced,flash,flash-bidir,symm_mem] [--block-ms 25] [--timeout 120]
                       [--dtype ..]

Outside a distributed launch it re-launches itself on N processes through ``lean.parallel.launch`` (gloo ranks on CPU,
one NCCL rank per GPU). For every op and shape each rank times, round-robin so that drift on a shared machine hits all
alike: the op with each method, the method's communication alone (the same schedule with no GEMMs) and the whole local
GEMM alone. A sample is the slowest rank's time, after a barrier, for back-to-back calls lasting about ``--block-ms``,
divided by the number of calls; tables report the median over the repeats and its interquartile range.

    exposed communication = latency - compute-only     (ms: what the op costs beyond the GEMMs of the same shapes;
                                                        the same yardstick for every method, 0 when all is hidden)
    achieved FLOP/s       = GEMM FLOPs / latency;   MFU = achieved / peak (CPU: calibration matmul; GPU: datasheet)

``symm_mem`` is PyTorch's own overlapped op where the build has it (``torch.ops.symm_mem.fused_all_gather_matmul``
for mlp.fc1, ``fused_matmul_reduce_scatter`` for mlp.fc2; NCCL GPUs only), a baseline timed like the methods but
without a communication-only run; where it cannot run, ``overlap.json``'s ``skipped`` says why.

Every figure is given twice (:func:`overlap_stats`): from the medians and, with a ``_min`` suffix, from the fastest
repeats. With one process (a single GPU, or ``--nproc 1``) only what needs no peer is measured: the GEMMs, memory
bandwidth, and on a GPU a copy on a side stream overlapping a GEMM. Rank 0 appends each case to ``measured.jsonl`` as
soon as it is measured, then hands everything to :mod:`lean.tools.bench.overlap_report`, which compares it with the
timeline model and writes the files and tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

import lean.parallel.launch
from lean.config import ConfigError
from lean.config.dtypes import DTYPES, dtype_name
from lean.observe.metrics import keep_freed_memory, median, peak_flops
from lean.observe.outputs import JsonLines
from lean.parallel.overlap import ops, sim
from lean.parallel.overlap.dp import gather_linear
from lean.parallel.overlap.measure import calibrate, time_round_robin
from lean.parallel.overlap.p2p import METHODS, Overlap, all_gather_apply, all_to_all_apply, reduce_scatter_apply
from lean.tools.bench import overlap_report


@dataclass(frozen=True)
class Shape:
    """One transformer layer's activations (batch, seq, d) and MLP width; ``sim.layer_ops`` derives the op shapes."""

    batch: int
    seq: int
    d: int
    ffn: int


CPU_SHAPES = {
    "commfuse-mlp/16": Shape(2, 256, 256, 1024),  # CommFuse's MLP (b, s, d) = (32, 4096, 4096), each dim / 16
    "narrow": Shape(4, 512, 128, 512),  # small d: the most communication per FLOP
    "wide": Shape(2, 256, 512, 2048),  # large d: the most FLOP per byte
}
GPU_SHAPES = {
    "commfuse-mlp": Shape(32, 4096, 4096, 16384),
    "llama70b-8k": Shape(1, 8192, 8192, 2 * 28672),
}
FUSED = "symm_mem"  # PyTorch's fused ops, a baseline (NCCL GPUs, where the build has them)
# flash-bidir: the bidirectional ring (all-gather ops only, world >= 3)
VARIANTS = (*METHODS, "flash-bidir", FUSED)
OPS = ("mlp.fc1", "mlp.fc2", "ulysses.qkv", "ulysses.out", "dp.fc1.gather", "dp.fc1.wgrad")
FUSED_OPS = {"mlp.fc1": "fused_all_gather_matmul", "mlp.fc2": "fused_matmul_reduce_scatter"}  # torch.ops.symm_mem
QUICK_REPEATS, QUICK_WARMUP = 3, 1  # --quick's repeats and warm-up, whatever --repeats and --warmup say


# ---------------------------------------------------------------- options


@dataclass(frozen=True)
class OverlapOptions:
    """The options of one ``lean bench overlap`` run (its flags, parsed); invalid values raise ``ConfigError``."""

    nproc: int = 2
    """processes (ranks) to launch when not already inside a launch"""
    out: str = "outputs/overlap"
    """folder for overlap.json, projection.json and gantt*.png"""
    shapes: tuple[str, ...] | None = None
    """shape names of the device's table (``CPU_SHAPES`` or ``GPU_SHAPES``); None: all (the first with ``quick``).
    Checked when the run knows its device."""
    quick: bool = False
    """the first shape only, ``QUICK_REPEATS`` repeats, ``QUICK_WARMUP`` warm-up"""
    ops: tuple[str, ...] = OPS
    """subset of ``OPS``"""
    repeats: int = 7
    """timed samples per case"""
    warmup: int = 2
    """discarded samples per case"""
    methods: tuple[str, ...] = VARIANTS
    """subset of ``VARIANTS``"""
    block_ms: float = 25.0
    """each sample times back-to-back calls lasting about this long (at least one call)"""
    timeout: float = 120.0
    """seconds any wait may take before a rank gives up"""
    dtype: str | None = None
    """a ``lean.config.dtypes.DTYPES`` name; None: torch.bfloat16 on a GPU, torch.float32 on a CPU"""

    def __post_init__(self) -> None:
        for name in ("shapes", "ops", "methods"):  # lists from Python callers: frozen means hashable, so tuples
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        _check_subset("--methods", self.methods, VARIANTS)
        _check_subset("--ops", self.ops, OPS)
        if self.nproc < 1:
            raise ConfigError("--nproc", self.nproc, "must be >= 1")
        if self.repeats < 1:
            raise ConfigError("--repeats", self.repeats, "must be >= 1")
        if self.warmup < 0:
            raise ConfigError("--warmup", self.warmup, "must be >= 0")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError("--dtype", self.dtype, f"choose from {', '.join(DTYPES)}")

    @property
    def effective_repeats(self) -> int:
        return QUICK_REPEATS if self.quick else self.repeats

    @property
    def effective_warmup(self) -> int:
        return QUICK_WARMUP if self.quick else self.warmup


def _check_subset(flag: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ConfigError(flag, ",".join(values), f"unknown {', '.join(bad)}; choose from {', '.join(allowed)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``lean bench overlap``, on the subparser ``lean.cli`` creates for it."""
    defaults = OverlapOptions()
    add = parser.add_argument
    add("--nproc", type=int, default=defaults.nproc, help="processes (ranks) to launch when not already launched")
    add("--out", default=defaults.out, help="folder for overlap.json, projection.json, gantt*.png")
    add("--shapes", default=None, help="comma-separated shape names (default: all for the device)")
    add("--quick", action="store_true", help=f"first shape only, {QUICK_REPEATS} repeats, {QUICK_WARMUP} warm-up")
    add("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    add("--repeats", type=int, default=defaults.repeats)
    add("--warmup", type=int, default=defaults.warmup)
    add("--methods", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    add(
        "--block-ms",
        type=float,
        default=defaults.block_ms,
        help="each sample times back-to-back calls lasting about this long (at least one call)",
    )
    add("--timeout", type=float, default=defaults.timeout, help="seconds any wait may take before a rank gives up")
    add(
        "--dtype",
        default=None,
        help=f"one of {', '.join(DTYPES)} (default: {dtype_name(torch.float32)} on a CPU, "
        f"{dtype_name(torch.bfloat16)} on a GPU)",
    )


def options_from_args(ns: argparse.Namespace) -> OverlapOptions:
    """The options of the flags :func:`add_arguments` added (comma-separated lists become tuples)."""
    return OverlapOptions(
        nproc=ns.nproc,
        out=ns.out,
        shapes=tuple(ns.shapes.split(",")) if ns.shapes else None,
        quick=ns.quick,
        ops=tuple(ns.ops.split(",")),
        repeats=ns.repeats,
        warmup=ns.warmup,
        methods=tuple(ns.methods.split(",")),
        block_ms=ns.block_ms,
        timeout=ns.timeout,
        dtype=ns.dtype,
    )


def to_argv(options: OverlapOptions) -> list[str]:
    """The flags that give back ``options`` (every rank of a re-launch parses them)."""
    argv = ["--nproc", str(options.nproc), "--out", options.out]
    if options.shapes:
        argv += ["--shapes", ",".join(options.shapes)]
    if options.quick:
        argv.append("--quick")
    argv += [
        "--ops",
        ",".join(options.ops),
        "--repeats",
        str(options.repeats),
        "--warmup",
        str(options.warmup),
        "--methods",
        ",".join(options.methods),
        "--block-ms",
        repr(options.block_ms),
        "--timeout",
        repr(options.timeout),
    ]
    if options.dtype is not None:
        argv += ["--dtype", options.dtype]
    return argv


# ---------------------------------------------------------------- entry point


def main(options: OverlapOptions) -> int:
    """``lean bench overlap``: re-launches itself on ``options.nproc`` ranks unless already inside a launch."""
    inside_launch = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    if options.nproc > 1 and not inside_launch:
        return lean.parallel.launch.launch(options.nproc, ["bench", "overlap", *to_argv(options)])
    return run(options)


def run(options: OverlapOptions) -> int:
    """This rank's part of the benchmark: set up, sweep, calibrate; rank 0 reports."""
    proc = setup_process(options.timeout, options.dtype)
    try:
        names = shape_names(options, proc.world, proc.device)
    except ValueError as e:
        print(f"lean bench overlap: {e}", file=sys.stderr)
        return 2
    peak, peak_source = peak_flops(proc.device, proc.dtype)
    torch.manual_seed(proc.rank)
    measured = sweep(options, proc, names, peak)
    calibration = dict(
        peak_flops=peak, peak_source=peak_source, **calibrate(proc.world, proc.device, proc.dtype, options.timeout)
    )
    if proc.rank == 0:
        table = shape_table(proc.device)
        overlap_report.report(
            Path(options.out),
            overlap_report.Measurements(
                world=proc.world,
                device=proc.device,
                dtype=proc.dtype,
                repeats=options.effective_repeats,
                warmup=options.effective_warmup,
                quick=options.quick,
                shapes={n: asdict(table[n]) for n in names},
                calibration=calibration,
                compute_rows=measured.compute_rows,
                results=measured.results,
                skipped=measured.skipped,
            ),
        )
    if dist.is_initialized():
        dist.barrier()  # rank 0 reports while the others wait, so that no rank leaves the group early
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- process set-up


class Process(NamedTuple):
    """Where this rank runs and in which floating-point type."""

    world: int
    rank: int
    device: torch.device
    dtype: torch.dtype


def setup_process(timeout: float, dtype: str | None) -> Process:
    """The rank's device, threads and process group (NCCL on GPUs, gloo on CPUs)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
        keep_freed_memory()  # every op allocates its outputs: no fresh page faults on each call
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout), device_id=device if cuda else None
        )
    torch_dtype = DTYPES[dtype] if dtype else torch.bfloat16 if cuda else torch.float32
    return Process(world, dist.get_rank() if world > 1 else 0, device, torch_dtype)


def shape_table(device: torch.device) -> dict[str, Shape]:
    return GPU_SHAPES if device.type == "cuda" else CPU_SHAPES


def shape_names(options: OverlapOptions, world: int, device: torch.device) -> list[str]:
    """The shapes to measure, in order; ``ValueError`` for a name not in the device's table or a shape whose sizes
    do not split evenly over the ranks."""
    table = shape_table(device)
    names = list(options.shapes) if options.shapes else list(table)[:1] if options.quick else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown shape {', '.join(unknown)}; choose from {', '.join(table)}")
    uneven = [
        f"{n} {asdict(table[n])}"
        for n in names
        if any(size % world for key, size in asdict(table[n]).items() if key in ("seq", "d", "ffn"))
    ]
    if uneven:
        raise ValueError(f"seq, d and ffn must split evenly over {world} ranks: {'; '.join(uneven)}")
    return names


# ---------------------------------------------------------------- cases


class Case(NamedTuple):
    """What is timed for one op: the op and its communication alone take the :class:`Overlap` to run with."""

    op: Callable[[Overlap], object]
    comm_only: Callable[[Overlap], object]  # the same pattern with no GEMM around it
    compute_only: Callable[[], object]  # the whole local GEMM, no communication
    fused: Callable[[str], object] | None = None  # PyTorch's fused op on the named group (``FUSED_OPS``)


def make_case(spec: sim.OpSpec, shape: Shape, dtype: torch.dtype, device: torch.device) -> Case:
    """Random inputs and the callables for one op of ``sim.layer_ops`` at ``shape``."""
    P, b, seq, d, ffn = spec.world, shape.batch, shape.seq, shape.d, shape.ffn
    s = seq // P

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, dtype=dtype, device=device)

    def nothing(*_) -> None:
        return None

    kind = spec.name.split()[0]
    if kind == "mlp.fc1":
        x, w, x_full = randn(s, b, d), randn(d, ffn // P), randn(seq, b, d)
        return Case(
            lambda ov: ops.all_gather_matmul(x, w, ov),
            lambda ov: all_gather_apply(x, nothing, ov),
            lambda: x_full @ w,
            lambda group: torch.ops.symm_mem.fused_all_gather_matmul(x, [w], 0, group),
        )
    if kind == "mlp.fc2":
        h, w, partials = randn(seq, b, ffn // P), randn(ffn // P, d), randn(P, s, b, d)
        return Case(
            lambda ov: ops.matmul_reduce_scatter(h, w, ov),
            lambda ov: reduce_scatter_apply(lambda peers, rows: partials[peers, rows], s, ov, dtype),
            lambda: h @ w,
            lambda group: torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w, "sum", 0, group),
        )
    if kind == "ulysses.qkv":
        x, w_blocks, blocks, w = randn(s, b, d), randn(P, d, 3 * d // P), randn(P, s, b, 3 * d // P), randn(d, 3 * d)
        return Case(
            lambda ov: ops.matmul_all_to_all(x, w_blocks, ov),
            lambda ov: all_to_all_apply(lambda peers, rows: blocks[peers, rows], nothing, s, ov),
            lambda: x @ w,
        )
    if kind == "ulysses.out":
        o, w_blocks, o_seq, w = randn(seq, b, d // P), randn(P, d // P, d), randn(s, b, d), randn(d, d)
        chunks = o.view(P, s, b, d // P)
        return Case(
            lambda ov: ops.all_to_all_matmul(o, w_blocks, ov),
            lambda ov: all_to_all_apply(lambda peers, rows: chunks[peers, rows], nothing, s, ov),
            lambda: o_seq @ w,
        )
    if kind == "dp.fc1.gather":
        x, w_shard, w = randn(b * seq, d), randn(d // P, ffn), randn(d, ffn)
        return Case(
            lambda ov: gather_linear(x, w_shard, ov),
            lambda ov: all_gather_apply(w_shard, nothing, ov),
            lambda: x @ w,
        )
    if kind == "dp.fc1.wgrad":
        x_t, dy, partials = randn(d, b * seq), randn(b * seq, ffn), randn(P, d // P, ffn)
        return Case(
            lambda ov: ops.matmul_reduce_scatter(x_t, dy, ov),
            lambda ov: reduce_scatter_apply(lambda peers, rows: partials[peers, rows], d // P, ov, dtype),
            lambda: x_t @ dy,
        )
    raise ValueError(f"no benchmark case for op {spec.name!r}")


def make_overlap(variant: str, timeout: float) -> Overlap:
    """The :class:`Overlap` of a ``VARIANTS`` method name (flash-bidir: flash on the bidirectional ring)."""
    if variant == "flash-bidir":
        return Overlap("flash", bidirectional=True, timeout=timeout)
    return Overlap(variant, timeout=timeout)


def variants_for(spec: sim.OpSpec, wanted: Sequence[str]) -> list[str]:
    """The wanted variants that apply to ``spec``: flash-bidir differs from flash only for all-gather with world
    >= 3, and PyTorch's fused ops exist for ``FUSED_OPS`` only."""
    kind = spec.name.split()[0]
    return [
        v
        for v in wanted
        if (v != "flash-bidir" or (spec.pattern == "all_gather" and spec.world >= 3))
        and (v != FUSED or kind in FUSED_OPS)
    ]


# ---------------------------------------------------------------- PyTorch's fused ops


def fused_missing(kind: str) -> str | None:
    """Why this torch build lacks PyTorch's fused op for ``kind`` (``FUSED_OPS``); None when it has it."""
    name = FUSED_OPS[kind]
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (defines the torch.ops.symm_mem ops)
    except ImportError as e:
        return f"torch {torch.__version__} has no symmetric memory ({e})"
    if not hasattr(torch.ops.symm_mem, name):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{name}"
    return None


def fused_unavailable(kind: str, device: torch.device) -> str | None:
    """Why PyTorch's fused op for ``kind`` (``FUSED_OPS``) cannot be timed in this process; None when it can."""
    missing = fused_missing(kind)
    if missing is not None:
        return missing
    name = FUSED_OPS[kind]
    if device.type != "cuda" or not dist.is_initialized() or dist.get_backend() != "nccl":
        return f"torch.ops.symm_mem.{name} needs CUDA GPUs on NCCL (symmetric memory); this run is on {device.type}"
    return None


def symm_mem_group() -> str:
    """The default group's name, with symmetric memory enabled where this torch still needs it enabled."""
    from torch.distributed import _symmetric_memory as symm_mem

    name = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # recent torch: deprecated, no longer needed
            enable(name)
    return name


# ---------------------------------------------------------------- sweep


class Sweep(NamedTuple):
    """What the sweep measured, and what it could not."""

    results: list[dict]  # per op x shape x method: ``overlap_stats``
    compute_rows: list[dict]  # per op x shape: the whole local GEMM alone
    skipped: list[dict]  # per op x shape x method that was wanted but cannot run here: the reason


def sweep(options: OverlapOptions, proc: Process, names: list[str], peak: float) -> Sweep:
    """Every op x shape, timed round-robin; rank 0 appends each case (or why a variant was skipped) to
    ``out/measured.jsonl`` as soon as it is measured (a run stopped by a time limit keeps them)."""
    table = shape_table(proc.device)
    log = JsonLines(Path(options.out) / "measured.jsonl" if proc.rank == 0 else None)
    element_bytes = torch.finfo(proc.dtype).bits // 8
    out = Sweep([], [], [])
    for shape_name in names:
        shape = table[shape_name]
        for spec in sim.layer_ops(proc.world, **asdict(shape), element_bytes=element_bytes):
            kind = spec.name.split()[0]
            if kind not in options.ops:
                continue
            case = make_case(spec, shape, proc.dtype, proc.device)
            variants = variants_for(spec, options.methods) if proc.world > 1 else []
            reason = fused_unavailable(kind, proc.device) if FUSED in variants else None
            if reason is not None:
                variants.remove(FUSED)
                out.skipped.append({"op": spec.name, "shape": shape_name, "method": FUSED, "reason": reason})
                log.append({"skipped": out.skipped[-1]})
            calls = calls_per_sample(case.compute_only, options.block_ms, proc.device)
            samples = time_round_robin(
                timed_variants(case, variants, options.timeout),
                options.effective_warmup,
                options.effective_repeats,
                proc.device,
                calls,
            )
            compute = samples.pop("compute")
            first = len(out.results)
            out.compute_rows.append(
                {
                    "op": spec.name,
                    "shape": shape_name,
                    "flops": spec.flops,
                    "calls_per_sample": calls,
                    **compute_stats(compute, spec.flops, peak),
                }
            )
            for v in variants:
                out.results.append(
                    {
                        "op": spec.name,
                        "shape": shape_name,
                        "method": v,
                        **overlap_stats(samples[v], compute, samples.get(f"{v}:comm"), spec.flops, peak),
                    }
                )
            log.append({"compute_only": out.compute_rows[-1], "results": out.results[first:]})
    return out


def calls_per_sample(compute_only: Callable[[], object], block_ms: float, device: torch.device) -> int:
    """Back-to-back calls that make a sample last about ``block_ms``, from one GEMM's time (1 to 32 calls)."""
    once = median(time_round_robin({"compute": compute_only}, 1, 1, device)["compute"])
    return min(max(round(block_ms / 1e3 / once), 1), 32)


def timed_variants(case: Case, variants: Sequence[str], timeout: float) -> dict[str, Callable[[], object]]:
    """What one round of the sweep times: ``compute``, per method ``METHOD`` and ``METHOD:comm``, and PyTorch's
    fused op (``FUSED``, no communication-only run: its communication cannot be run without its GEMM)."""
    timed: dict[str, Callable[[], object]] = {"compute": case.compute_only}
    for v in variants:
        if v == FUSED:
            assert case.fused is not None, "variants_for offers the fused op only for FUSED_OPS"
            timed[v] = partial(case.fused, symm_mem_group())
        else:
            timed[v] = partial(case.op, make_overlap(v, timeout))
            timed[f"{v}:comm"] = partial(case.comm_only, make_overlap(v, timeout))
    return timed


# ---------------------------------------------------------------- statistics


def compute_stats(compute: list[float], flops: float, peak: float) -> dict:
    """The compute-only figures of one case (samples in seconds): median and fastest time in ms, GFLOP/s and MFU."""
    return {
        "compute_ms": median(compute) * 1e3,
        "compute_min_ms": min(compute) * 1e3,
        "gflops": flops / median(compute) / 1e9,
        "mfu": flops / median(compute) / peak,
    }


def overlap_stats(
    latency: list[float], compute: list[float], comm: list[float] | None, flops: float, peak: float
) -> dict:
    """The reported figures of one case, from the medians and (``_min``) from the fastest repeats, in ms:
    ``exposed = latency - compute-only``, and the communication alone (``comm``, None where it cannot run alone:
    the keys are then None).

    The fastest repeat is the one least disturbed by other processes: on a shared machine it is the better estimate of
    the machine itself, the median the better one of what a user sees."""
    out = {}
    for suffix, stat in (("", median), ("_min", min)):
        t, c = stat(latency), stat(compute)
        out |= {
            f"latency{suffix}_ms": t * 1e3,
            f"compute{suffix}_ms": c * 1e3,
            f"comm{suffix}_ms": stat(comm) * 1e3 if comm is not None else None,
            f"exposed{suffix}_ms": (t - c) * 1e3,
        }
    q1, q3 = quartiles(latency)
    return out | {
        "latency_iqr_ms": (q3 - q1) * 1e3,
        "gflops": flops / median(latency) / 1e9,
        "mfu": flops / median(latency) / peak,
    }


def quartiles(values: list[float]) -> tuple[float, float]:
    """(first, third) quartile: the sorted values at a quarter and three quarters of the way."""
    v = sorted(values)
    return v[len(v) // 4], v[(3 * len(v)) // 4]
