"""The timeline model (``sim.py``) on datasheet GPU profiles: projected latency and exposed communication of every op,
block and method at Llama-like shapes, and the check of the model against published H100/H800 figures.

Shapes (bf16, parallel degree P = 8 unless stated):

    per op      ``sim.layer_ops`` of a Llama-70B-like layer (batch 1, ``tokens`` sequence): the MLP's fc1
                (all-gather + GEMM) and fc2 (GEMM + reduce-scatter), Ulysses' QKV and output projections, and the
                data-parallel rows: fc1's weight gather (forward) and its gradient reduce-scatter (backward)
    per block   the sums of those rows: ``mlp`` (fc1 + fc2), ``ulysses`` (qkv + out), ``dp`` (gather + wgrad)
    layer       one tensor+sequence parallel transformer layer's forward (:func:`layer_forward`): the attention's
                QKV (all-gather + GEMM) and output projection (GEMM + reduce-scatter), fc1 and fc2, back to back,
                with the attention core and the element-wise ops between them (the same for every method)

Assumptions beyond the profiles' (stated in ``ASSUMPTIONS``, which the report prints with the comparison):

    - the attention core (causal FlashAttention forward, 2 s^2 h_local d_head FLOPs) runs at 350 TFLOP/s on an H100
      (FlashAttention-2's forward there, as the FlashAttention-3 paper reports it): ``ATTENTION_RATE`` of the profile's
      GEMM rate
    - element-wise ops (2 RMSNorms and 2 residual adds on the sequence shard, RoPE on Q and K, SwiGLU on the fc1
      output) are memory-bound: bytes / mem_bw, one launch each
    - ops run back to back on one compute and one communication stream; the host issues every op in program order
      and runs ahead of the GPU (no synchronisation)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lean.parallel.overlap import sim
from lean.parallel.overlap.p2p import METHODS

ATTENTION_RATE = 350e12 / sim.H100_SXM.flops  # the attention core's FLOP/s, as a fraction of the GEMM rate


@dataclass(frozen=True)
class ModelDims:
    """A transformer's layer sizes: model width, fc1's output width (SwiGLU: gate and up together) and heads."""

    name: str
    d: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def qkv_out(self) -> int:
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def attention_width(self) -> int:
        return self.q_heads * self.head_dim


# Llama 3 8B and 70B (Llama 2 70B has the 70B sizes): SwiGLU, grouped-query attention with 8 key/value heads of 128.
LLAMA3_8B = ModelDims("Llama3-8B", 4096, 2 * 14336, 32, 8, 128)
LLAMA3_70B = ModelDims("Llama3-70B", 8192, 2 * 28672, 64, 8, 128)
PROJECTION_SHAPES = (
    f"{LLAMA3_70B.name}-like layer (d {LLAMA3_70B.d}, SwiGLU fc1 2x{LLAMA3_70B.ffn // 2}, "
    f"{LLAMA3_70B.q_heads} q / {LLAMA3_70B.kv_heads} kv heads x {LLAMA3_70B.head_dim}), bf16, degree 8, batch 1"
)
# Wan2.1 (its transformer configs: width 1536 / 5120, FFN 8960 / 13824, 12 / 40 heads of 128) at 81 frames of 480x832
# (21 x 30 x 52 = 32760 video tokens) and 81 frames of 720x1280 (21 x 45 x 80 = 75600): sequence parallelism's shapes
WAN_1_3B = ModelDims("Wan2.1-1.3B", 1536, 8960, 12, 12, 128)
WAN_14B = ModelDims("Wan2.1-14B", 5120, 13824, 40, 40, 128)
VIDEO_ULYSSES = ((WAN_1_3B, 2, 32760), (WAN_14B, 2, 32760), (WAN_14B, 4, 32760), (WAN_14B, 8, 75600))
BLOCKS = {
    "mlp": ("mlp.fc1", "mlp.fc2"),
    "ulysses": ("ulysses.qkv", "ulysses.out"),
    "dp": ("dp.fc1.gather", "dp.fc1.wgrad"),
}


def projection_ops(tokens: int, world: int = 8, model: ModelDims = LLAMA3_70B) -> list[sim.OpSpec]:
    """``sim.layer_ops`` of one ``model`` layer (SwiGLU, bf16) with ``tokens`` tokens (batch 1) at degree ``world``."""
    return sim.layer_ops(world, 1, tokens, model.d, model.ffn, model.qkv_out, element_bytes=2, gated=True)


def prediction_row(op: sim.OpSpec, method: str, p: sim.Profile) -> dict:
    """The model's figures for one op and method, in ms."""
    pr = sim.predict(op, method, p)
    return {
        "latency_ms": pr.latency * 1e3,
        "compute_ms": pr.compute_only * 1e3,
        "comm_ms": pr.comm_only * 1e3,
        "exposed_ms": pr.exposed * 1e3,
    }


