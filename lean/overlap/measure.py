"""Measured figures for the overlap benchmark and the timeline model: round-robin timing, peak FLOP/s, and the
calibration of a ``sim.Profile`` on this machine (links, memory, per-call cost, compute/transfer contention).

Every calibration reports two statistics of its repeats: the fastest (keys without suffix), the best estimate of the
machine itself when other processes share it, and the median (keys ending in ``_median``), the best estimate of what a
user of the shared machine sees.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from lean.metrics import median, synchronize
from lean.overlap import sim
from lean.overlap.p2p import Overlap, exchange, wait


def time_round_robin(
    variants: dict[str, Callable[[], object]], warmup: int, repeats: int, device: torch.device, calls: int = 1
) -> dict[str, list[float]]:
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


def _ring_step(send: torch.Tensor, recv: torch.Tensor, ov: Overlap, stamps: list[float] | None = None) -> None:
    """One flash ring step (send right, receive left); appends its completion time to ``stamps`` if given."""
    wait(exchange([(send, ov.rank + 1)], [(recv, ov.rank - 1)], ov), ov, "calibration")
    if stamps is not None:
        stamps.append(time.perf_counter())


STATS = {"": min, "_median": median}  # calibration keys: fastest repeat (no suffix) and median ("_median")


def calibrate_links(ov: Overlap, device: torch.device, dtype: torch.dtype, repeats: int = 7) -> dict[str, float]:
    """alpha (s) and beta (bytes/s) of one ring step: the least-squares line ``t = alpha + bytes / beta`` through
    messages from 4 KiB to 8 MiB (float32), the range of the swept chunks."""
    sizes = (2**10, 2**14, 2**18, 2**21)
    buffers = {
        n: (torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)) for n in sizes
    }
    samples = time_round_robin({n: partial(_ring_step, *buffers[n], ov) for n in sizes}, 2, repeats, device)
    x = torch.tensor([float(n * torch.finfo(dtype).bits // 8) for n in sizes], dtype=torch.float64)
    out = {}
    for suffix, stat in STATS.items():
        t = torch.tensor([stat(samples[n]) for n in sizes], dtype=torch.float64)
        slope = ((x - x.mean()) * (t - t.mean())).sum() / ((x - x.mean()) ** 2).sum()
        slope = max(slope.item(), 1e-15)
        out |= {f"alpha{suffix}": max(t.mean().item() - slope * x.mean().item(), 0.0), f"beta{suffix}": 1 / slope}
    return out


def calibrate_memory(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """mem_bw (bytes/s of a large copy) and launch (s per tiny matmul call): the roofline's memory side, call cost."""
    src = torch.ones(2**24 if device.type == "cpu" else 2**28, dtype=dtype, device=device)
    dst, a = torch.empty_like(src), torch.ones(8, 8, dtype=dtype, device=device)
    copy = time_round_robin({"copy": partial(dst.copy_, src)}, 2, 5, device)["copy"]
    call = time_round_robin({"call": partial(torch.mm, a, a)}, 2, 5, device, calls=200)["call"]
    nbytes = 2 * src.numel() * src.element_size()
    return {
        k: v
        for suffix, stat in STATS.items()
        for k, v in ((f"mem_bw{suffix}", nbytes / stat(copy)), (f"launch{suffix}", stat(call)))
    }


def calibrate_contention(ov: Overlap, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """compute_slowdown and comm_slowdown on a CPU: a GEMM loop while a ring step runs, against each alone.

    Fluid model: while both run, compute goes at 1/(1+kc) and the transfer at 1/(1+km). With G, C the times alone and
    G', C' together (the GEMM loop outlasting the transfer): C' = C (1+km) and G' - G = C' kc / (1+kc).
    """
    send, recv = torch.ones(2**21, dtype=dtype), torch.empty(2**21, dtype=dtype)
    a, b = torch.randn(384, 384, dtype=dtype), torch.randn(384, 384, dtype=dtype)
    alone = time_round_robin(
        {"comm": partial(_ring_step, send, recv, ov), "gemm": partial(torch.mm, a, b)}, 2, 5, device
    )
    loops = max(1, round(3 * median(alone["comm"]) / median(alone["gemm"])))

    def gemm_loop() -> None:
        for _ in range(loops):
            torch.mm(a, b)

    alone |= time_round_robin({"loop": gemm_loop}, 1, 5, device)
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
    out = {}
    for suffix, stat in STATS.items():
        comm, gemm, comm_t, gemm_t = (stat(v) for v in (alone["comm"], alone["loop"], together_comm, together_gemm))
        x = min(max((gemm_t - gemm) / comm_t, 0.0), 0.9)
        out |= {f"compute_slowdown{suffix}": x / (1 - x), f"comm_slowdown{suffix}": max(comm_t / comm - 1, 0.0)}
    return out


def loopback_overlap(device: torch.device, dtype: torch.dtype) -> dict:
    """One GPU, no peer: a device-to-device copy on a side stream while a GEMM runs, against each alone (seconds)."""
    src = torch.ones(2**28, dtype=dtype, device=device)
    dst, a = torch.empty_like(src), torch.randn(8192, 8192, dtype=dtype, device=device)
    side = torch.cuda.Stream(device)

    def copy():
        side.wait_stream(torch.cuda.current_stream(device))  # src was written on the main stream
        with torch.cuda.stream(side):
            dst.copy_(src)

    def both():
        copy()
        a @ a
        torch.cuda.current_stream(device).wait_stream(side)

    t = time_round_robin(
        {
            "copy": lambda: (copy(), torch.cuda.current_stream(device).wait_stream(side)),
            "gemm": lambda: a @ a,
            "both": both,
        },
        2,
        5,
        device,
    )
    return {name: median(v) for name, v in t.items()}


def calibrate(world: int, device: torch.device, dtype: torch.dtype, timeout: float) -> dict:
    """The figures the timeline model needs from this machine (see the calibrate_* functions)."""
    out = calibrate_memory(device, dtype)
    if world > 1:
        ov = Overlap("flash", timeout=timeout)
        out |= calibrate_links(ov, device, dtype)
        if device.type == "cpu":
            out |= calibrate_contention(ov, device, dtype)
    elif device.type == "cuda":
        out["loopback_s"] = loopback_overlap(device, dtype)
    return out


def measured_profile(
    calibration: dict, compute_rows: list[dict], device: torch.device, suffix: str = ""
) -> sim.Profile:
    """The model's profile for this machine from the fastest (``suffix=""``) or the median (``"_median"``) repeats:
    links, memory, call cost and contention as calibrated, GEMM FLOP/s the median over the compute-only runs
    (``model_cases`` refits it per case). On one GPU the links are not measured and, as on any GPU, the contention
    comes from the H100 datasheet profile."""
    base = sim.H100_SXM if device.type == "cuda" else sim.Profile("cpu", 1, 1, 0, 1, 0)
    fields = ("mem_bw", "launch", "alpha", "beta", "compute_slowdown", "comm_slowdown")
    return replace(
        base,
        name=f"measured {device.type}",
        source=f"calibrated on this machine{suffix or ' (fastest)'}",
        flops=median(case_flops(r, calibration["launch" + suffix], suffix) for r in compute_rows),
        **{k: calibration[k + suffix] for k in fields if k + suffix in calibration},
    )


def case_flops(compute_row: dict, launch: float, suffix: str) -> float:
    """The GEMM FLOP/s that makes the roofline reproduce this case's compute-only time (fastest or median)."""
    seconds = compute_row["compute_min_ms" if suffix == "" else "compute_ms"] / 1e3
    return compute_row["flops"] / max(seconds - launch, 1e-9)
