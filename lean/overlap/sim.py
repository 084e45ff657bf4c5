"""Event-driven timeline model of the three overlap methods: predicted latency and exposed communication.

One rank is simulated with one compute stream and one communication stream. Every rank runs the same schedule shifted
by its rank, so a peer's half of each transfer happens at the same time as this rank's (stragglers are not modelled).
The schedules mirror ``p2p.py`` call by call, including the host-side ordering: a flash ring step is posted only after
the previous step completed and the GEMM queued before it was issued (NCCL's stream also waits for that GEMM).

Costs (``Profile``):
    GEMM (m, k, n)        launch + max(2 m k n / flops, bytes(m k + k n + m n) / mem_bw)         roofline
    add / copy of B bytes launch + (3 or 2) B / mem_bw
    one transfer step     alpha + B / beta          B: bytes this rank sends in the step (its links are shared)
    ring collective       (P-1) transfer steps of a chunk (+ the reduction adds for reduce-scatter)
    all-to-all            alpha + (P-1) B / beta
A 16-bit reduce-scatter (``element_bytes == 2``) is what ``p2p.py`` runs for it: an all-to-all of the partials and a
float32-accumulated reduction of the P blocks, (P + 1) B / mem_bw for a chunk of B bytes (collective, sliced: per
slice as it arrives; flash: at the end, after placing the local block).
While both streams are busy, compute runs ``1/(1+compute_slowdown)`` as fast (transfers take SMs, or on a CPU the
transport thread takes a core) and transfers ``1/(1+comm_slowdown)`` as fast; the simulation integrates these rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pattern = Literal["all_gather", "reduce_scatter", "all_to_all"]
COMPUTE, COMM = "compute", "comm"


@dataclass(frozen=True)
class Profile:
    """One rank's hardware, as the model sees it (all rates sustained, not peak)."""

    name: str
    flops: float  # GEMM FLOP/s
    mem_bw: float  # bytes/s
    alpha: float  # s per transfer step
    beta: float  # bytes/s a rank sends (and receives) at once
    launch: float  # s per compute call
    compute_slowdown: float = 0.0
    comm_slowdown: float = 0.0
    source: str = ""


# Public datasheet figures (dense bf16, no sparsity; NVLink 4: 900 GB/s both directions = 450 GB/s each way), derated
# by typical sustained fractions: cuBLAS bf16 GEMM ~75% of peak, STREAM-like ~85% of HBM, NCCL P2P ~80% of a link.
# The 10% compute slowdown under concurrent NCCL kernels (they occupy SMs) is an assumption, not a measurement.
H100_SXM = Profile(
    "H100-SXM NVLink4",
    flops=0.75 * 989e12,
    mem_bw=0.85 * 3.35e12,
    alpha=10e-6,
    beta=0.8 * 450e9,
    launch=5e-6,
    compute_slowdown=0.10,
    source="datasheet: 989 TFLOP/s bf16, 3.35 TB/s, NVLink 900 GB/s",
)
H200 = Profile(
    "H200 NVLink4",
    flops=0.75 * 989e12,
    mem_bw=0.85 * 4.8e12,
    alpha=10e-6,
    beta=0.8 * 450e9,
    launch=5e-6,
    compute_slowdown=0.10,
    source="datasheet: 989 TFLOP/s bf16, 4.8 TB/s, NVLink 900 GB/s",
)
GPU_PROFILES = {"H100-SXM": H100_SXM, "H200": H200}


@dataclass(frozen=True)
class OpSpec:
    """One op at one shape: the GEMM of one peer chunk, the whole local GEMM, and one chunk's bytes on the wire.

    ``gemm_side``: whether the GEMM makes the blocks that are sent (``produce``: reduce-scatter, Ulysses QKV) or uses
    the blocks that arrive (``consume``: all-gather, Ulysses output). ``sliced`` cuts the rows (m) of the whole GEMM.
    """

    name: str
    pattern: Pattern
    world: int
    chunk_gemm: tuple[int, int, int]
    full_gemm: tuple[int, int, int]
    chunk_bytes: int
    gemm_side: Literal["produce", "consume"]
    element_bytes: int = 4

    @property
    def flops(self) -> int:
        m, k, n = self.full_gemm
        return 2 * m * k * n


