"""Measurement shared by training, benchmarks and the overlap ops: phase timers, peak memory, FLOPs, peak FLOP/s.

Peak memory
    CUDA: the caching allocator's ``max_memory_allocated`` since the last reset (tensor bytes).
    CPU: the kernel's resident-set high-water mark ``VmHWM`` of this process, reset at the start of the measured region
    by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0). It is a real process measurement, so it includes the
    interpreter, the libraries and the weights; ``PeakMemory.delta_mb`` subtracts the resident size at the reset to get
    what the region itself added. Where ``clear_refs`` is not writable we fall back to ``ru_maxrss`` (never reset).

FLOPs
    ``lean.observe.flops.FlopCounter`` (torch's formulas, as ``FlopCounterMode`` counts them, at a third of its
    overhead) around a region; forward and backward regions are counted separately by the caller (``FlopTally``) so
    that MFU can count only the FLOPs an algorithm needs.

Peak FLOP/s
    CPU: measured by a calibration matmul (best of a few timed repetitions). GPU: the vendor's dense tensor-core figure
    from ``GPU_PEAK_TFLOPS`` (datasheet numbers, no sparsity, by the exact device name; float32 at the TF32 rate when
    TF32 is on); a GPU the table does not name gets a calibration matmul's figure, with a warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import statistics
import time
import warnings
from collections import defaultdict

import torch

from lean.observe.flops import FlopCounter

# Dense (non-sparse) peak TFLOP/s from the NVIDIA datasheets (SXM parts). fp32 = plain FP32 (no TF32).
TF32 = "tf32"  # the tensor-core rate float32 matmuls get with TF32 on (torch.set_float32_matmul_precision("high"))


def _rates(half: float, tf32: float, single: float, double: float) -> dict:
    return {torch.bfloat16: half, torch.float16: half, TF32: tf32, torch.float32: single, torch.float64: double}


# Dense (no sparsity) peak TFLOP/s from NVIDIA's datasheets, by the exact name torch.cuda.get_device_name() reports:
# an H100 PCIe or NVL must not get the SXM part's figures. float64: the FP64 tensor-core rate.
_HOPPER_SXM, _HOPPER_NVL = _rates(989.4, 494.7, 66.9, 66.9), _rates(835.5, 417.5, 60.0, 60.0)
_AMPERE = _rates(312.0, 156.0, 19.5, 19.5)
GPU_PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": _HOPPER_SXM,
    "NVIDIA H100 PCIe": _rates(756.0, 378.0, 51.2, 51.2),
    "NVIDIA H100 NVL": _HOPPER_NVL,
    "NVIDIA H200": _HOPPER_SXM,  # the SXM part: the H100's arithmetic, more memory
    "NVIDIA H200 NVL": _HOPPER_NVL,
    "NVIDIA A100-SXM4-80GB": _AMPERE,
    "NVIDIA A100-SXM4-40GB": _AMPERE,
    "NVIDIA A100-PCIE-40GB": _AMPERE,
    "NVIDIA A100 80GB PCIe": _AMPERE,
    # GA102: the RTX A6000 datasheet's 38.7 FP32 TFLOPS and 309.7 tensor TFLOPS with sparsity (154.8 dense, bf16 and
    # fp16), TF32 at twice FP32 as the A40's datasheet gives it for the same chip; FP64 at 1/32 of FP32
    "NVIDIA RTX A6000": _rates(154.8, 77.4, 38.7, 1.2),
}


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


class PhaseTimer:
    """Wall-clock seconds accumulated per named phase: ``with timer("rollout"): ...``."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[phase] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()


# ---------------------------------------------------------------- memory

_STATUS = "/proc/self/status"


