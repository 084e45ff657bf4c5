"""Event-driven timeline model of the three overlap methods: predicted latency and exposed communication.

One rank is simulated with one compute stream, one communication stream and the host that issues both. Every rank
runs the same schedule shifted by its rank, so a peer's half of each transfer happens at the same time as this rank's
(stragglers are not modelled). The schedules mirror ``p2p.py`` call by call, in its issue order, including the
host-side ordering: a flash ring step is posted only after the previous step completed and the GEMM queued before it
was issued (NCCL's stream also waits for that GEMM).

Costs (``Profile``; every figure is a sustained rate or a fixed cost, stated where the profile is defined):

    host issue            each launched op (GEMM, add/copy, P2P step, collective) takes ``host_issue`` s of host time,
                          in program order; an op cannot start before the host has issued it
    GEMM (m, k, n)        launch + max(compute, bytes(m k + k n + m n) / mem_bw)                          roofline
    compute, on a GPU     waves * sms * 2 tile_m tile_n k / flops,  waves = ceil(tiles / sms),
                          tiles = ceil(m / tile_m) ceil(n / tile_n)                              wave quantisation
                          (``flops``: the rate of full waves of whole tiles; a 512-row chunk of a GEMM leaves SMs idle
                          in its only wave, which a whole GEMM amortises over many). The tile is the one of
                          ``tiles`` that wastes the fewest SM slots (the library's choice), every tile assumed to run
                          at the same per-SM rate: one tile is the pessimistic case for small GEMMs, several the
                          optimistic one (``BEST_TILES``)
    compute, on a CPU     2 m k n / flops                                                       (``sms == 0``)
    add / copy of B bytes launch + (3 or 2) B / mem_bw
    P2P step              p2p_latency + B / beta        B: bytes this rank sends in the step (its links are shared)
    ring collective       collective_latency + (P-1) max(B / beta, reduce)     B: one rank's chunk. The ring's steps
                          are pipelined inside one call, so the latency is paid once per call, not per step; a
                          reduce-scatter adds each arriving chunk in the same kernel (reduce = 3 B / mem_bw per step),
                          overlapped with the next step's transfer
    all-to-all            collective_latency + (P-1) B / beta
A 16-bit reduce-scatter (``element_bytes == 2``) is what ``p2p.py`` runs for it: an all-to-all of the partials and a
float32-accumulated reduction of the P blocks, (P + 1) B / mem_bw for a chunk of B bytes (collective, sliced: per
slice as it arrives; flash: at the end, after placing the local block).

While both streams are busy, compute runs ``1/(1+compute_slowdown)`` as fast (transfers take SMs, or on a CPU the
transport thread takes a core) and transfers ``1/(1+comm_slowdown)`` as fast; the simulation integrates these rates.
The slowdowns are measured where a benchmark ran (``lean.parallel.overlap.measure``) and assumed otherwise; each profile
says which in ``contention_source``.

Exposed communication (``Prediction.exposed``) is the latency minus the compute-only time of the same shapes (the
whole local GEMM, one launch): what the op costs beyond its compute, in seconds, comparable across methods. It also
counts the compute slowed down by concurrent transfers and the chunk GEMMs' lost efficiency.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

Pattern = Literal["all_gather", "reduce_scatter", "all_to_all"]
COMPUTE, COMM = "compute", "comm"


@dataclass(frozen=True)
class Profile:
    """One rank's hardware, as the model sees it (all rates sustained, not peak); see the module doc for the costs."""

    name: str
    flops: float  # GEMM FLOP/s of full waves of whole tiles (a CPU: of its GEMMs)
    mem_bw: float  # bytes/s
    p2p_latency: float  # s per P2P step (a send/receive pair)
    beta: float  # bytes/s a rank sends (and receives) at once
    launch: float  # s per compute call on the device
    collective_latency: float = 0.0  # s per collective call, at the group size the profile is for
    host_issue: float = 0.0  # s of host time per launched op (0: the host is the compute stream, as on a CPU)
    sms: int = 0  # streaming multiprocessors (0: no wave quantisation)
    tiles: tuple[tuple[int, int], ...] = ((128, 256),)  # output tiles (m, n) the GEMM library picks from
    compute_slowdown: float = 0.0
    comm_slowdown: float = 0.0
    source: str = ""
    contention_source: str = ""


