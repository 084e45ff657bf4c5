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
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from lean.metrics import keep_freed_memory, median, peak_flops
from lean.overlap import ops, sim
from lean.overlap.measure import calibrate, case_flops, measured_profile, time_round_robin
from lean.overlap.p2p import METHODS, Overlap, all_gather_apply, all_to_all_apply, reduce_scatter_apply


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


Case = tuple[Callable[[Overlap], object], Callable[[Overlap], object], Callable[[], object]]


def _case(spec: sim.OpSpec, shape: Shape, dtype: torch.dtype, device: torch.device) -> Case:
    """(the op, its communication alone, the whole local GEMM alone) for one op of ``sim.layer_ops``; the first two
    take the :class:`Overlap` to run with. Communication alone is the same pattern with no GEMM around it."""
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


def _quartiles(values: list[float]) -> tuple[float, float]:
    v = sorted(values)
    return v[len(v) // 4], v[(3 * len(v)) // 4]


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
        keep_freed_memory()  # every op allocates its outputs: no fresh page faults on each call
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
            compute = samples.pop("compute")
            compute_rows.append({"op": spec.name, "shape": shape_name, "flops": spec.flops, "calls_per_sample": calls,
                                 "compute_ms": median(compute) * 1e3, "compute_min_ms": min(compute) * 1e3,
                                 "gflops": spec.flops / median(compute) / 1e9, "mfu": spec.flops / median(compute) / peak})
            for v in (k for k in samples if not k.endswith(":comm")):
                results.append({"op": spec.name, "shape": shape_name, "method": v,
                                **overlap_stats(samples[v], compute, samples[f"{v}:comm"], spec.flops, peak)})
    return results, compute_rows


def overlap_stats(latency: list[float], compute: list[float], comm: list[float], flops: float, peak: float) -> dict:
    """The reported figures of one case, from the medians and (``_min``) from the fastest repeats, in ms.

    The fastest repeat is the one least disturbed by other processes: on a shared machine it is the better estimate of
    the machine itself, the median the better one of what a user sees."""
    out = {}
    for suffix, stat in (("", median), ("_min", min)):
        t, c, m = stat(latency), stat(compute), stat(comm)
        out |= {f"latency{suffix}_ms": t * 1e3, f"compute{suffix}_ms": c * 1e3, f"comm{suffix}_ms": m * 1e3,
                f"exposed{suffix}_ms": (t - c) * 1e3, f"hidden_fraction{suffix}": 1 - (t - c) / m}
    q1, q3 = _quartiles(latency)
    return out | {"latency_iqr_ms": (q3 - q1) * 1e3, "gflops": flops / median(latency) / 1e9,
                  "mfu": flops / median(latency) / peak}


def run(args: argparse.Namespace) -> int:
    world, rank, device, dtype = _setup(args)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    try:
        names = _shape_names(args, world, device)
    except ValueError as e:
        print(f"lean bench overlap: {e}", file=sys.stderr)
        return 2
    try:
        peak, peak_source = peak_flops(device, dtype)
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


def model_cases(results: list[dict], compute_rows: list[dict], world: int, element_bytes: int,
                shapes: dict[str, Shape], calibration: dict, device: torch.device) -> list[dict]:
    """The model's prediction for every measured case, twice: calibrated on the fastest repeats and compared with
    the fastest repeat (the machine without outside load), and calibrated on and compared with the medians.

    GEMM efficiency differs between shapes (caches), so each case uses the FLOP/s of its own compute-only run: links,
    memory, contention and the schedule are what is predicted."""
    specs = {(spec.name, name): spec for name in {r["shape"] for r in results}
             for spec in sim.layer_ops(world, **asdict(shapes[name]), element_bytes=element_bytes)}
    cases = [{"op": r["op"], "shape": r["shape"], "method": r["method"]} for r in results]
    for suffix, measured in (("", "_min"), ("_median", "")):
        profile = measured_profile(calibration, compute_rows, device, suffix)
        flops = {(r["op"], r["shape"]): case_flops(r, profile.launch, suffix) for r in compute_rows}
        for case, r in zip(cases, results):
            pr = sim.predict(specs[r["op"], r["shape"]], "flash" if r["method"] == "flash-bidir" else r["method"],
                             replace(profile, flops=flops[r["op"], r["shape"]]),
                             bidirectional=r["method"] == "flash-bidir")
            key = "fastest" if suffix == "" else "median"
            case |= {f"predicted_{key}_ms": pr.latency * 1e3, f"measured_{key}_ms": r[f"latency{measured}_ms"],
                     f"error_{key}": pr.latency * 1e3 / r[f"latency{measured}_ms"] - 1,
                     f"predicted_exposed_{key}_ms": pr.exposed * 1e3,
                     f"measured_exposed_{key}_ms": r[f"exposed{measured}_ms"],
                     f"predicted_comm_{key}_ms": pr.comm_only * 1e3, f"measured_comm_{key}_ms": r[f"comm{measured}_ms"]}
    return cases


def _error_summary(cases: list[dict], key: str) -> dict:
    errors = [abs(c[f"error_{key}"]) for c in cases]
    return {f"mean_abs_error_{key}": sum(errors) / len(errors) if errors else None,
            f"max_abs_error_{key}": max(errors) if errors else None,
            f"within_15pct_{key}": sum(e <= 0.15 for e in errors)}


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
                     "gap_ms": gap, "noise_ms": noise, "verdict": verdict,
                     "flash_min_ms": f["latency_min_ms"], "sliced_min_ms": s["latency_min_ms"]})
    return rows