def read_status_kb(key: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def rss_mb() -> float:
    kb = read_status_kb("VmRSS")
    return kb / 1024 if kb is not None else float("nan")


MEMORY_MARGIN = 0.9  # of what the device has: room for fragmentation and what the prediction does not see


def device_memory_mb(device: torch.device) -> float:
    """What this process may still use: on a GPU, the free memory plus what torch's allocator already holds (the CUDA
    context and other processes are not in it), times :data:`MEMORY_MARGIN`; on a CPU, the available RAM plus this
    process's resident set."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return (free + torch.cuda.memory_reserved(device)) * MEMORY_MARGIN / 2**20
    return available_ram_mb() + rss_mb()


def available_ram_mb() -> float:
    """MemAvailable of /proc/meminfo, MiB."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 1024


def host_memory_mb() -> float | None:
    """The RAM this process may still pin for offloaded tensors: the available RAM times :data:`MEMORY_MARGIN`, shared
    by the node's processes (``LOCAL_WORLD_SIZE``, as torchrun and Accelerate set it); None where /proc/meminfo is
    missing."""
    try:
        available = available_ram_mb()
    except OSError:
        return None
    return available * MEMORY_MARGIN / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -3, -4, -8
_heap_keeps_freed = False


def _mallopt(*settings: tuple[int, int]) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(bool(libc.mallopt(param, value)) for param, value in settings)
    except (OSError, AttributeError):
        return False


def share_main_arena() -> bool:
    """CPU timing: every thread allocates from glibc's main arena, the heap :func:`keep_freed_memory` keeps warm.

    A thread takes an arena at its first allocation and keeps it. Another arena's heaps hold at most 64 MiB, so a
    thread with an arena of its own gets each larger block as a fresh mmap, unmapped again on free, whatever the
    thresholds say: the scoring worker (``lean.run.async_scoring``) decoded FLUX small's 16 images at 256 px with
    410 k page faults every time, +0.6 s a decode, more after some schedules than after others. Call it before
    threads allocate (torch's OpenMP workers start at the first parallel op): at a benchmark's start.
    """
    return _mallopt((_M_ARENA_MAX, 1))


def keep_freed_memory() -> bool:
    """CPU timing: let glibc keep freed memory mapped and serve every allocation from its heap.

    By default large blocks are mmap'ed and handed back on free, so a step that keeps its activations alive (Retain)
    pays fresh page faults on every allocation while a no-grad step reuses warm pages: an allocator artefact, not a
    property of the schedule (the CUDA caching allocator has no such cost). Trimming is off altogether (-1): with the
    largest positive threshold (2 GiB), the heap top that Retain's backward frees on Wan (its kept graphs, > 2 GiB)
    went back to the kernel every iteration, and the next decode page-faulted it in again (~0.5 M faults, +3 s).
    One arena for all threads (:func:`share_main_arena`, which only threads that have not allocated yet follow).
    Memory is measured under :func:`live_bytes_heap` instead.
    """
    global _heap_keeps_freed
    _heap_keeps_freed = share_main_arena() and _mallopt((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    return _heap_keeps_freed


@contextlib.contextmanager
def live_bytes_heap():
    """CPU memory measurement: every block of 128 KiB or more is mmap'ed and unmapped on free, so the resident set
    follows the bytes tensors hold (what ``torch.cuda.max_memory_allocated`` counts on GPU), not the high tide of a
    heap that keeps freed memory (fragmentation included). Slower: each large allocation page-faults. Afterwards the
    heap goes back to keeping freed memory if it did, else to fixed 32 MiB thresholds (glibc's dynamic maximum)."""
    _mallopt((_M_MMAP_MAX, 65536), (_M_MMAP_THRESHOLD, 128 * 1024), (_M_TRIM_THRESHOLD, 128 * 1024))
    try:
        yield
    finally:
        if _heap_keeps_freed:
            keep_freed_memory()
        else:
            _fixed_thresholds()


def _fixed_thresholds() -> None:
    _mallopt((_M_MMAP_MAX, 65536), (_M_MMAP_THRESHOLD, 32 * 2**20), (_M_TRIM_THRESHOLD, 64 * 2**20))


def default_heap() -> None:
    """Undo :func:`keep_freed_memory`: the heap returns freed memory again (at fixed 32 MiB thresholds), and what it
    kept goes back now."""
    global _heap_keeps_freed
    _heap_keeps_freed = False
    _fixed_thresholds()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_cpu_peak() -> bool:
    # Give freed heap pages back to the kernel first, or a previous region's high tide would count as resident.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory of a region, in MiB: ``with PeakMemory(device) as pm: ...; pm.peak_mb, pm.delta_mb``."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled  # disabled: no trim, no reset, peak stays nan (timed benchmark rounds)
        self.peak_mb = float("nan")
        self.start_mb = float("nan")

    def __enter__(self):
        if not self.enabled:
            return self
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_mb = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            self._resettable = reset_cpu_peak()
            self.start_mb = rss_mb()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            kb = read_status_kb("VmHWM") if self._resettable else None
            if kb is None:  # ru_maxrss is in kB on Linux
                kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_mb = kb / 1024
        return False

    @property
    def delta_mb(self) -> float:
        return self.peak_mb - self.start_mb


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def stays_on_device(t: torch.Tensor) -> bool:
    """Whether a saved tensor stays where it is when kept graphs are offloaded (``lean.schedules.offload``): a
    parameter or a view of one (resident anyway; FSDP2 re-gathers its own), a leaf (an input the caller holds), a
    sparse or empty tensor. What moves has a ``grad_fn``: an activation of the tracked forward."""
    if is_parameter(t):
        return True
    return t.grad_fn is None or t.layout != torch.strided or t.numel() == 0


def span(t: torch.Tensor) -> int:
    """Elements of ``t``'s storage from its first element to its last, 1 + sum_d (size_d - 1) stride_d: what a copy
    that keeps ``t``'s strides holds (``numel`` for a dense layout in any dimension order; less for an expanded view,
    more for a strided slice)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def nbytes(t: torch.Tensor) -> int:
    """Bytes a copy of ``t`` moves: its :func:`span`."""
    return span(t) * t.element_size()


class SavedBytes:
    """Bytes autograd saves for backward while :meth:`watching`, counted between two :meth:`take` calls: every
    distinct storage once (views of one tensor share it), and apart the bytes an offload of the kept graphs would
    move (:func:`stays_on_device` excluded; each distinct view's :func:`nbytes`, as the offload's hooks copy them).
    The moved part is counted on the meta device too (``lean.plan.meta``)."""

    def __init__(self):
        self.pending: dict[int, int] = {}
        self.moved: dict[tuple, int] = {}

    def _pack(self, tensor):
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            if tensor.device.type != "meta" and not is_parameter(tensor):  # resident before the step, and after
                self.pending[storage.data_ptr()] = storage.nbytes()
            if not stays_on_device(tensor):  # the offload's record key: a view of a live storage
                key = (storage._cdata, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
                self.moved[key] = nbytes(tensor)
        return tensor

    @contextlib.contextmanager
    def watching(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    def take_split(self) -> tuple[int, int]:
        """(every saved storage's bytes, the bytes an offload moves) since the last take; both restart."""
        total, moved = sum(self.pending.values()), sum(self.moved.values())
        self.pending.clear()
        self.moved.clear()
        return total, moved

    def take(self) -> int:
        return self.take_split()[0]


# ---------------------------------------------------------------- FLOPs


class FlopTally:
    """FLOPs per named region of one measured stretch of work.

    One ``FlopCounter`` runs for the whole ``measuring()`` block; ``region(name)`` attributes the FLOPs counted
    while it is the innermost open region to ``name`` (regions nest: a backward inside the rollout counts as
    ``backward``, not twice). Outside ``measuring()`` a region costs one ``if``.
    """

    def __init__(self):
        self.flops: dict[str, int] = defaultdict(int)
        self._mode = None
        self._stack: list[str] = []
        self._seen = 0

    @contextlib.contextmanager
    def measuring(self):
        with FlopCounter() as mode:
            self._mode, self._seen = mode, 0
            try:
                with self.region("other"):
                    yield self
            finally:
                self._mode = None

    def _attribute(self) -> None:
        total = self._mode.total
        if self._stack:
            self.flops[self._stack[-1]] += total - self._seen
        self._seen = total

    @property
    def counting(self) -> bool:
        """Inside ``measuring()``: the counter sees only this thread's work."""
        return self._mode is not None

    @contextlib.contextmanager
    def region(self, name: str):
        if self._mode is None:
            yield
            return
        self._attribute()
        self._stack.append(name)
        try:
            yield
        finally:
            self._attribute()
            self._stack.pop()

    def total(self, *regions: str) -> int:
        return sum(self.flops.get(r, 0) for r in regions) if regions else sum(self.flops.values())


# ---------------------------------------------------------------- peak FLOP/s


def calibrate_cpu_peak_flops(
    sizes: tuple[int, ...] = (256, 512, 1024), dtype: torch.dtype = torch.float32, repeats: int = 5
) -> float:
    """Best FLOP/s of square matmuls on this CPU with torch's current thread count.

    Several sizes, because which one reaches the peak depends on the cache sizes; taking only a large one would let
    smaller GEMMs report more than 100% MFU.
    """
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up: thread pool, caches
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def calibrate_gpu_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    """Best FLOP/s of an ``n``-cube matmul on a CUDA device (random data), after a warm-up."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        best = max(best, 2 * n**3 / (start.elapsed_time(end) / 1e3))
    return best


def gpu_peak_flops(dtype: torch.dtype, device_name: str, tf32: bool = False) -> float | None:
    """Datasheet dense peak of the GPU named ``device_name`` for ``dtype`` (float32 at the TF32 rate when ``tf32``);
    None for a GPU the table does not name exactly."""
    table = GPU_PEAK_TFLOPS.get(device_name)
    if table is None:
        return None
    return table[TF32 if dtype == torch.float32 and tf32 else dtype] * 1e12


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for the device the work runs on. A GPU missing from the datasheet table
    gets a calibration matmul's figure, with a warning: a measurement degrades, it does not die."""
    device = torch.device(device)
    if device.type == "cuda":
        name, tf32 = torch.cuda.get_device_name(device), torch.get_float32_matmul_precision() != "highest"
        peak = gpu_peak_flops(dtype, name, tf32)
        if peak is not None:
            return peak, f"datasheet:{name}" + (":tf32" if tf32 and dtype == torch.float32 else "")
        warnings.warn(
            f"no datasheet peak for GPU {name!r} (lean.observe.metrics.GPU_PEAK_TFLOPS): MFU uses the best of a "
            f"calibration matmul instead",
            stacklevel=2,
        )
        return calibrate_gpu_peak_flops(device, dtype), f"calibration:matmul-8192-{name}"
    cal_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return calibrate_cpu_peak_flops(dtype=cal_dtype), f"calibration:best-matmul-256..1024-{cal_dtype}"


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")