@dataclass(frozen=True)
class Task:
    name: str
    stream: str
    seconds: float  # at full rate
    deps: tuple[int, ...] = ()
    kind: str = "gemm"  # gemm | memory | transfer | collective


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
    compute_only: float
    comm_only: float
    spans: tuple[Span, ...]

    @property
    def exposed(self) -> float:
        return self.latency - self.compute_only

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.exposed / self.comm_only if self.comm_only > 0 else float("nan")


def simulate(tasks: list[Task], p: Profile) -> list[Span]:
    """Runs each stream's tasks in list order, each once its dependencies are done; rates as in the module doc."""
    queues = {
        COMPUTE: [i for i, t in enumerate(tasks) if t.stream == COMPUTE],
        COMM: [i for i, t in enumerate(tasks) if t.stream == COMM],
    }
    done: dict[int, float] = {}
    running: dict[str, tuple[int, float, float]] = {}  # stream -> (task, start, remaining full-rate seconds)
    now, spans = 0.0, []
    while len(done) < len(tasks):
        for stream, queue in queues.items():
            if stream not in running and queue and all(d in done for d in tasks[queue[0]].deps):
                i = queue.pop(0)
                running[stream] = (i, now, tasks[i].seconds)
        if not running:
            raise ValueError("schedule deadlocks: a task waits on one that cannot start")
        both = len(running) == 2
        rate = {
            COMPUTE: 1 / (1 + p.compute_slowdown) if both else 1.0,
            COMM: 1 / (1 + p.comm_slowdown) if both else 1.0,
        }
        step = min(rem / rate[s] for s, (_, _, rem) in running.items())
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


def gemm_seconds(m: int, k: int, n: int, element_bytes: int, p: Profile) -> float:
    return p.launch + max(2 * m * k * n / p.flops, element_bytes * (m * k + k * n + m * n) / p.mem_bw)