# What the datasheet GPU profiles below assume; every projection prints it.
GPU_ASSUMPTIONS = (
    "datasheets (dense bf16, no sparsity): H100/H800 SXM 989 TFLOP/s, 3.35 TB/s HBM3, 132 SMs; H200 4.8 TB/s HBM3e; "
    "NVLink 4 900 GB/s both ways on H100/H200 (450 GB/s each way), 400 GB/s on H800 (200 GB/s each way)",
    "sustained fractions (typical, assumed): GEMMs 75% of peak in full waves, memory 85% of HBM, NCCL 80% of a link",
    "wave quantisation: a GEMM runs in waves of 132 output tiles (one per SM, no split-K or stream-K) of 128x256, "
    "a pessimistic case for small GEMMs; the comparison with published figures also gives the optimistic case, the "
    "best of 128x256, 128x128, 64x256 and 64x128 tiles at the same per-SM rate",
    "latencies (assumed, nccl-tests-like small-message times on NVLink): 12 us per NCCL all-gather / reduce-scatter "
    "call on 8 GPUs, 8 us per send/receive pair; 2 us of device time per kernel; 6 us of host time to issue an op "
    "from PyTorch eager",
    "contention (assumed, not measured): compute 10% slower while NCCL kernels occupy SMs, transfers not slowed",
)
_GPU: dict[str, Any] = dict(
    flops=0.75 * 989e12,
    p2p_latency=8e-6,
    collective_latency=12e-6,
    launch=2e-6,
    host_issue=6e-6,
    sms=132,
    tiles=((128, 256),),
    compute_slowdown=0.10,
    contention_source="assumed: compute 10% slower beside NCCL kernels (they occupy SMs); not measured",
)
# The optimistic bound of the wave model: the library picks the tile that wastes the fewest SM slots, at no cost.
BEST_TILES = ((128, 256), (128, 128), (64, 256), (64, 128))
H100_SXM = Profile(
    "H100-SXM NVLink4",
    mem_bw=0.85 * 3.35e12,
    beta=0.8 * 450e9,
    source="datasheet: 989 TFLOP/s bf16, 3.35 TB/s, 132 SMs, NVLink 900 GB/s",
    **_GPU,
)
H200 = Profile(
    "H200 NVLink4",
    mem_bw=0.85 * 4.8e12,
    beta=0.8 * 450e9,
    source="datasheet: 989 TFLOP/s bf16, 4.8 TB/s, 132 SMs, NVLink 900 GB/s",
    **_GPU,
)
H800 = Profile(
    "H800-SXM NVLink",
    mem_bw=0.85 * 3.35e12,
    beta=0.8 * 200e9,
    source="datasheet: 989 TFLOP/s bf16, 3.35 TB/s, 132 SMs, NVLink 400 GB/s",
    **_GPU,
)
GPU_PROFILES = {"H100-SXM": H100_SXM, "H200": H200}


