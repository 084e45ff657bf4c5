"""``lean bench overlap``: every overlap op x method x shape, measured on N processes, next to the timeline model.

    lean bench overlap [--nproc 2] [--out DIR] [--shapes a,b | --quick] [--ops a,b] [--repeats 7] [--warmup 2]
                       [--methods collective,sliced,flash,flash-bidir] [--block-ms 25] [--timeout 120] [--dtype ..]

Outside a distributed launch it re-launches itself on N processes through ``lean.launch`` (gloo ranks on CPU, one NCCL
rank per GPU). For every op and shape each rank times, round-robin so that drift on a shared machine hits all alike:
the op with each method, the method's communication alone (the same schedule with no GEMMs) and the whole local GEMM
alone. A sample is the slowest rank's time, after a barrier, for back-to-back calls lasting about ``--block-ms``,
divided by the number of calls; tables report the median over the repeats and its interquartile range.

    exposed communication = latency - compute-only
    hidden fraction       = 1 - exposed / communication-only   (1: all hidden; < 0: worse than not overlapping at all)
    achieved FLOP/s       = GEMM FLOPs / latency;   MFU = achieved / peak (CPU: calibration matmul; GPU: datasheet)

Rank 0 writes ``DIR/overlap.json`` (measurements, the calibration and ``model``: the timeline model's prediction for
every measured case and its error), ``DIR/projection.json`` (H100 / H200 at Llama-70B-like shapes, degree 8),
``DIR/gantt.png`` (the projection's timelines), ``DIR/gantt_measured.png`` (the calibrated profile at the first
shape), and prints the tables. With one process (a single GPU, or ``--nproc 1``) only what needs no peer is measured
(the GEMMs, memory bandwidth, and on a GPU a copy on a side stream overlapping a GEMM); the JSON lists what was not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from lean.metrics import calibrate_cpu_peak_flops, median, peak_flops, synchronize
from lean.overlap import ops, sim
from lean.overlap.p2p import METHODS, Overlap, all_gather_apply, all_to_all_apply, exchange, reduce_scatter_apply, wait


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
VARIANTS = (*METHODS, "flash-bidir")  # flash-bidir: the bidirectional ring (all-gather ops only, world >= 3)
OPS = ("mlp.fc1", "mlp.fc2", "ulysses.qkv", "ulysses.out", "dp.fc1.wgrad")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lean bench overlap", description="FlashOverlap ops: collective vs sliced vs flash")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) to launch when not already launched")
    p.add_argument("--out", default="outputs/overlap", help="folder for overlap.json, projection.json, gantt*.png")
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all for the device)")
    p.add_argument("--quick", action="store_true", help="first shape only, 3 repeats, 1 warm-up")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--methods", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--block-ms", type=float, default=25.0,
                   help="each sample times back-to-back calls lasting about this long (at least one call)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take before a rank gives up")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float64 ...")
    args = p.parse_args(argv)
    for name, allowed in (("methods", VARIANTS), ("ops", OPS)):
        bad = [v for v in getattr(args, name).split(",") if v not in allowed]
        if bad:
            p.error(f"--{name}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    if args.nproc < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--nproc and --repeats must be >= 1, --warmup >= 0")
    return args


def cli_main(argv: list[str]) -> int:
    """``lean bench overlap ARGV``: re-launches itself on ``--nproc`` ranks unless already inside a launch."""
    args = parse_args(argv)
    if args.nproc > 1 and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        from lean.launch import launch

        return launch(args.nproc, ["bench", "overlap", *argv])
    return run(args)


# ---------------------------------------------------------------- cases


def _case(spec: sim.OpSpec, shape: Shape, dtype: torch.dtype, device: torch.device):
    """(op(ov), communication alone(ov), the whole local GEMM alone) for one op of ``sim.layer_ops``."""
    P, b, seq, d, ffn = spec.world, shape.batch, shape.seq, shape.d, shape.ffn
    s = seq // P

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, dtype=dtype, device=device)

    def nothing(*_) -> None:
        return None

    kind = spec.name.split()[0]
    if kind == "mlp.fc1":
        x, w, x_full = randn(s, b, d), randn(d, ffn // P), randn(seq, b, d)
        return (lambda ov: ops.all_gather_matmul(x, w, ov), lambda ov: all_gather_apply(x, nothing, ov),
                lambda: x_full @ w)
    if kind == "mlp.fc2":
        h, w, partials = randn(seq, b, ffn // P), randn(ffn // P, d), randn(P, s, b, d)
        return (lambda ov: ops.matmul_reduce_scatter(h, w, ov),
                lambda ov: reduce_scatter_apply(lambda peers, rows: partials[peers, rows], s, ov), lambda: h @ w)
    if kind == "ulysses.qkv":
        x, w_blocks, blocks, w = randn(s, b, d), randn(P, d, 3 * d // P), randn(P, s, b, 3 * d // P), randn(d, 3 * d)
        return (lambda ov: ops.matmul_all_to_all(x, w_blocks, ov),
                lambda ov: all_to_all_apply(lambda peers, rows: blocks[peers, rows], nothing, s, ov), lambda: x @ w)
    if kind == "ulysses.out":
        o, w_blocks, o_seq, w = randn(seq, b, d // P), randn(P, d // P, d), randn(s, b, d), randn(d, d)
        chunks = o.view(P, s, b, d // P)
        return (lambda ov: ops.all_to_all_matmul(o, w_blocks, ov),
                lambda ov: all_to_all_apply(lambda peers, rows: chunks[peers, rows], nothing, s, ov),
                lambda: o_seq @ w)
    if kind == "dp.fc1.wgrad":
        x_t, dy, partials = randn(d, b * seq), randn(b * seq, ffn), randn(P, d // P, ffn)
        return (lambda ov: ops.matmul_reduce_scatter(x_t, dy, ov),
                lambda ov: reduce_scatter_apply(lambda peers, rows: partials[peers, rows], d // P, ov),
                lambda: x_t @ dy)
    raise ValueError(f"no benchmark case for op {spec.name!r}")


def _overlap(variant: str, timeout: float) -> Overlap:
    return Overlap("flash", bidirectional=True, timeout=timeout) if variant == "flash-bidir" else \
        Overlap(variant, timeout=timeout)


def time_round_robin(variants: dict[str, Callable[[], object]], warmup: int, repeats: int, device: torch.device,
                     calls: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per repeat: the slowest rank's time for ``calls`` back-to-back
    calls (which evens out the scheduler's time slices and the barrier's skew) divided by ``calls``. The variants
    take turns within each repeat."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    distributed = dist.is_initialized()
    for i in range(warmup + repeats):
        for name, fn in variants.items():
            if distributed:
                dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize(device)
            if i >= warmup:
                samples[name].append((time.perf_counter() - start) / calls)
    if distributed:
        table = torch.tensor([samples[name] for name in variants], dtype=torch.float64, device=device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        samples = dict(zip(variants, table.tolist()))
    return samples


def _quartiles(values: list[float]) -> tuple[float, float]:
    v = sorted(values)
    return v[len(v) // 4], v[(3 * len(v)) // 4]


# ---------------------------------------------------------------- calibration


def cpu_peak_flops(dtype: torch.dtype) -> tuple[float, str]:
    """Best FLOP/s of the calibration matmul over sizes that fit the caches to a different degree (a single 1024^3
    matmul underrates a small-cache CPU, and the sweep's smaller GEMMs would then exceed 100% MFU)."""
    dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    best = max((calibrate_cpu_peak_flops(n, dtype, repeats=10), n) for n in (256, 512, 1024))
    return best[0], f"calibration:matmul-{best[1]}-{str(dtype).removeprefix('torch.')}-best-of-256/512/1024"


def _ring_step(send: torch.Tensor, recv: torch.Tensor, ov: Overlap, stamps: list[float] | None = None) -> None:
    """One flash ring step (send right, receive left); appends its completion time to ``stamps`` if given."""
    wait(exchange([(send, ov.rank + 1)], [(recv, ov.rank - 1)], ov), ov, "calibration")
    if stamps is not None:
        stamps.append(time.perf_counter())


def calibrate_links(ov: Overlap, device: torch.device, dtype: torch.dtype, repeats: int = 7) -> tuple[float, float]:
    """(alpha s, beta bytes/s) of one ring step, fitted through a small and a large message."""
    sizes = (1024, 2 ** 21)
    buffers = {n: (torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)) for n in sizes}
    samples = time_round_robin({n: partial(_ring_step, *buffers[n], ov) for n in sizes}, 2, repeats, device)
    times = [median(samples[n]) for n in sizes]
    nbytes = [n * torch.finfo(dtype).bits // 8 for n in sizes]
    beta = (nbytes[1] - nbytes[0]) / max(times[1] - times[0], 1e-9)
    return max(times[0] - nbytes[0] / beta, 0.0), beta


def calibrate_memory(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(bytes/s of a large copy, seconds of a tiny matmul call): the roofline's memory side and per-call cost."""
    src = torch.ones(2 ** 24 if device.type == "cpu" else 2 ** 28, dtype=dtype, device=device)
    dst, a = torch.empty_like(src), torch.ones(8, 8, dtype=dtype, device=device)
    copy = median(time_round_robin({"copy": partial(dst.copy_, src)}, 2, 5, device)["copy"])
    call = median(time_round_robin({"call": partial(torch.mm, a, a)}, 2, 5, device, calls=200)["call"])
    return 2 * src.numel() * src.element_size() / copy, call


def calibrate_contention(ov: Overlap, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(compute_slowdown, comm_slowdown) on a CPU: a GEMM loop while a ring step runs, against each alone.

    Fluid model: while both run, compute goes at 1/(1+kc) and the transfer at 1/(1+km). With G, C the times alone and
    G', C' together (the GEMM loop outlasting the transfer): C' = C (1+km) and G' - G = C' kc / (1+kc).
    """
    send, recv = torch.ones(2 ** 21, dtype=dtype), torch.empty(2 ** 21, dtype=dtype)
    a, b = torch.randn(384, 384, dtype=dtype), torch.randn(384, 384, dtype=dtype)
    variants = {"comm": partial(_ring_step, send, recv, ov), "gemm": partial(torch.mm, a, b)}
    alone = time_round_robin(variants, 2, 5, device)
    comm = median(alone["comm"])
    loops = max(1, round(3 * comm / median(alone["gemm"])))

    def gemm_loop() -> None:
        for _ in range(loops):
            torch.mm(a, b)

    gemm = median(time_round_robin({"loop": gemm_loop}, 1, 3, device)["loop"])
    together_comm, together_gemm = [], []
    for _ in range(5):
        dist.barrier()
        stamps: list[float] = []
        start = time.perf_counter()
        transfer = threading.Thread(target=_ring_step, args=(send, recv, ov, stamps))
        transfer.start()  # the wait runs on this thread with the GIL released, the transfer on gloo's
        gemm_loop()
        together_gemm.append(time.perf_counter() - start)
        transfer.join()
        together_comm.append(stamps[0] - start)
    comm_t, gemm_t = median(together_comm), median(together_gemm)
    x = min(max((gemm_t - gemm) / comm_t, 0.0), 0.9)
    return x / (1 - x), max(comm_t / comm - 1, 0.0)


def loopback_overlap(device: torch.device, dtype: torch.dtype) -> dict:
    """One GPU, no peer: a device-to-device copy on a side stream while a GEMM runs, against each alone (seconds)."""
    src = torch.ones(2 ** 28, dtype=dtype, device=device)
    dst, a = torch.empty_like(src), torch.randn(8192, 8192, dtype=dtype, device=device)
    side = torch.cuda.Stream(device)

    def copy():
        with torch.cuda.stream(side):
            dst.copy_(src)

    def both():
        copy()
        a @ a
        torch.cuda.current_stream(device).wait_stream(side)

    t = time_round_robin({"copy": lambda: (copy(), torch.cuda.current_stream(device).wait_stream(side)),
                          "gemm": lambda: a @ a, "both": both}, 2, 5, device)
    return {name: median(v) for name, v in t.items()}


# ---------------------------------------------------------------- run


def _variants_for(spec: sim.OpSpec, wanted: list[str]) -> list[str]:
    # flash-bidir differs from flash only for all-gather with world >= 3
    return [v for v in wanted if v != "flash-bidir" or (spec.pattern == "all_gather" and spec.world >= 3)]


def _setup(args) -> tuple[int, int, torch.device, torch.dtype]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout),
                                device_id=device if cuda else None)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    return world, dist.get_rank() if world > 1 else 0, device, dtype


def _shape_names(args, world: int, device: torch.device) -> list[str]:
    table = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    names = args.shapes.split(",") if args.shapes else list(table)[:1] if args.quick else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown shape {', '.join(unknown)}; choose from {', '.join(table)}")
    uneven = [f"{n} {asdict(table[n])}" for n in names
              if any(size % world for key, size in asdict(table[n]).items() if key in ("seq", "d", "ffn"))]
    if uneven:
        raise ValueError(f"seq, d and ffn must split evenly over {world} ranks: {'; '.join(uneven)}")
    return names


def sweep(args, names: list[str], shapes: dict[str, Shape], world: int, device: torch.device, dtype: torch.dtype,
          peak: float) -> tuple[list[dict], list[dict]]:
    """(per op x shape x method results, per op x shape compute-only rows), timed round-robin per op and shape."""
    repeats, warmup = (3, 1) if args.quick else (args.repeats, args.warmup)
    wanted_ops, wanted_methods = args.ops.split(","), args.methods.split(",")
    results, compute_rows = [], []
    for shape_name in names:
        shape = shapes[shape_name]
        for spec in sim.layer_ops(world, **asdict(shape), element_bytes=torch.finfo(dtype).bits // 8):
            if spec.name.split()[0] not in wanted_ops:
                continue
            run_op, comm_only, compute_only = _case(spec, shape, dtype, device)
            once = median(time_round_robin({"compute": compute_only}, 1, 1, device)["compute"])
            calls = min(max(round(args.block_ms / 1e3 / once), 1), 32)
            variants: dict[str, Callable[[], object]] = {"compute": compute_only}
            for v in _variants_for(spec, wanted_methods) if world > 1 else []:
                variants[v] = partial(run_op, _overlap(v, args.timeout))
                variants[f"{v}:comm"] = partial(comm_only, _overlap(v, args.timeout))
            samples = time_round_robin(variants, warmup, repeats, device, calls)
            compute = median(samples.pop("compute"))
            compute_rows.append({"op": spec.name, "shape": shape_name, "flops": spec.flops, "compute_ms": compute * 1e3,
                                 "gflops": spec.flops / compute / 1e9, "mfu": spec.flops / compute / peak})
            for v in (k for k in samples if not k.endswith(":comm")):
                latency, comm = median(samples[v]), median(samples[f"{v}:comm"])
                q1, q3 = _quartiles(samples[v])
                results.append({"op": spec.name, "shape": shape_name, "method": v, "latency_ms": latency * 1e3,
                                "latency_iqr_ms": (q3 - q1) * 1e3, "compute_ms": compute * 1e3,
                                "comm_ms": comm * 1e3, "exposed_ms": (latency - compute) * 1e3,
                                "hidden_fraction": 1 - (latency - compute) / comm,
                                "gflops": spec.flops / latency / 1e9, "mfu": spec.flops / latency / peak})
    return results, compute_rows


def calibrate(world: int, device: torch.device, dtype: torch.dtype, timeout: float) -> dict:
    """The figures the timeline model needs from this machine (see the calibrate_* functions)."""
    out = {}
    out["mem_bw"], out["launch"] = calibrate_memory(device, dtype)
    if world > 1:
        ov = Overlap("flash", timeout=timeout)
        out["alpha"], out["beta"] = calibrate_links(ov, device, dtype)
        if device.type == "cpu":
            out["compute_slowdown"], out["comm_slowdown"] = calibrate_contention(ov, device, dtype)
    elif device.type == "cuda":
        out["loopback_s"] = loopback_overlap(device, dtype)
    return out


def run(args: argparse.Namespace) -> int:
    world, rank, device, dtype = _setup(args)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    try:
        names = _shape_names(args, world, device)
    except ValueError as e:
        print(f"lean bench overlap: {e}", file=sys.stderr)
        return 2
    try:
        peak, peak_source = cpu_peak_flops(dtype) if device.type == "cpu" else peak_flops(device, dtype)
    except KeyError as e:  # a GPU missing from the datasheet table: no MFU
        peak, peak_source = float("nan"), str(e)
    torch.manual_seed(rank)
    results, compute_rows = sweep(args, names, shapes, world, device, dtype, peak)
    calibration = dict(peak_flops=peak, peak_source=peak_source, **calibrate(world, device, dtype, args.timeout))
    if rank == 0:
        report(args, world, device, dtype, calibration, names, results, compute_rows)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- report


def measured_profile(calibration: dict, compute_rows: list[dict], device: torch.device) -> sim.Profile:
    """The model's profile for this machine: links, memory, call cost and contention as calibrated; GEMM FLOP/s the
    median rate of the compute-only runs (``model_cases`` refits it per case). On one GPU the links are not measured
    and, as on any GPU, the contention comes from the H100 datasheet profile."""
    base = sim.H100_SXM if device.type == "cuda" else sim.Profile("cpu", 1, 1, 0, 1, 0)
    return replace(base, name=f"measured {device.type}", flops=median(_case_flops(r, calibration) for r in compute_rows),
                   mem_bw=calibration["mem_bw"], launch=calibration["launch"], source="calibrated on this machine",
                   **{k: calibration[k] for k in ("alpha", "beta", "compute_slowdown", "comm_slowdown")
                      if k in calibration})


def _case_flops(compute_row: dict, calibration: dict) -> float:
    """The GEMM FLOP/s that makes the roofline reproduce this case's measured compute-only time."""
    return compute_row["flops"] / max(compute_row["compute_ms"] / 1e3 - calibration["launch"], 1e-9)


def model_cases(results: list[dict], compute_rows: list[dict], world: int, element_bytes: int,
                shapes: dict[str, Shape], profile: sim.Profile, calibration: dict) -> list[dict]:
    """The model's prediction for every measured case. GEMM efficiency differs between shapes (caches), so each case
    uses the FLOP/s of its own compute-only run; links, memory, contention and the schedule are what is predicted."""
    specs = {(spec.name, name): spec for name in {r["shape"] for r in results}
             for spec in sim.layer_ops(world, **asdict(shapes[name]), element_bytes=element_bytes)}
    flops = {(r["op"], r["shape"]): _case_flops(r, calibration) for r in compute_rows}
    cases = []
    for r in results:
        method = "flash" if r["method"] == "flash-bidir" else r["method"]
        pr = sim.predict(specs[r["op"], r["shape"]], method, replace(profile, flops=flops[r["op"], r["shape"]]),
                         bidirectional=r["method"] == "flash-bidir")
        cases.append({"op": r["op"], "shape": r["shape"], "method": r["method"], "measured_ms": r["latency_ms"],
                      "predicted_ms": pr.latency * 1e3, "error": pr.latency * 1e3 / r["latency_ms"] - 1,
                      "measured_exposed_ms": r["exposed_ms"], "predicted_exposed_ms": pr.exposed * 1e3,
                      "measured_comm_ms": r["comm_ms"], "predicted_comm_ms": pr.comm_only * 1e3})
    return cases


def flash_vs_sliced(results: list[dict]) -> list[dict]:
    """flash against sliced per case; 'within noise' when the gap is below the larger interquartile range."""
    by = {(r["op"], r["shape"], r["method"]): r for r in results}
    rows = []
    for (op, shape, method), f in by.items():
        s = by.get((op, shape, "sliced"))
        if method != "flash" or s is None:
            continue
        gap, noise = f["latency_ms"] - s["latency_ms"], max(f["latency_iqr_ms"], s["latency_iqr_ms"])
        verdict = "faster" if gap < -noise else "slower" if gap > noise else "within noise"
        rows.append({"op": op, "shape": shape, "flash_ms": f["latency_ms"], "sliced_ms": s["latency_ms"],
                     "gap_ms": gap, "noise_ms": noise, "verdict": verdict})
    return rows


def report(args, world: int, device: torch.device, dtype: torch.dtype, calibration: dict, names: list[str],
           results: list[dict], compute_rows: list[dict]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    element_bytes = torch.finfo(dtype).bits // 8
    profile = measured_profile(calibration, compute_rows, device)
    not_measured = [] if world > 1 else [
        "latency, communication-only time, exposed communication and hidden fraction of every method (need >= 2 ranks)",
        "link alpha/beta (the model uses the datasheet NVLink figures)"]
    summary = {"world": world, "backend": dist.get_backend() if dist.is_initialized() else "none",
               "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": str(dtype).removeprefix("torch."), "threads_per_rank": torch.get_num_threads(),
               "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "torch": torch.__version__,
               "repeats": 3 if args.quick else args.repeats, "warmup": 1 if args.quick else args.warmup,
               "quick": args.quick, "shapes": {n: asdict(shapes[n]) for n in names}, "calibration": calibration,
               "compute_only": compute_rows, "results": results, "flash_vs_sliced": flash_vs_sliced(results),
               "not_measured": not_measured}
    cases = model_cases(results, compute_rows, world, element_bytes, shapes, profile, calibration)
    errors = [abs(c["error"]) for c in cases]
    summary["model"] = {"profile": asdict(profile), "cases": cases,
                        "mean_abs_error": sum(errors) / len(errors) if errors else None,
                        "max_abs_error": max(errors) if errors else None}
    (out / "overlap.json").write_text(json.dumps(summary, indent=1))

    projection = sim.projection(sim.GPU_PROFILES)
    (out / "projection.json").write_text(json.dumps({
        "shapes": "Llama-70B-like layer (d 8192, SwiGLU ffn 2x28672, 64 q / 8 kv heads x 128), bf16, degree 8",
        "profiles": {k: asdict(p) for k, p in sim.GPU_PROFILES.items()}, "rows": projection}, indent=1))
    llama = {spec.name.split()[0]: spec for spec in sim.layer_ops(8, 1, 4096, element_bytes=2, **sim.LLAMA70B)}
    draw_methods(sim.H100_SXM, [llama["mlp.fc1"], llama["mlp.fc2"]], out / "gantt.png",
                 "H100-SXM model, Llama-70B-like MLP, TP=8, 4096 tokens (red: exposed communication)")
    if world > 1 and results:
        first = {spec.name.split()[0]: spec
                 for spec in sim.layer_ops(world, **asdict(shapes[names[0]]), element_bytes=element_bytes)}
        draw_methods(profile, [first["mlp.fc1"], first["mlp.fc2"]], out / "gantt_measured.png",
                     f"{profile.name} profile, {names[0]}, world {world} (red: exposed communication)")
    print_tables(summary, projection)
    print(f"lean bench overlap: wrote {out}/overlap.json, projection.json, gantt*.png", flush=True)


def draw_methods(profile: sim.Profile, specs: list[sim.OpSpec], path: Path, title: str) -> None:
    panels = [(f"{spec.name} - {method}", sim.predict(spec, method, profile))
              for spec in specs for method in METHODS]
    sim.draw_gantt(panels, str(path), columns=len(METHODS), title=title)


def print_tables(summary: dict, projection: list[dict]) -> None:
    print(f"\nFlashOverlap on {summary['world']} x {summary['device_name']} ({summary['backend']}, "
          f"{summary['dtype']}, {summary['threads_per_rank']} threads/rank); medians of {summary['repeats']} repeats; "
          f"load average {summary['load_average'][0]:.1f} on {summary['cpu_count']} cores")
    model = {(c["op"], c["shape"], c["method"]): c for c in summary["model"]["cases"]}
    header = (f"{'op':36s} {'shape':16s} {'method':11s} {'latency':>8s} {'iqr':>6s} {'compute':>8s} {'comm':>7s} "
              f"{'exposed':>8s} {'hidden':>7s} {'GFLOP/s':>8s} {'MFU':>6s} {'model':>8s} {'err':>6s}")
    print(header + "\n" + "-" * len(header))
    for r in summary["results"]:
        m = model[r["op"], r["shape"], r["method"]]
        print(f"{r['op']:36s} {r['shape']:16s} {r['method']:11s} {r['latency_ms']:8.2f} {r['latency_iqr_ms']:6.2f} "
              f"{r['compute_ms']:8.2f} {r['comm_ms']:7.2f} {r['exposed_ms']:8.2f} {r['hidden_fraction']:7.2f} "
              f"{r['gflops']:8.1f} {r['mfu']:6.1%} {m['predicted_ms']:8.2f} {m['error']:+6.0%}")
    for r in summary["compute_only"] if not summary["results"] else []:
        print(f"{r['op']:36s} {r['shape']:16s} compute-only {r['compute_ms']:8.2f} ms {r['gflops']:8.1f} GFLOP/s "
              f"MFU {r['mfu']:6.1%}")
    if summary["model"]["mean_abs_error"] is not None:
        print(f"timeline model vs measured latency: mean |error| {summary['model']['mean_abs_error']:.1%}, "
              f"max {summary['model']['max_abs_error']:.1%}")
    for row in summary["flash_vs_sliced"]:
        print(f"flash vs sliced  {row['op']:36s} {row['shape']:16s} {row['flash_ms']:8.2f} vs {row['sliced_ms']:8.2f} ms"
              f"  {row['verdict']}")
    for line in summary["not_measured"]:
        print(f"not measured: {line}")
    print("\nProjection (timeline model), Llama-70B-like layer, degree 8: latency / exposed communication, ms")
    cols = [(p, m) for p in sim.GPU_PROFILES for m in METHODS]
    print(f"{'op':36s} {'tokens':>6s} " + " ".join(f"{p[:8] + ' ' + m:>18s}" for p, m in cols))
    by = {(r["op"], r["tokens"], r["profile"], r["method"]): r for r in projection}
    for op, tokens in dict.fromkeys((r["op"], r["tokens"]) for r in projection):
        cells = [by[op, tokens, p, m] for p, m in cols]
        print(f"{op:36s} {tokens:6d} " + " ".join(f"{c['latency_ms']:9.3f}/{c['exposed_ms']:<8.3f}" for c in cells))