def schedule(
    op: OpSpec, method: str, p: Profile, slices: int | None = None, bidirectional: bool = False, compute: bool = True
) -> list[Task]:
    """The task graph ``p2p.py`` runs for ``op`` with ``method``; ``compute=False`` drops the GEMMs (comm-only)."""
    world, chunk, e = op.world, op.chunk_bytes, op.element_bytes
    tasks: list[Task] = []

    def add(name: str, stream: str, seconds: float, deps=(), kind: str = "gemm") -> int:
        tasks.append(Task(name, stream, seconds if (compute or kind != "gemm") else 0.0, tuple(deps), kind))
        return len(tasks) - 1

    def gemm(name: str, m: int, k: int, n: int, deps=()) -> int:
        return add(name, COMPUTE, gemm_seconds(m, k, n, e, p), deps)

    def memory(name: str, nbytes: float, passes: int, deps=()) -> int:
        return add(name, COMPUTE, p.launch + passes * nbytes / p.mem_bw, deps, "memory")

    def transfer(name: str, nbytes: float, deps=(), kind: str = "transfer") -> int:
        return add(name, COMM, p.alpha + nbytes / p.beta, deps, kind)

    exchanged = op.pattern == "reduce_scatter" and e == 2  # p2p._exchange_and_sum: partials summed in float32

    def collective(name: str, nbytes: float, deps=()) -> int:
        if op.pattern == "all_to_all" or exchanged:
            return add(name, COMM, p.alpha + (world - 1) * nbytes / p.beta, deps, "collective")
        reduce = 3 * nbytes / p.mem_bw if op.pattern == "reduce_scatter" else 0.0
        return add(name, COMM, (world - 1) * (p.alpha + nbytes / p.beta + reduce), deps, "collective")

    M, K, N = op.full_gemm
    produce_side = op.gemm_side == "produce"
    if world == 1:
        gemm("gemm", M, K, N)
        return tasks
    if method == "collective":
        if exchanged:
            memory("sum", chunk, world + 1, [collective("all_to_all", chunk, [gemm("gemm", M, K, N)])])
        elif produce_side:  # an all-to-all receives straight into the output: nothing to place
            collective(op.pattern, chunk, [gemm("gemm", M, K, N)])
        else:
            c = collective(op.pattern, chunk, [])
            gemm("gemm", M, K, N, [c])
        return tasks
    if method == "sliced":
        n_slices = max(1, min(slices or world, op.chunk_gemm[0]))
        pending = []
        for i in range(n_slices):
            g = gemm(f"gemm {i}", M // n_slices, K, N) if produce_side else None
            pending.append(collective(f"{op.pattern} {i}", chunk / n_slices, [g] if g is not None else []))
        for i, c in enumerate(pending):
            if not produce_side:
                gemm(f"gemm {i}", M // n_slices, K, N, [c])
            elif exchanged:
                memory(f"sum {i}", chunk / n_slices, world + 1, [c])
            elif op.pattern == "all_to_all":  # a row slice of the output is strided: receive, then copy
                memory(f"place {i}", world * chunk / n_slices, 2, [c])
        if op.pattern == "reduce_scatter" and not exchanged:
            memory("concatenate", chunk, 2, pending)
        return tasks
    m, k, n = op.chunk_gemm
    if op.pattern == "all_gather":  # step t: post transfer t, compute chunk t-1, wait transfer t
        from_left = world // 2 if bidirectional else world - 1
        from_right = world - 1 - from_left
        ready, prev_transfer, prev_compute = ["local"], None, None
        for t in range(1, from_left + 1):
            messages = 2 if t <= from_right else 1
            x = transfer(f"step {t}", messages * chunk, [d for d in (prev_transfer, prev_compute) if d is not None])
            for name in ready:
                prev_compute = gemm(f"gemm {name}", m, k, n)
            ready, prev_transfer = [f"-{t}"] + ([f"+{t}"] if messages == 2 else []), x
        for name in ready:
            gemm(f"gemm {name}", m, k, n, [prev_transfer])
    elif op.pattern == "reduce_scatter" and not exchanged:  # step t: partial of chunk me-1-t, add what arrived, send
        x = None
        for t in range(world):
            g = gemm(f"partial {t}", m, k, n)
            if x is not None:
                g = memory(f"accumulate {t}", chunk, 3, [x, g])
            if t < world - 1:
                x = transfer(f"step {t + 1}", chunk, [g])
    else:  # all-to-all: compute and post each remote block, then the local one, then consume what arrived
        arrivals = []
        for step in range(1, world):
            g = gemm(f"block +{step}", m, k, n) if produce_side else None
            arrivals.append(transfer(f"to +{step}", chunk, [g] if g is not None else []))
        if produce_side:
            place = memory("place local", chunk, 2, [gemm("block local", m, k, n)])
            if exchanged:
                memory("sum", chunk, world + 1, [place, *arrivals])
        else:
            gemm("local", m, k, n)
        for step, x in enumerate(arrivals, 1):
            if not produce_side:  # produce side: the blocks arrive in place
                gemm(f"from -{step}", m, k, n, [x])
    return tasks


def predict(op: OpSpec, method: str, p: Profile, slices: int | None = None, bidirectional: bool = False) -> Prediction:
    """Latency of ``op`` with ``method``, its compute-only time (the whole local GEMM) and its comm-only time."""
    spans = simulate(schedule(op, method, p, slices, bidirectional), p)
    comm = simulate(schedule(op, method, p, slices, bidirectional, compute=False), p)
    return Prediction(
        latency=max(s.end for s in spans),
        compute_only=gemm_seconds(*op.full_gemm, op.element_bytes, p),
        comm_only=max(s.end for s in comm),
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


def layer_ops(
    world: int,
    batch: int,
    seq: int,
    d: int,
    ffn: int,
    qkv_out: int | None = None,
    element_bytes: int = 4,
    prefix: str = "",
) -> list[OpSpec]:
    """The overlap ops of one transformer layer with (batch, seq, d) activations, parallel degree ``world``.

    mlp.fc1  all_gather_matmul     x (seq/P, batch, d) @ W1 (d, ffn/P)
    mlp.fc2  matmul_reduce_scatter h (seq, batch, ffn/P) @ W2 (ffn/P, d)
    ulysses.qkv  matmul_all_to_all x (seq/P, batch, d) @ [W_qkv blocks (d, qkv_out/P)]
    ulysses.out  all_to_all_matmul o (seq, batch, d/P) @ [W_o blocks (d/P, d)]
    dp.fc1.wgrad matmul_reduce_scatter  x^T (d, tokens) @ dy (tokens, ffn): W1's gradient over this rank's own
                 batch*seq tokens (data parallel), reduce-scattered over the d rows
    """
    tokens, rows = batch * seq, batch * seq // world
    qkv_out = qkv_out or 3 * d
    e = element_bytes

    def spec(name, pattern, chunk, full, nbytes, side):
        return OpSpec(prefix + name, pattern, world, chunk, full, nbytes, side, e)

    return [
        spec(
            "mlp.fc1 all_gather_matmul",
            "all_gather",
            (rows, d, ffn // world),
            (tokens, d, ffn // world),
            rows * d * e,
            "consume",
        ),
        spec(
            "mlp.fc2 matmul_reduce_scatter",
            "reduce_scatter",
            (rows, ffn // world, d),
            (tokens, ffn // world, d),
            rows * d * e,
            "produce",
        ),
        spec(
            "ulysses.qkv matmul_all_to_all",
            "all_to_all",
            (rows, d, qkv_out // world),
            (rows, d, qkv_out),
            rows * qkv_out // world * e,
            "produce",
        ),
        spec(
            "ulysses.out all_to_all_matmul",
            "all_to_all",
            (rows, d // world, d),
            (rows, d, d),
            rows * d // world * e,
            "consume",
        ),
        spec(
            "dp.fc1.wgrad matmul_reduce_scatter",
            "reduce_scatter",
            (d // world, tokens, ffn),
            (d, tokens, ffn),
            d // world * ffn * e,
            "produce",
        ),
    ]


# Llama-70B-like layer: SwiGLU fc1 = gate + up (2 x 28672); GQA attention with 64 query and 8 key/value heads of 128
LLAMA70B = {"d": 8192, "ffn": 2 * 28672, "qkv_out": (64 + 2 * 8) * 128}


def projection(
    profiles: dict[str, Profile], world: int = 8, token_counts=(4096, 16384), methods=("collective", "sliced", "flash")
) -> list[dict]:
    """Predicted latency / exposed communication of every method for Llama-70B-like layers at parallel degree 8."""
    rows = []
    for tokens in token_counts:
        for op in layer_ops(world, 1, tokens, element_bytes=2, **LLAMA70B):
            for pname, prof in profiles.items():
                for method in methods:
                    pr = predict(op, method, prof)
                    rows.append(
                        {
                            "op": op.name,
                            "tokens": tokens,
                            "world": world,
                            "profile": pname,
                            "method": method,
                            "latency_ms": pr.latency * 1e3,
                            "compute_ms": pr.compute_only * 1e3,
                            "comm_ms": pr.comm_only * 1e3,
                            "exposed_ms": pr.exposed * 1e3,
                            "hidden_fraction": pr.hidden_fraction,
                        }
                    )
    return rows


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