@dataclass(frozen=True)
class OpSpec:
    """One op at one shape: the GEMM of one peer chunk, the whole local GEMM, and one chunk's bytes on the wire.

    ``gemm_side``: whether the GEMM makes the blocks that are sent (``produce``: reduce-scatter, Ulysses QKV) or uses
    the blocks that arrive (``consume``: all-gather, Ulysses output). ``split``: the dimension of the whole GEMM that
    the communicated chunks cut, and that ``sliced`` cuts into slices: its rows (``m``), or its contraction (``k``:
    the data-parallel weight gather, whose chunks are row blocks of the weight).
    """

    name: str
    pattern: Pattern
    world: int
    chunk_gemm: tuple[int, int, int]
    full_gemm: tuple[int, int, int]
    chunk_bytes: int
    gemm_side: Literal["produce", "consume"]
    element_bytes: int = 4
    split: Literal["m", "k"] = "m"
    keeps_blocks: bool = False  # the consuming callback also copies each arrived block (a gathered weight kept)

    @property
    def flops(self) -> int:
        m, k, n = self.full_gemm
        return 2 * m * k * n

    @property
    def chunk_rows(self) -> int:
        """Rows of one rank's chunk (what ``sliced`` cuts)."""
        return self.chunk_gemm[0] if self.split == "m" else self.chunk_gemm[1]

    def slice_gemm(self, n_slices: int) -> tuple[int, int, int]:
        """The GEMM of one of ``n_slices`` slices of the whole GEMM, cut along ``split``."""
        m, k, n = self.full_gemm
        return (m // n_slices, k, n) if self.split == "m" else (m, k // n_slices, n)


@dataclass(frozen=True)
class Task:
    name: str
    stream: str
    seconds: float  # at full rate
    deps: tuple[int, ...] = ()
    kind: str = "gemm"  # gemm | memory | transfer | collective
    launched: bool = True  # whether the host issues it (a GEMM dropped from a comm-only schedule is not)


@dataclass(frozen=True)
class Span:
    name: str
    stream: str
    start: float
    end: float
    kind: str


@dataclass(frozen=True)
class Prediction:
    latency: float
    compute_only: float  # the whole local GEMM alone, issued and run
    comm_only: float  # the same schedule without its GEMMs
    spans: tuple[Span, ...]

    @property
    def exposed(self) -> float:
        """Seconds the op takes beyond its compute-only time."""
        return self.latency - self.compute_only


def simulate(tasks: list[Task], p: Profile) -> list[Span]:
    """Runs each stream's tasks in list order, each once the host has issued it (tasks are issued in list order) and
    its dependencies are done; rates as in the module doc."""
    issued = list(itertools.accumulate(p.host_issue if t.launched else 0.0 for t in tasks))
    queues = {
        COMPUTE: [i for i, t in enumerate(tasks) if t.stream == COMPUTE],
        COMM: [i for i, t in enumerate(tasks) if t.stream == COMM],
    }
    done: dict[int, float] = {}
    running: dict[str, tuple[int, float, float]] = {}  # stream -> (task, start, remaining full-rate seconds)
    now, spans = 0.0, []

    def ready(stream: str) -> bool:
        queue = queues[stream]
        return stream not in running and bool(queue) and all(d in done for d in tasks[queue[0]].deps)

    while len(done) < len(tasks):
        for stream, queue in queues.items():
            if ready(stream) and issued[queue[0]] <= now + 1e-15:
                i = queue.pop(0)
                running[stream] = (i, now, tasks[i].seconds)
        to_issue = [issued[queues[s][0]] for s in queues if ready(s)]  # ready, but the host has not issued them yet
        if not running:
            if not to_issue:
                raise ValueError("schedule deadlocks: a task waits on one that cannot start")
            now = min(to_issue)
            continue
        both = len(running) == 2
        rate = {
            COMPUTE: 1 / (1 + p.compute_slowdown) if both else 1.0,
            COMM: 1 / (1 + p.comm_slowdown) if both else 1.0,
        }
        step = min([rem / rate[s] for s, (_, _, rem) in running.items()] + [t - now for t in to_issue])
        now += step
        for stream, (i, start, rem) in list(running.items()):
            rem -= step * rate[stream]
            if rem <= 1e-15:
                done[i] = now
                spans.append(Span(tasks[i].name, stream, start, now, tasks[i].kind))
                del running[stream]
            else:
                running[stream] = (i, start, rem)
    return spans


def wave_efficiency(m: int, n: int, p: Profile) -> float:
    """Useful fraction of the SM time a GEMM with an (m, n) output occupies: its tiles fill ``ceil(tiles / sms)``
    waves of ``sms`` whole tiles, with the tile of ``p.tiles`` that wastes the least (1 with ``sms == 0``)."""
    if p.sms == 0:
        return 1.0
    return max(
        m * n / (math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / p.sms) * p.sms * tm * tn) for tm, tn in p.tiles
    )


def gemm_seconds(m: int, k: int, n: int, element_bytes: int, p: Profile) -> float:
    """Device time of one GEMM: launch plus the roofline, the compute side at the wave-quantised rate."""
    compute = 2 * m * k * n / (p.flops * wave_efficiency(m, n, p))
    return p.launch + max(compute, element_bytes * (m * k + k * n + m * n) / p.mem_bw)


