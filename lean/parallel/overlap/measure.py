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

from lean.observe.metrics import median, synchronize
from lean.parallel.overlap import sim
from lean.parallel.overlap.p2p import Overlap, all_gather_apply, exchange, wait


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
    """p2p_latency (s) and beta (bytes/s) of one ring step: the least-squares line ``t = p2p_latency + bytes / beta``
    through messages from 4 KiB to 8 MiB (float32), the range of the swept chunks; and collective_latency (s): a
    4 KiB all-gather on the whole group less its bandwidth term, ``(P-1) bytes / beta``."""
    sizes = (2**10, 2**14, 2**18, 2**21)
    buffers = {
        n: (torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)) for n in sizes
    }
    small = buffers[sizes[0]][0]
    collective = Overlap("collective", ov.group, timeout=ov.timeout)
    variants: dict[object, Callable[[], object]] = {n: partial(_ring_step, *buffers[n], ov) for n in sizes}
    variants["collective"] = partial(all_gather_apply, small, _ignore, collective)
    samples = time_round_robin(variants, 2, repeats, device)
    element = torch.finfo(dtype).bits // 8
    x = torch.tensor([float(n * element) for n in sizes], dtype=torch.float64)
    out = {}
    for suffix, stat in STATS.items():
        t = torch.tensor([stat(samples[n]) for n in sizes], dtype=torch.float64)
        slope = ((x - x.mean()) * (t - t.mean())).sum() / ((x - x.mean()) ** 2).sum()
        slope = max(slope.item(), 1e-15)
        bandwidth_term = (ov.world - 1) * small.numel() * element * slope
        out |= {
            f"p2p_latency{suffix}": max(t.mean().item() - slope * x.mean().item(), 0.0),
            f"beta{suffix}": 1 / slope,
            f"collective_latency{suffix}": max(stat(samples["collective"]) - bandwidth_term, 0.0),
        }
    return out


def _ignore(*_: object) -> None:
    """A consume callback that keeps nothing (communication alone)."""


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


def fluid_slowdowns(gemm: float, comm: float, gemm_together: float, comm_together: float) -> tuple[float, float]:
    """(compute_slowdown, comm_slowdown) of the fluid model from a GEMM loop and a transfer, alone (``gemm``,
    ``comm``) and started together (each one's end, the GEMM loop outlasting the transfer).

    While both run, compute goes at 1/(1+kc) and the transfer at 1/(1+km): C' = C (1+km), and the GEMM loop loses
    the work it did not do during C', G' - G = C' kc / (1+kc). The fraction is capped at 0.9 (kc <= 9)."""
    x = min(max((gemm_together - gemm) / comm_together, 0.0), 0.9)
    return x / (1 - x), max(comm_together / comm - 1, 0.0)


def _together_cpu(send: torch.Tensor, recv: torch.Tensor, ov: Overlap, gemm_loop: Callable[[], None]):
    """(GEMM loop end, transfer end) in s from a common start: the transfer on a thread (its wait releases the GIL,
    gloo's own thread moves the data), the GEMM loop on this one."""
    stamps: list[float] = []
    start = time.perf_counter()
    transfer = threading.Thread(target=_ring_step, args=(send, recv, ov, stamps))
    transfer.start()
    gemm_loop()
    gemm_end = time.perf_counter() - start
    transfer.join()
    return gemm_end, stamps[0] - start


def _together_cuda(send: torch.Tensor, recv: torch.Tensor, ov: Overlap, gemm_loop: Callable[[], None]):
    """(GEMM loop end, transfer end) in s from a common start, from CUDA events: the ring step on NCCL's stream, its
    end recorded on a side stream made to wait for it, the GEMM loop on the current stream."""
    device = send.device
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    start, comm_end, gemm_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record(main)
    works = exchange([(send, ov.rank + 1)], [(recv, ov.rank - 1)], ov)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        wait(works, ov, "calibration")  # NCCL: orders the side stream after the transfer
        comm_end.record(side)
    gemm_loop()
    gemm_end.record(main)
    torch.cuda.synchronize(device)
    return start.elapsed_time(gemm_end) / 1e3, start.elapsed_time(comm_end) / 1e3