def projection(
    profiles: dict[str, sim.Profile],
    world: int = 8,
    token_counts: tuple[int, ...] = (4096, 16384),
    model: ModelDims = LLAMA3_70B,
    methods: tuple[str, ...] = METHODS,
) -> list[dict]:
    """Predicted latency and exposed communication of every op of ``sim.layer_ops`` and method, per profile."""
    rows = []
    for tokens in token_counts:
        for op in projection_ops(tokens, world, model):
            for name, profile in profiles.items():
                for method in methods:
                    rows.append(
                        {"op": op.name, "tokens": tokens, "world": world, "profile": name, "method": method}
                        | prediction_row(op, method, profile)
                    )
    return rows


def video_ulysses(profiles: dict[str, sim.Profile], cases=VIDEO_ULYSSES) -> list[dict]:
    """Sequence parallelism's Ulysses block (fused QKV + output projection) per layer at Wan's video shapes: the
    ``block_totals`` rows of each (model, degree, tokens), with the model's name."""
    out = []
    for model, world, tokens in cases:
        rows = projection(profiles, world=world, token_counts=(tokens,), model=model)
        blocks = [b for b in block_totals(rows) if b["block"].startswith("ulysses")]
        out += [{"model": model.name, "world": world} | b for b in blocks]
    return out


def block_totals(rows: list[dict]) -> list[dict]:
    """Per block of ``BLOCKS`` (whole MLP, Ulysses attention, data parallel), tokens, profile and method: the sums
    of its ops' latency, compute-only and exposed ms (blocks with an op missing from ``rows`` are left out)."""
    out = []
    keys = dict.fromkeys((r["tokens"], r["profile"], r["method"]) for r in rows)
    by = {(r["op"].split()[0], r["tokens"], r["profile"], r["method"]): r for r in rows}
    for block, ops in BLOCKS.items():
        for tokens, profile, method in keys:
            parts = [by.get((op, tokens, profile, method)) for op in ops]
            if any(p is None for p in parts):
                continue
            out.append(
                {"block": f"{block} ({' + '.join(ops)})", "tokens": tokens, "profile": profile, "method": method}
                | {k: sum(p[k] for p in parts) for k in ("latency_ms", "compute_ms", "exposed_ms")}
            )
    return out


# ---------------------------------------------------------------- one layer's forward