def collective_seconds(pattern: Pattern, world: int, nbytes: float, p: Profile) -> float:
    """One collective call of ``nbytes`` per rank's chunk (the module doc's ring and all-to-all costs)."""
    if pattern == "all_to_all":
        return p.collective_latency + (world - 1) * nbytes / p.beta
    reduce = 3 * nbytes / p.mem_bw if pattern == "reduce_scatter" else 0.0
    return p.collective_latency + (world - 1) * max(nbytes / p.beta, reduce)


@dataclass
class TaskGraph:
    """The tasks of one schedule of ``op`` in issue order, and the kinds of task the schedules are written in.
    ``compute=False`` drops the GEMMs and what the GEMMs' callbacks do besides (comm-only): they stay in the graph
    at 0 s and unlaunched, so that the dependencies hold."""

    op: OpSpec
    p: Profile
    compute: bool = True
    tasks: list[Task] = field(default_factory=list)

    @property
    def exchanged(self) -> bool:
        """A 16-bit reduce-scatter: ``p2p._exchange_and_sum``, the partials all-to-all'd and summed in float32."""
        return self.op.pattern == "reduce_scatter" and self.op.element_bytes == 2

    @property
    def produces(self) -> bool:
        """Whether the GEMM makes the blocks that are sent (else it uses those that arrive)."""
        return self.op.gemm_side == "produce"

    def add(self, name: str, stream: str, seconds: float, deps=(), kind: str = "gemm", callback: bool = False) -> int:
        """Appends a task; returns its index (what later tasks depend on)."""
        dropped = not self.compute and (kind == "gemm" or callback)
        self.tasks.append(Task(name, stream, 0.0 if dropped else seconds, tuple(deps), kind, not dropped))
        return len(self.tasks) - 1

    def gemm(self, name: str, shape: tuple[int, int, int], deps=()) -> int:
        return self.add(name, COMPUTE, gemm_seconds(*shape, self.op.element_bytes, self.p), deps)

    def memory(self, name: str, nbytes: float, passes: int, deps=(), callback: bool = False) -> int:
        """An add or copy: ``passes`` reads and writes of ``nbytes``."""
        return self.add(name, COMPUTE, self.p.launch + passes * nbytes / self.p.mem_bw, deps, "memory", callback)

    def consume(self, name: str, shape: tuple[int, int, int], nbytes: float, deps=()) -> int:
        """The GEMM on arrived blocks of ``nbytes``, after copying them where the op keeps them (``keeps_blocks``)."""
        if self.op.keeps_blocks:
            deps = [self.memory(f"keep {name}", nbytes, 2, deps, callback=True)]
        return self.gemm(name, shape, deps)

    def transfer(self, name: str, nbytes: float, deps=()) -> int:
        """One P2P step of ``nbytes`` sent by this rank."""
        return self.add(name, COMM, self.p.p2p_latency + nbytes / self.p.beta, deps, "transfer")

    def collective(self, name: str, nbytes: float, deps=()) -> int:
        """One collective call of ``nbytes`` per rank's chunk; the 16-bit partials travel as an all-to-all."""
        pattern = "all_to_all" if self.exchanged else self.op.pattern
        return self.add(name, COMM, collective_seconds(pattern, self.op.world, nbytes, self.p), deps, "collective")


def schedule(
    op: OpSpec, method: str, p: Profile, slices: int | None = None, bidirectional: bool = False, compute: bool = True
) -> list[Task]:
    """The task graph ``p2p.py`` runs for ``op`` with ``method``, in its issue order; ``compute=False`` drops the
    GEMMs and what the GEMMs' callbacks do besides (comm-only)."""
    graph = TaskGraph(op, p, compute)
    if op.world == 1:
        graph.gemm("gemm", op.full_gemm)
    elif method == "collective":
        collective_schedule(graph)
    elif method == "sliced":
        sliced_schedule(graph, slices)
    elif op.pattern == "all_gather":
        flash_all_gather(graph, bidirectional)
    elif op.pattern == "reduce_scatter" and not graph.exchanged:
        flash_reduce_scatter(graph)
    else:  # an all-to-all, or the all-to-all of a 16-bit reduce-scatter
        flash_all_to_all(graph)
    return graph.tasks