def report(args, world: int, device: torch.device, dtype: torch.dtype, calibration: dict, names: list[str],
           results: list[dict], compute_rows: list[dict]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    element_bytes = torch.finfo(dtype).bits // 8
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
    cases = model_cases(results, compute_rows, world, element_bytes, shapes, calibration, device) if results else []
    profile = measured_profile(calibration, compute_rows, device)
    summary["model"] = {"profile": asdict(profile),
                        "profile_median": asdict(measured_profile(calibration, compute_rows, device, "_median")),
                        "cases": cases, **_error_summary(cases, "fastest"), **_error_summary(cases, "median")}
    (out / "overlap.json").write_text(json.dumps(summary, indent=1))

    projection = sim.projection(sim.GPU_PROFILES)
    (out / "projection.json").write_text(json.dumps({
        "shapes": "Llama-70B-like layer (d 8192, SwiGLU ffn 2x28672, 64 q / 8 kv heads x 128), bf16, degree 8",
        "profiles": {k: asdict(p) for k, p in sim.GPU_PROFILES.items()}, "rows": projection}, indent=1))
    draw_methods(sim.H100_SXM, sim.layer_ops(8, 1, 4096, element_bytes=2, **sim.LLAMA70B), out / "gantt.png",
                 "H100-SXM model, Llama-70B-like layer, degree 8, 4096 tokens")
    if world > 1 and results:
        draw_methods(profile, sim.layer_ops(world, **asdict(shapes[names[0]]), element_bytes=element_bytes),
                     out / "gantt_measured.png", f"{profile.name} profile, {names[0]}, world {world}")
    print_tables(summary, projection)
    print(f"lean bench overlap: wrote {out}/overlap.json, projection.json, gantt*.png", flush=True)


def draw_methods(profile: sim.Profile, specs: list[sim.OpSpec], path: Path, title: str) -> None:
    panels = [(f"{spec.name} - {method}", sim.predict(spec, method, profile))
              for spec in specs for method in METHODS]
    sim.draw_gantt(panels, str(path), columns=len(METHODS), title=title)


def print_tables(summary: dict, projection: list[dict]) -> None:
    print(f"\nFlashOverlap on {summary['world']} x {summary['device_name']} ({summary['backend']}, "
          f"{summary['dtype']}, {summary['threads_per_rank']} threads/rank), {summary['repeats']} repeats, "
          f"load average {summary['load_average'][0]:.1f} on {summary['cpu_count']} cores. Times in ms: median (min); "
          f"hidden = 1 - exposed / comm-only; model: calibrated on medians (on minima)")
    predicted = {(c["op"], c["shape"], c["method"]): c for c in summary["model"]["cases"]}
    header = (f"{'op':34s} {'shape':15s} {'method':11s} {'latency':>15s} {'iqr':>5s} {'compute':>14s} "
              f"{'comm-only':>13s} {'exposed':>13s} {'hidden':>13s} {'GFLOP/s':>7s} {'MFU':>5s} {'model':>14s} "
              f"{'error':>13s}")
    print(header + "\n" + "-" * len(header))
    for r in summary["results"]:
        m = predicted[r["op"], r["shape"], r["method"]]
        print(f"{r['op']:34s} {r['shape']:15s} {r['method']:11s} {r['latency_ms']:7.2f} ({r['latency_min_ms']:5.2f}) "
              f"{r['latency_iqr_ms']:5.2f} {r['compute_ms']:6.2f} ({r['compute_min_ms']:5.2f}) "
              f"{r['comm_ms']:5.2f} ({r['comm_min_ms']:5.2f}) {r['exposed_ms']:5.2f} ({r['exposed_min_ms']:5.2f}) "
              f"{r['hidden_fraction']:5.2f} ({r['hidden_fraction_min']:5.2f}) {r['gflops']:7.1f} {r['mfu']:5.0%} "
              f"{m['predicted_median_ms']:6.2f} ({m['predicted_fastest_ms']:5.2f}) "
              f"{m['error_median']:+5.0%} ({m['error_fastest']:+5.0%})")
    for r in summary["compute_only"] if not summary["results"] else []:
        print(f"{r['op']:36s} {r['shape']:16s} compute-only {r['compute_ms']:8.2f} ms {r['gflops']:8.1f} GFLOP/s "
              f"MFU {r['mfu']:6.1%}")
    model = summary["model"]
    for key in ("median", "fastest") if model["cases"] else ():
        print(f"timeline model vs measured latency ({key} repeats): mean |error| {model[f'mean_abs_error_{key}']:.1%}, "
              f"max {model[f'max_abs_error_{key}']:.1%}, {model[f'within_15pct_{key}']}/{len(model['cases'])} "
              f"cases within 15%")
    for row in summary["flash_vs_sliced"]:
        print(f"flash vs sliced  {row['op']:34s} {row['shape']:15s} median {row['flash_ms']:6.2f} vs "
              f"{row['sliced_ms']:6.2f} ms: {row['verdict']:12s} (min {row['flash_min_ms']:6.2f} vs "
              f"{row['sliced_min_ms']:6.2f})")
    for line in summary["not_measured"]:
        print(f"not measured: {line}")
    print("\nProjection (timeline model), Llama-70B-like layer, degree 8: latency / exposed communication, ms")
    cols = [(p, m) for p in sim.GPU_PROFILES for m in METHODS]
    print(f"{'op':36s} {'tokens':>6s} " + " ".join(f"{p[:8] + ' ' + m:>18s}" for p, m in cols))
    by = {(r["op"], r["tokens"], r["profile"], r["method"]): r for r in projection}
    for op, tokens in dict.fromkeys((r["op"], r["tokens"]) for r in projection):
        cells = [by[op, tokens, p, m] for p, m in cols]
        print(f"{op:36s} {tokens:6d} " + " ".join(f"{c['latency_ms']:9.3f}/{c['exposed_ms']:<8.3f}" for c in cells))