def calibrate_contention(ov: Overlap, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """compute_slowdown and comm_slowdown (:func:`fluid_slowdowns`): a GEMM loop lasting about three ring steps while
    one ring step runs, against each alone. CPU: a 384x384 GEMM and 8 MiB (float32) transfers; GPU: a 4096x4096
    GEMM and 64 MiB (bf16) transfers, the transfer on NCCL's kernels beside the GEMMs."""
    cuda = device.type == "cuda"
    n, size = (2**25, 4096) if cuda else (2**21, 384)
    send, recv = torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    alone = time_round_robin(
        {"comm": partial(_ring_step, send, recv, ov), "gemm": partial(torch.mm, a, b)}, 2, 5, device
    )
    loops = max(1, round(3 * median(alone["comm"]) / median(alone["gemm"])))

    def gemm_loop() -> None:
        for _ in range(loops):
            torch.mm(a, b)

    alone |= time_round_robin({"loop": gemm_loop}, 1, 5, device)
    together = _together_cuda if cuda else _together_cpu
    together_gemm, together_comm = [], []
    for _ in range(5):
        dist.barrier()
        synchronize(device)
        g, c = together(send, recv, ov, gemm_loop)
        together_gemm.append(g)
        together_comm.append(c)
    out = {}
    for suffix, stat in STATS.items():
        kc, km = fluid_slowdowns(*(stat(v) for v in (alone["loop"], alone["comm"], together_gemm, together_comm)))
        out |= {f"compute_slowdown{suffix}": kc, f"comm_slowdown{suffix}": km}
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
        out |= calibrate_contention(ov, device, dtype)
    elif device.type == "cuda":
        out["loopback_s"] = loopback_overlap(device, dtype)
    return out


MEASURED_FIELDS = (
    "mem_bw",
    "launch",
    "p2p_latency",
    "beta",
    "collective_latency",
    "compute_slowdown",
    "comm_slowdown",
)  # the Profile fields a calibration may hold


def measured_profile(
    calibration: dict, compute_rows: list[dict], device: torch.device, suffix: str = ""
) -> sim.Profile:
    """The model's profile for this machine from the fastest (``suffix=""``) or the median (``"_median"``) repeats:
    links, memory, call cost and contention as calibrated, GEMM FLOP/s the median over the compute-only runs
    (``model_cases`` refits it per case). A CPU has no waves (``sms`` 0) and no separate host (``host_issue`` 0); on a
    GPU whatever was not measured (one GPU: the links and the contention) comes from the H100 datasheet profile, and
    ``contention_source`` says which the contention is."""
    base = (
        sim.H100_SXM
        if device.type == "cuda"
        else sim.Profile("cpu", 1, 1, 0, 1, 0, contention_source="not measured (one process): none modelled")
    )
    measured = {k: calibration[k + suffix] for k in MEASURED_FIELDS if k + suffix in calibration}
    contention = (
        f"measured on this machine ({'fastest' if suffix == '' else 'median'} repeats): a GEMM loop beside a ring step"
        if "compute_slowdown" in measured
        else base.contention_source
    )
    return replace(
        base,
        name=f"measured {device.type}",
        source=f"calibrated on this machine{suffix or ' (fastest)'}",
        contention_source=contention,
        flops=median(case_flops(r, calibration["launch" + suffix] + base.host_issue, suffix) for r in compute_rows),
        **measured,
    )


def case_flops(compute_row: dict, overhead: float, suffix: str, efficiency: float = 1.0) -> float:
    """The GEMM FLOP/s that makes the roofline reproduce this case's compute-only time (fastest or median):
    ``overhead`` the per-call cost around the GEMM (launch, host issue), ``efficiency`` its wave efficiency."""
    seconds = compute_row["compute_min_ms" if suffix == "" else "compute_ms"] / 1e3
    return compute_row["flops"] / efficiency / max(seconds - overhead, 1e-9)