def collective_schedule(g: TaskGraph) -> None:
    """One collective of the whole chunk, before (consume) or after (produce) the whole GEMM."""
    op, chunk = g.op, g.op.chunk_bytes
    if g.exchanged:
        g.memory("sum", chunk, op.world + 1, [g.collective("all_to_all", chunk, [g.gemm("gemm", op.full_gemm)])])
    elif g.produces:  # an all-to-all receives straight into the output: nothing to place
        g.collective(op.pattern, chunk, [g.gemm("gemm", op.full_gemm)])
    else:
        c = g.collective(op.pattern, chunk, [])
        g.consume("gemm", op.full_gemm, op.world * chunk, [c])


def sliced_schedule(g: TaskGraph, slices: int | None) -> None:
    """The whole GEMM cut into ``slices`` (default: the world size, at most a chunk's rows), one collective each; every
    collective is posted before the first slice is consumed or summed."""
    op, chunk, world = g.op, g.op.chunk_bytes, g.op.world
    n_slices = max(1, min(slices or world, op.chunk_rows))
    part = op.slice_gemm(n_slices)
    pending = []
    for i in range(n_slices):
        made = [g.gemm(f"gemm {i}", part)] if g.produces else []
        pending.append(g.collective(f"{op.pattern} {i}", chunk / n_slices, made))
    for i, c in enumerate(pending):
        if not g.produces:
            g.consume(f"gemm {i}", part, world * chunk / n_slices, [c])
        elif g.exchanged:
            g.memory(f"sum {i}", chunk / n_slices, world + 1, [c])
        elif op.pattern == "all_to_all":  # a row slice of the output is strided: receive, then copy
            g.memory(f"place {i}", world * chunk / n_slices, 2, [c])
    if op.pattern == "reduce_scatter" and not g.exchanged:
        g.memory("concatenate", chunk, 2, pending)


def flash_all_gather(g: TaskGraph, bidirectional: bool) -> None:
    """The ring all-gather: step t posts transfer t, computes the chunks that arrived at step t-1, waits transfer t.
    ``bidirectional``: half the chunks come from each side, two messages a step while both sides have one."""
    op, chunk = g.op, g.op.chunk_bytes
    from_left = op.world // 2 if bidirectional else op.world - 1
    from_right = op.world - 1 - from_left
    ready, prev_transfer, prev_compute = ["local"], None, None
    for t in range(1, from_left + 1):
        messages = 2 if t <= from_right else 1
        x = g.transfer(f"step {t}", messages * chunk, [d for d in (prev_transfer, prev_compute) if d is not None])
        for name in ready:
            prev_compute = g.consume(f"gemm {name}", op.chunk_gemm, chunk)
        ready, prev_transfer = [f"-{t}"] + ([f"+{t}"] if messages == 2 else []), x
    for name in ready:
        g.consume(f"gemm {name}", op.chunk_gemm, chunk, [prev_transfer])


def flash_reduce_scatter(g: TaskGraph) -> None:
    """The ring reduce-scatter: step t computes the partial of chunk me-1-t, adds what arrived, sends the sum on."""
    x = None
    for t in range(g.op.world):
        made = g.gemm(f"partial {t}", g.op.chunk_gemm)
        if x is not None:
            made = g.memory(f"accumulate {t}", g.op.chunk_bytes, 3, [x, made])
        if t < g.op.world - 1:
            x = g.transfer(f"step {t + 1}", g.op.chunk_bytes, [made])