def tp_layer_ops(world: int, tokens: int, model: ModelDims, element_bytes: int = 2) -> list[sim.OpSpec]:
    """The four overlapped ops of a tensor+sequence parallel layer's forward, in order (Megatron's column/row split,
    the sequence sharded between them)."""
    e = element_bytes
    return [
        sim.all_gather_matmul_spec("attn.qkv all_gather_matmul", world, tokens, model.d, model.qkv_out // world, e),
        sim.matmul_reduce_scatter_spec(
            "attn.out matmul_reduce_scatter", world, tokens, model.attention_width // world, model.d, e
        ),
        sim.all_gather_matmul_spec("mlp.fc1 all_gather_matmul", world, tokens, model.d, model.ffn // world, e),
        sim.matmul_reduce_scatter_spec(
            "mlp.fc2 matmul_reduce_scatter", world, tokens, model.ffn // world // 2, model.d, e
        ),
    ]


def local_tasks(
    world: int, tokens: int, model: ModelDims, p: sim.Profile, element_bytes: int = 2
) -> list[list[sim.Task]]:
    """The compute between the overlapped ops, as blocks placed before each of them: RMSNorm before the QKV gather,
    RoPE and the attention core before the output projection, residual add and RMSNorm before fc1, SwiGLU before
    fc2, and the last residual add after it (``ASSUMPTIONS``)."""
    e, shard = element_bytes, tokens // world * model.d * element_bytes

    def memory(name: str, nbytes: float) -> sim.Task:
        return sim.Task(name, sim.COMPUTE, p.launch + nbytes / p.mem_bw, kind="memory")

    heads = model.q_heads // world
    core_flops = 2 * tokens * tokens * heads * model.head_dim  # causal: half of 4 s^2 h d
    rope_bytes = 2 * tokens * (model.q_heads + model.kv_heads) // world * model.head_dim * e
    return [
        [memory("rmsnorm", 2 * shard)],
        [
            memory("rope", rope_bytes),
            sim.Task("attention core", sim.COMPUTE, p.launch + core_flops / (ATTENTION_RATE * p.flops)),
        ],
        [memory("residual add", 3 * shard), memory("rmsnorm", 2 * shard)],
        [memory("swiglu", 1.5 * tokens * model.ffn // world * e)],
        [memory("residual add", 3 * shard)],
    ]


def in_sequence(blocks: list[list[sim.Task]]) -> list[sim.Task]:
    """One task list running ``blocks`` back to back: a block's tasks without dependencies wait for the previous
    block's last task on each stream (the data dependency between layers' ops); dependencies are renumbered."""
    out: list[sim.Task] = []
    for block in blocks:
        offset = len(out)
        last = tuple({t.stream: i for i, t in enumerate(out)}.values())  # the last task of each stream so far
        for t in block:
            deps = tuple(d + offset for d in t.deps) or last
            out.append(sim.Task(t.name, t.stream, t.seconds, deps, t.kind, t.launched))
    return out


def layer_forward(world: int, tokens: int, model: ModelDims, method: str, p: sim.Profile) -> float:
    """Seconds of one layer's forward with every overlapped op run by ``method`` (module doc, ``ASSUMPTIONS``)."""
    ops = tp_layer_ops(world, tokens, model)
    local = local_tasks(world, tokens, model, p)
    blocks: list[list[sim.Task]] = []
    for before, op in zip(local, ops):
        blocks += [before, sim.schedule(op, method, p)]
    return sim.finish(in_sequence(blocks + local[len(ops) :]), p)


# ---------------------------------------------------------------- the model against published figures

ASSUMPTIONS = (
    *sim.GPU_ASSUMPTIONS,
    f"attention core at 350 TFLOP/s on H100 (FlashAttention-2's forward, as the FlashAttention-3 paper reports it): "
    f"{ATTENTION_RATE:.2f} of the GEMM rate",
    "element-wise ops (RMSNorm, residual add, RoPE, SwiGLU) memory-bound, one launch each; ops back to back, the "
    "host issuing in program order ahead of the GPU",
)
FLUX_README = (
    "bytedance/flux README, Performance table, H800 rows (8 GPUs, TP 8, fp16, M=4096 K=12288 N=49152; "
    "github.com/bytedance/flux, 2024)"
)
FLUX_PAPER = (
    "Chang et al., FLUX: Fast Software-based Communication Overlap on GPUs through Kernel Fusion (arXiv:2406.06858): "
    "AllGather+GEMM on 8xH100 at M=4096, 0.867 -> 0.673 ms, as issue #15 quotes the paper's table (not read here)"
)
ASYNC_TP = (
    "PyTorch dev-discuss, [Distributed w/ TorchTitan] Introducing Async Tensor Parallelism in PyTorch "
    "(discuss.pytorch.org/t/209487, 2024): up to ~29% forward speedup on Llama3 8B, up to ~20% on Llama3 70B, "
    "TP 8, H100"
)
# Flux README, H800 rows: (GEMM alone, NCCL alone, torch total = NCCL then GEMM, Flux fused total), ms
FLUX_H800 = {"AG+GEMM": (0.846, 0.583, 1.429, 0.957), "GEMM+RS": (0.818, 0.590, 1.408, 0.932)}
FLUX_H100_AG_GEMM = (0.867, 0.673)  # (not overlapped, Flux), ms, as quoted in issue #15
ASYNC_TP_FORWARD = {LLAMA3_8B: 1.29, LLAMA3_70B: 1.20}  # forward speedup, async TP over TP ("up to")
ASYNC_TP_TOKENS = 8192  # assumed: one 8192-token sequence per TP group (TorchTitan's Llama3 sequence length)


def published_comparison() -> list[dict]:
    """The model next to every published figure it can be checked against (``FLUX_README``, ``FLUX_PAPER``,
    ``ASYNC_TP``): one row per figure with the source, the shape or configuration assumed, the published value, the
    projection with the profile's 128x256 tile (``projected``, ``error = projected / published - 1``) and with the
    best of ``sim.BEST_TILES`` (``projected_best_tiles``, ``error_best_tiles``): the wave model's pessimistic and
    optimistic cases. Overlapped figures (Flux's fused kernel, async TP's micro-pipelined ops) are compared with
    ``flash``, non-overlapped ones with ``collective``."""
    rows: list[dict] = []
    flux_ops = {
        "AG+GEMM": sim.all_gather_matmul_spec("flux AG+GEMM", 8, 4096, 12288, 49152 // 8, 2),
        "GEMM+RS": sim.matmul_reduce_scatter_spec("flux GEMM+RS", 8, 4096, 49152 // 8, 12288, 2),
    }
    quantities = ("GEMM alone", "NCCL alone", "NCCL and GEMM in turn (collective)", "overlapped: Flux (model: flash)")
    fc1 = tp_layer_ops(8, 4096, LLAMA3_70B)[2]

    def figures(p: sim.Profile) -> list[float]:
        """Every projected figure with profile ``p`` standing for the H100/H800 of the sources (ms or x)."""
        out = []
        for op in flux_ops.values():
            coll, flash = sim.predict(op, "collective", p), sim.predict(op, "flash", p)
            out += [1e3 * t for t in (coll.compute_only, coll.comm_only, coll.latency, flash.latency)]
        h100 = replace(sim.H100_SXM, tiles=p.tiles)
        out += [1e3 * sim.predict(fc1, m, h100).latency for m in ("collective", "flash")]
        for model in ASYNC_TP_FORWARD:
            times = {m: layer_forward(8, ASYNC_TP_TOKENS, model, m, h100) for m in ("collective", "flash")}
            out.append(times["collective"] / times["flash"])
        return out

    described = []  # (source, case, assumed, quantity, published, unit), in the order of ``figures``
    for case, op in flux_ops.items():
        assumed = f"H800 profile, GEMM {op.full_gemm} per rank, fp16"
        described += [(FLUX_README, f"{case} H800", assumed, q, v, "ms") for q, v in zip(quantities, FLUX_H800[case])]
    assumed = f"assumed shape: {LLAMA3_70B.name} fc1, GEMM {fc1.full_gemm} per rank (SwiGLU gate+up), bf16, H100-SXM"
    for quantity, published in zip(("not overlapped (collective)", quantities[-1]), FLUX_H100_AG_GEMM):
        described.append((FLUX_PAPER, "AG+GEMM H100", assumed, quantity, published, "ms"))
    for model, published in ASYNC_TP_FORWARD.items():
        assumed = f"{ASYNC_TP_TOKENS} tokens per TP group, one layer's forward (module doc), H100-SXM"
        described.append((ASYNC_TP, f"{model.name} forward", assumed, "speedup over TP (model: flash)", published, "x"))
    fixed, best = figures(sim.H800), figures(replace(sim.H800, tiles=sim.BEST_TILES))
    for (source, case, assumed, quantity, published, unit), value, value_best in zip(described, fixed, best):
        rows.append(
            {
                "source": source,
                "case": case,
                "assumed": assumed,
                "quantity": quantity,
                "unit": unit,
                "published": published,
                "projected": value,
                "error": value / published - 1,
                "projected_best_tiles": value_best,
                "error_best_tiles": value_best / published - 1,
            }
        )
    return rows