def flash_all_to_all(g: TaskGraph) -> None:
    """Compute and post each remote block, then the local one, then consume what arrived (produce side: the blocks
    arrive in place; a 16-bit reduce-scatter sums them at the end, after placing the local block)."""
    op, chunk = g.op, g.op.chunk_bytes
    arrivals = []
    for step in range(1, op.world):
        made = [g.gemm(f"block +{step}", op.chunk_gemm)] if g.produces else []
        arrivals.append(g.transfer(f"to +{step}", chunk, made))
    if g.produces:
        place = g.memory("place local", chunk, 2, [g.gemm("block local", op.chunk_gemm)])
        if g.exchanged:
            g.memory("sum", chunk, op.world + 1, [place, *arrivals])
        return
    g.gemm("local", op.chunk_gemm)
    for step, x in enumerate(arrivals, 1):
        g.gemm(f"from -{step}", op.chunk_gemm, [x])


def finish(tasks: list[Task], p: Profile) -> float:
    """When the last task of ``tasks`` ends."""
    return max(s.end for s in simulate(tasks, p))


def predict(op: OpSpec, method: str, p: Profile, slices: int | None = None, bidirectional: bool = False) -> Prediction:
    """Latency of ``op`` with ``method``, its compute-only time (the whole local GEMM, issued and run) and its
    comm-only time."""
    spans = simulate(schedule(op, method, p, slices, bidirectional), p)
    return Prediction(
        latency=max(s.end for s in spans),
        compute_only=finish([Task("gemm", COMPUTE, gemm_seconds(*op.full_gemm, op.element_bytes, p))], p),
        comm_only=finish(schedule(op, method, p, slices, bidirectional, compute=False), p),
        spans=tuple(spans),
    )


def exposed_intervals(spans: tuple[Span, ...] | list[Span]) -> list[tuple[float, float]]:
    """Intervals where the communication stream is busy and the compute stream idle: communication nobody hides."""
    busy = sorted((s.start, s.end) for s in spans if s.stream == COMPUTE)
    out = []
    for s in (s for s in spans if s.stream == COMM):
        cuts = [(s.start, s.end)]
        for a, b in busy:
            cuts = [piece for lo, hi in cuts for piece in ((lo, min(hi, a)), (max(lo, b), hi)) if piece[1] > piece[0]]
        out += cuts
    return sorted(out)


# ---------------------------------------------------------------- shapes


def all_gather_matmul_spec(name: str, world: int, rows: int, k: int, n: int, element_bytes: int) -> OpSpec:
    """``all_gather(x) @ W`` over the rows: x (rows/P, k) on each rank, W (k, n) local (n: this rank's columns)."""
    chunk = (rows // world, k, n)
    return OpSpec(
        name, "all_gather", world, chunk, (rows, k, n), chunk[0] * k * element_bytes, "consume", element_bytes
    )


def matmul_reduce_scatter_spec(name: str, world: int, rows: int, k: int, n: int, element_bytes: int) -> OpSpec:
    """``reduce_scatter(h @ W)`` over the rows: h (rows, k) and W (k, n) local (k: this rank's share)."""
    chunk = (rows // world, k, n)
    nbytes = chunk[0] * n * element_bytes
    return OpSpec(name, "reduce_scatter", world, chunk, (rows, k, n), nbytes, "produce", element_bytes)


def matmul_all_to_all_spec(name: str, world: int, rows: int, k: int, n: int, element_bytes: int) -> OpSpec:
    """``all_to_all(x @ W)``: x (rows, k) local, W (k, n) in P column blocks; block j, (rows, n/P), goes to rank j."""
    chunk = (rows, k, n // world)
    nbytes = rows * n // world * element_bytes
    return OpSpec(name, "all_to_all", world, chunk, (rows, k, n), nbytes, "produce", element_bytes)


def all_to_all_matmul_spec(name: str, world: int, rows: int, k: int, n: int, element_bytes: int) -> OpSpec:
    """``all_to_all(o) @ W``: o's P blocks (rows, k/P) arrive from the peers, each times its row block of W (k/P, n)."""
    chunk = (rows, k // world, n)
    nbytes = rows * k // world * element_bytes
    return OpSpec(name, "all_to_all", world, chunk, (rows, k, n), nbytes, "consume", element_bytes)


def weight_gather_matmul_spec(name: str, world: int, rows: int, k: int, n: int, element_bytes: int) -> OpSpec:
    """``x @ all_gather(W)``: x (rows, k) local, W's row shards (k/P, n) gathered (ZeRO-3): the chunks cut the
    contraction, and each arrived block is also copied (the gathered weight is kept for the backward)."""
    chunk = (rows, k // world, n)
    nbytes = k // world * n * element_bytes
    return OpSpec(name, "all_gather", world, chunk, (rows, k, n), nbytes, "consume", element_bytes, "k", True)


def layer_ops(
    world: int,
    batch: int,
    seq: int,
    d: int,
    ffn: int,
    qkv_out: int | None = None,
    element_bytes: int = 4,
    gated: bool = False,
) -> list[OpSpec]:
    """The overlap ops of one transformer layer with (batch, seq, d) activations, parallel degree ``world``.

    mlp.fc1  all_gather_matmul     x (seq/P, batch, d) @ W1 (d, ffn/P)
    mlp.fc2  matmul_reduce_scatter h (seq, batch, ffn/P) @ W2 (ffn/P, d)    (``gated``: SwiGLU, fc1 makes the gate
                                   and the up projection, so h and W2 are ffn/2P wide)
    ulysses.qkv  matmul_all_to_all x (seq/P, batch, d) @ [W_qkv blocks (d, qkv_out/P)]
    ulysses.out  all_to_all_matmul o (seq, batch, d/P) @ [W_o blocks (d/P, d)]
    dp.fc1.gather  all_gather_matmul   x (tokens, d) @ all_gather(W1 row shard (d/P, ffn)) (data parallel, ZeRO-3:
                   the forward's weight gather; the chunks cut the contraction, and the gathered weight is kept
                   for the backward: each arrived block is also copied)
    dp.fc1.wgrad matmul_reduce_scatter  x^T (d, tokens) @ dy (tokens, ffn): W1's gradient over this rank's own
                 batch*seq tokens (data parallel), reduce-scattered over the d rows
    """
    tokens, rows = batch * seq, batch * seq // world
    fc2_in = ffn // 2 if gated else ffn
    e = element_bytes
    return [
        all_gather_matmul_spec("mlp.fc1 all_gather_matmul", world, tokens, d, ffn // world, e),
        matmul_reduce_scatter_spec("mlp.fc2 matmul_reduce_scatter", world, tokens, fc2_in // world, d, e),
        matmul_all_to_all_spec("ulysses.qkv matmul_all_to_all", world, rows, d, qkv_out or 3 * d, e),
        all_to_all_matmul_spec("ulysses.out all_to_all_matmul", world, rows, d, d, e),
        weight_gather_matmul_spec("dp.fc1.gather all_gather_matmul", world, tokens, d, ffn, e),
        matmul_reduce_scatter_spec("dp.fc1.wgrad matmul_reduce_scatter", world, d, tokens, ffn, e),
    ]


# ---------------------------------------------------------------- drawing


def draw_gantt(panels: list[tuple[str, Prediction]], path: str, columns: int = 3, title: str = "") -> None:
    """Compute and communication lanes of each prediction, side by side. Red: communication while compute idles (the
    tail); each title gives the latency and the exposed communication (latency - compute-only, which also counts
    compute slowed down by concurrent transfers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"gemm": "#4C72B0", "memory": "#8FB0D8", "transfer": "#55A868", "collective": "#C4A000"}
    n_rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(5 * columns, 1.5 * n_rows + 0.6), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (label, pr) in zip(axes.flat, panels):
        scale = 1e3
        for s in pr.spans:
            lane = 1 if s.stream == COMPUTE else 0
            ax.barh(
                lane,
                (s.end - s.start) * scale,
                left=s.start * scale,
                height=0.7,
                color=colors[s.kind],
                edgecolor="white",
                linewidth=0.5,
            )
        for a, b in exposed_intervals(pr.spans):
            ax.axvspan(a * scale, b * scale, color="red", alpha=0.25, lw=0)
        ax.set_yticks([0, 1], ["comm", "compute"])
        ax.set_xlim(0, pr.latency * scale * 1.02)
        ax.set_title(f"{label}\n{pr.latency * 1e3:.3g} ms, exposed {pr.exposed * 1e3:.3g} ms", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("ms", fontsize=7)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    handles.append(Patch(color="red", alpha=0.25, label="communication while compute idles"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
