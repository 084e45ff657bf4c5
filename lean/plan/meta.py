"""``lean plan`` at the published sizes: one GPU's iteration counted on PyTorch's meta device, where no weight is
allocated and no kernel runs, so FLUX.1-dev (11.9B transformer, T5-XXL beside it) is planned on a laptop.

The policy is built as for a run (every component, the adapter, the reference copy of a full fine-tune) on the meta
device, and the probe of :mod:`lean.plan.cost` runs there:

  memory  every tensor an op creates counts while its storage lives (:class:`MetaMemory`, a dispatch mode): the
          activations one tracked step keeps, the peak of its backward beyond them, the VAE decode's working set.
          Resident: every component's weights at ``model.dtype`` (the trainable ones as float32 masters in half
          precision), plus AdamW's two moments; the gradients count in the backward's transient and in the
          optimizer stage.
  time    each call's FLOPs (``lean.observe.flops.FlopCounter``) / (the GPU's datasheet peak x ``mfu``, an assumed
          utilisation).
          The rewards are not modelled (0 s).

The blocks of a denoiser repeat, and every count is affine in how many there are of each kind (each block adds its
own FLOPs, activations, weights and adapter), so the probe runs on the stacks cut to 2 and 3 blocks of each kind and
extrapolates to the whole depth (:func:`depth_extrapolated`): FLUX.1-dev's 19 + 38 blocks are counted through 3
probes of 4-5 blocks, a tenth of the dispatches; a test checks that it gives the whole count.

These figures go through the same cost models as a measured probe (``Schedule.predict`` via
:func:`lean.plan.cost.combinations`) for every layout, ``parallel.shard``, sequence-parallel degree and activation-
checkpointing setting, against ``gpu_mem_gb`` (times :data:`lean.observe.metrics.MEMORY_MARGIN`):

  sequence parallelism  P = 1, and every P dividing ``gpus`` that the family, the heads and the tokens allow. The
          model runs its own Ulysses code at one rank's shapes (``lean.parallel.overlap.p2p.SimulatedOverlap``: the
          tokens split, the all-to-all buffers allocated, every transfer a local copy), so a process's activations,
          working sets and FLOPs are counted, not scaled; its samples are those of one of ``gpus / P`` data-parallel
          ranks, and with ``parallel.split_decode`` it decodes 1/P of each micro-batch. Each transformer pass adds the
          all-to-alls' exposed time from the calibrated timeline model (``lean.parallel.overlap.sim`` on the H100
          profile, the configured ``parallel.overlap`` method): per block the fused QKV projection (matmul + all-to-all)
          and the output projection (all-to-all + matmul) at the pass's tokens, a backward the same again.
  fsdp    modelled from the replica's count (:func:`lean.plan.cost.shard_variant`): 1/``gpus`` of the sharded weights
          and state plus the gathered units (FSDP x SP shards over every GPU, ``lean.parallel.sharding``), and every
          pass's all-gather at the GPU's assumed bandwidth (:data:`GPUS`), hidden behind the pass's compute as FSDP's
          prefetch does (a pass takes max(compute, gather)). ``--gpu`` picks the GPU (H100 by default; LeanGRPO's RTX
          A6000 among them): its datasheet peak, memory, host link and all-gather bandwidth.

The rows are printed fastest first among those that fit, with each memory term; when the config's own row (its
schedule, layout, shard, ``parallel.sequence_parallel`` and checkpointing) does not fit, ``lean plan`` refuses it in
one config line naming the nearest row that does (fewest settings changed, then fastest).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lean.config import AUTO, ConfigError
from lean.configure import validate
from lean.models.build import build_policy
from lean.models.footprint import transformer_blocks
from lean.models.registry import family_spec
from lean.models.sequence_parallel import base_model, enable, sequence_problem
from lean.observe.flops import FlopCounter
from lean.observe.metrics import GPU_PEAK_TFLOPS, MEMORY_MARGIN, SavedBytes
from lean.observe.outputs import write_json
from lean.parallel.grad_sync import PER_BACKWARD, PER_UPDATE
from lean.parallel.overlap import sim
from lean.parallel.overlap.p2p import SimulatedOverlap
from lean.parallel.sharding import SHARDS, planned_shard
from lean.plan import count_cache
from lean.plan.cost import (
    PlanInput,
    combinations,
    print_published_size,
    probe_checkpointing,
    published_size,
    retain_columns,
    rollout_rows,
    shard_probes,
)
from lean.rewards.scorer import declared_reads_audio
from lean.run.iteration import local_batch
from lean.sampling.rollout import Sampler, policy_step
from lean.sampling.sde import sigma_schedule
from lean.sampling.transition import Transition
from lean.schedules import RETAIN
from lean.schedules.retain import OPTIONS_KEY as RETAIN_OPTIONS

# Host link per direction, GB/s, for offloaded graphs (what a pinned cudaMemcpyAsync reaches, not the signalling rate;
# docs/design/retain-offload.md). PCIe: x16 lanes at 16 / 32 GT/s, 128b/130b = 31.5 / 63 GB/s raw per direction (PCI-SIG
# PCIe 4.0 / 5.0 base specifications), ~80% of it assumed after packet and protocol overhead (not measured here).
# NVLink-C2C: 900 GB/s total bidirectional (NVIDIA, "NVIDIA Grace Hopper Superchip Architecture In-Depth", and the
# GH200 whitepaper), 450 each way, the datasheet figure.
HOST_LINK_GB_S = {"pcie4": 25.0, "pcie5": 50.0, "nvlink-c2c": 450.0}


@dataclass(frozen=True)
class GpuProfile:
    """A GPU ``lean plan --gpu`` plans for: its name as ``torch.cuda.get_device_name()`` reports it (the key of the
    datasheet peaks, ``lean.observe.metrics.GPU_PEAK_TFLOPS``), its memory, its host link (:data:`HOST_LINK_GB_S`)
    and the all-gather bus bandwidth assumed across a node of 8 (what FSDP's gathers run at)."""

    device: str
    memory_gb: float
    host_link: str
    allgather_gb_s: float


# All-gather bus bandwidths: nccl-tests on 8 NVLink-4 H100s reach ~360 GB/s (350 assumed), 8 NVLink-3 A100s ~230; the
# RTX A6000 has no NVSwitch (its NVLink bridge joins pairs), so 8 of them gather over PCIe Gen4: 20 GB/s assumed, not
# measured. The all-to-all timeline model stays the H100's (lean.parallel.overlap.sim).
GPUS = {
    "h100": GpuProfile("NVIDIA H100 80GB HBM3", 80.0, "pcie5", 350.0),
    "h200": GpuProfile("NVIDIA H200", 141.0, "pcie5", 350.0),  # the H100's arithmetic, more memory
    "a100-80gb": GpuProfile("NVIDIA A100-SXM4-80GB", 80.0, "pcie4", 230.0),
    "rtx-a6000": GpuProfile("NVIDIA RTX A6000", 48.0, "pcie4", 20.0),  # LeanGRPO's 8 x 48 GB (Sec. 5.1)
}
REFERENCE = "h100"  # what a plan assumes without --gpu
# Host memory assumed per node where train.retain.host_memory_budget_mb is not set: a DGX H100's 2 TiB for its 8 GPUs,
# x MEMORY_MARGIN, shared by the node's processes
HOST_RAM_PER_NODE_GB, GPUS_PER_NODE = 2048.0, 8
DEFAULT_MFU = 0.35  # an assumed share of that peak a DiT step reaches; the times scale with 1 / mfu


class MetaMemory(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive (``live``) and their high-water mark (``peak``);
    a storage counts once, however many views share it, until its last reference is gone."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self._sizes:
                    self._sizes[storage._cdata] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage._cdata)
        return out

    def mark(self) -> int:
        """Reset the high-water mark to what is alive now; returns it."""
        self.peak = self.live
        return self.live


class MetaScalars(TorchDispatchMode):
    """A value read back from a meta tensor (``.item()``, ``bool(t)``) reads as 1: the text encoders branch on their
    padding masks (``mask.all()``), which have no values on the meta device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fused_attention():
    """``scaled_dot_product_attention`` as a GPU runs it: the memory-efficient kernel, which keeps the output and one
    log-sum-exp per query row for the backward. The meta device would otherwise take the math path and count the
    [B, heads, L, L] attention probabilities of every block. A mask (Qwen-Image's padded text) is the kernel's
    additive bias, a broadcast view (as the kernel reads it on a GPU: no [B, heads, L, L] copy)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def efficient(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        bias = attn_mask
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
            shape = (*query.shape[:-2], query.shape[-2], key.shape[-2])
            bias = bias.expand(shape)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale
        )[0]

    torch.nn.functional.scaled_dot_product_attention = efficient
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def meta_input(cfg, gpus: int) -> PlanInput:
    """The run's policy on the meta device and the local batch of one of ``gpus`` processes (the config is checked
    for that many processes first: the batch must divide over them)."""
    validate(cfg, world_size=gpus)
    policy = build_policy(dataclasses.replace(cfg.model, pretrained=None), cfg.train.prompts, device="meta")
    shift = cfg.sample.shift if cfg.sample.shift is not None else 1.0  # timing and memory do not depend on it
    sigmas = sigma_schedule(cfg.sample.num_steps, shift, cfg.sample.sigma_grid).to("meta")
    trainable = [p for _, p in policy.trainable_parameters()]
    batch = local_batch(cfg, 0, 0, gpus)
    return at_degree(PlanInput(policy, trainable, cfg, sigmas, batch, reward=None, processes=gpus), gpus, 1)


def at_degree(inp: PlanInput, gpus: int, degree: int) -> PlanInput:
    """``inp`` for ``gpus`` processes in sequence-parallel groups of ``degree``: the samples of one of the
    ``gpus / degree`` data-parallel ranks, decoded in shares of ``degree`` under ``parallel.split_decode``."""
    cfg = dataclasses.replace(inp.cfg, parallel=dataclasses.replace(inp.cfg.parallel, sequence_parallel=degree))
    data = gpus // degree
    share = degree if cfg.parallel.split_decode else 1
    return dataclasses.replace(inp, cfg=cfg, batch=local_batch(cfg, 0, 0, data), world_size=data, decode_share=share)


def sequence_degrees(inp: PlanInput, gpus: int) -> dict[int, str | None]:
    """Every degree P dividing ``gpus``: None where sequence parallelism can run it, else why not (the config's
    rules for ``gpus`` processes, then the heads and tokens that must divide)."""
    degrees = {}
    for p in (d for d in range(2, gpus + 1) if gpus % d == 0):
        cfg = dataclasses.replace(inp.cfg, parallel=dataclasses.replace(inp.cfg.parallel, sequence_parallel=p))
        try:
            validate(cfg, world_size=gpus)
            degrees[p] = sequence_problem(inp.policy, p)
        except ConfigError as err:
            degrees[p] = f"{err.key}: {err.allowed}"
    return {1: None, **degrees}


def ulysses_exposed_s(inp: PlanInput, degree: int, rows: int) -> float:
    """Seconds one transformer pass of ``rows`` samples (both CFG halves counted) waits for its all-to-alls beyond
    their GEMMs, at ``degree``: per block the fused QKV and output projections of
    ``lean.parallel.overlap.sim.layer_ops`` (width = heads x head_dim, the pass's tokens) under ``parallel.overlap``, on
    the H100 profile."""
    if degree == 1:
        return 0.0
    config = base_model(inp.policy.denoisers[0]).config
    width = config.num_attention_heads * config.attention_head_dim
    runtime = inp.policy.runtime
    seq = runtime.image_seq_len + (inp.policy.text_max_length if runtime.splits_text else 0)
    ops = sim.layer_ops(degree, rows, seq, width, width, 3 * width, element_bytes=2)
    method = inp.cfg.parallel.overlap
    per_block = sum(sim.predict(op, method, sim.H100_SXM).exposed for op in ops if op.name.startswith("ulysses"))
    return per_block * transformer_blocks(family_spec(inp.cfg.model.family), config)


def with_all_to_alls(measured: dict, inp: PlanInput, degree: int) -> dict:
    """The probe's times with each pass's exposed all-to-all seconds (:func:`ulysses_exposed_s`; a backward pays
    them again)."""
    halves = 2 if inp.cfg.sample.cfg else 1
    full, one = (ulysses_exposed_s(inp, degree, halves * b) for b in (measured["batch"], 1))
    return {
        **measured,
        "t_forward": measured["t_forward"] + full,
        "t_forward_backward": measured["t_forward_backward"] + 2 * full,
        "t_forward_backward_one": measured["t_forward_backward_one"] + 2 * one,
        "all_to_all_exposed_s": full,
    }


def decode_counts(
    policy, latents: torch.Tensor, rows: int, memory: MetaMemory, known: dict[int, tuple[int, int]], audio: bool
) -> tuple[int, int]:
    """(peak bytes, FLOPs) of decoding the first ``rows`` of ``latents``, kept in ``known`` by ``rows``: counted once
    per row count. With ``audio`` (a reward reads the soundtrack) the soundtrack is decoded too, after the frames and
    beside them, as the rollout does (``IterationPipeline.decode_and_score``: LTX-2's audio VAE and vocoder)."""
    if rows not in known:
        with FlopCounter() as flops:
            start = memory.mark()
            images = policy.decode(latents[:rows])
            sound = policy.decode_audio(latents[:rows]) if audio else None
            known[rows] = (memory.peak - start, flops.get_total_flops())
        del images, sound
    return known[rows]


def meta_probe(inp: PlanInput, flops_per_s: float, decodes: dict[int, tuple[int, int]] | None = None) -> dict:
    """:func:`lean.plan.cost.probe`'s figures, counted on the meta device (see the module docstring). ``decodes`` keeps
    the decode's (peak bytes, FLOPs) by decoded rows across calls: it depends on neither the transformer's depth nor
    its checkpointing nor the sequence-parallel degree, and a long video's decode is the slowest count."""
    policy, cfg = inp.policy, inp.cfg
    batch = rollout_rows(cfg, len(inp.batch.prompts))
    with MetaScalars():  # the empty prompt too: CFG's unconditional branch encodes it on first use
        policy.encode_prompts([""])
        emb = policy.encode_prompts(inp.batch.prompts[:batch])
    gens = inp.batch.generators[:batch]
    x = policy.init_latents(gens)
    index = torch.zeros(batch, dtype=torch.long, device="meta")

    def step(rows: slice, grad: bool, backward: bool, memory: MetaMemory) -> tuple[int, int, int]:
        """(FLOPs, bytes kept after the forward, peak bytes of the backward beyond them)."""
        with FlopCounter() as flops:
            start = memory.mark()
            with torch.set_grad_enabled(grad):
                at = Transition(index=index[rows], rows=rows, sample=x[rows])
                out = policy_step(policy, Sampler(cfg.sample, inp.sigmas), at, emb.index(rows), generators=gens[rows])
            kept = memory.live - start
            before = memory.mark()
            if backward:
                out.log_prob.sum().backward()
            transient = memory.peak - before  # what the backward needs beyond the kept activations
        del out
        for p in inp.trainable:
            p.grad = None
        return flops.get_total_flops(), kept, transient

    saved = SavedBytes()  # of the kept bytes, those an offload moves (parameters and leaves stay)
    with fused_attention(), MetaMemory() as memory:
        f, _, _ = step(slice(0, batch), grad=False, backward=False, memory=memory)
        with saved.watching():
            fb, activation, transient = step(slice(0, batch), grad=True, backward=True, memory=memory)
        fb_one, activation_one, _ = step(slice(0, 1), grad=True, backward=True, memory=memory)
        rows = inp.decoded_rows(batch)  # a split decode: this process's share
        audio = declared_reads_audio(cfg.reward)
        decode, decoded_flops = decode_counts(policy, x, rows, memory, {} if decodes is None else decodes, audio)
    trainable = sum(p.numel() * p.element_size() for p in inp.trainable)
    # the weights and AdamW's two moments; the gradients are the backward's (in its transient) and the optimizer stage's
    resident = sum(p.numel() * p.element_size() for p in policy.parameters()) + 2 * trainable
    return {
        "batch": batch,
        "activation_mb": activation / 2**20,
        "activation_moved_mb": saved.take_split()[1] / 2**20,
        "activation_one_mb": activation_one / 2**20,
        "backward_transient_mb": transient / 2**20,
        "decode_mb": decode / 2**20,
        "t_forward": f / flops_per_s,
        "t_forward_backward": fb / flops_per_s,
        "t_forward_backward_one": fb_one / flops_per_s,
        "t_decode": decoded_flops / flops_per_s,
        "t_reward": 0.0,
        "param_mb": trainable / 2**20,
        "base_mb": resident / 2**20,
        # the gradient and as much again: its flat copy for the sync, or AdamW's foreach temporaries (a GPU's)
        "optimizer_stage_mb": 2 * trainable / 2**20,
    }


PROBE_DEPTH = 2  # blocks each run of like blocks keeps in the base probe (the first block of a stack may differ)


def block_runs(net: torch.nn.Module, block_lists: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """The runs of like blocks in ``net``'s stacks, as (stack, first index, length): consecutive blocks of one class
    and the same parameter shapes (SD3.5's dual-attention blocks, then its plain ones, then the last, which updates
    no text, are three runs of one stack; FLUX's double- and single-stream stacks are a run each)."""
    runs = []
    for name in block_lists:
        signatures = [
            (type(b).__name__, tuple((k, tuple(p.shape)) for k, p in b.named_parameters())) for b in getattr(net, name)
        ]
        for i, signature in enumerate(signatures):
            if i and signature == signatures[i - 1]:
                runs[-1] = (name, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((name, i, 1))
    return runs


@contextlib.contextmanager
def cut_runs(net: torch.nn.Module, runs: list[tuple[str, int, int]], kept: list[int]):
    """``net``'s stacks with each run cut to its first ``kept`` blocks; restored on exit."""
    whole = {name: getattr(net, name) for name, _, _ in runs}
    cut = {name: [] for name in whole}
    for (name, first, _), k in zip(runs, kept):
        cut[name] += whole[name][first : first + k]
    for name, blocks in cut.items():
        setattr(net, name, torch.nn.ModuleList(blocks))
    try:
        yield
    finally:
        for name, blocks in whole.items():
            setattr(net, name, blocks)


def depth_extrapolated(inp: PlanInput, measure: Callable[[PlanInput], dict]) -> dict:
    """``measure(inp)``'s figures at the denoisers' whole depth, from probes of shallower stacks. Each run of like
    blocks (:func:`block_runs`, n_r blocks) keeps b_r = min(n_r, :data:`PROBE_DEPTH`) in the base probe, and one
    more in its own slope probe; a figure is then ``base + sum_r slope_r (n_r - b_r)``. Exact where each figure is
    affine in the runs' lengths, as FLOPs, kept activations, weights and a backward's working set are for stacks of
    repeated blocks (a test compares it with the whole count)."""
    block_lists = family_spec(inp.cfg.model.family).block_lists
    nets = [base_model(d) for d in inp.policy.denoisers]
    runs = block_runs(nets[0], block_lists)
    base_kept = [min(n, PROBE_DEPTH) for _, _, n in runs]
    if all(n <= k + 1 for (_, _, n), k in zip(runs, base_kept)):  # nothing to save: count the whole depth
        return measure(inp)

    def at(kept: list[int]) -> dict:
        with contextlib.ExitStack() as stack:
            for net in nets:
                stack.enter_context(cut_runs(net, block_runs(net, block_lists), kept))
            return measure(inp)

    base = at(base_kept)
    whole = dict(base)
    for r, (_, _, n) in enumerate(runs):
        if n > base_kept[r]:
            deeper = at([k + (j == r) for j, k in enumerate(base_kept)])
            for key, value in base.items():
                if isinstance(value, float):
                    whole[key] += (deeper[key] - value) * (n - base_kept[r])
    return whole


def counted(inp: PlanInput, count: Callable[[PlanInput], dict]) -> dict[bool, dict]:
    """``count`` at the denoisers' whole depth with activation checkpointing off and on. A checkpointed backward
    recomputes one block at a time and frees it; on the meta device the recomputed storages are only seen freed at
    the end of the backward, so its transient is modelled instead: the plain backward's plus one block's share of the
    plain step's activations (small FLUX on a CPU: 27 MiB modelled, 30 measured)."""
    by_checkpointing = probe_checkpointing(inp, lambda inp: depth_extrapolated(inp, count))
    plain, checkpointed = by_checkpointing[False], by_checkpointing[True]
    blocks = transformer_blocks(family_spec(inp.cfg.model.family), base_model(inp.policy.denoisers[0]).config)
    checkpointed["backward_transient_mb"] = plain["backward_transient_mb"] + plain["activation_mb"] / blocks
    return by_checkpointing


def meta_plan(
    cfg,
    gpus: int = 8,
    gpu_mem_gb: float | None = None,
    mfu: float = DEFAULT_MFU,
    out: str | None = None,
    host_link: str | None = None,
    gpu: str = REFERENCE,
) -> dict:
    """Every schedule x layout x shard x sequence-parallel degree x checkpointing (and Retain's kept steps x offload)
    on ``gpus`` GPUs of ``gpu`` (:data:`GPUS`: its peak, all-gather bandwidth, memory and host link, the last two
    unless ``gpu_mem_gb`` / ``host_link`` say otherwise): predicted per-GPU peak memory (and its terms), host memory and
    time per iteration, whether it fits, fastest first; printed and returned (``out/plan.json``). Raises a ConfigError
    naming the nearest fitting row when the config's own row does not fit."""
    profile = GPUS[gpu]
    gpu_mem_gb, host_link = gpu_mem_gb or profile.memory_gb, host_link or profile.host_link
    peak = GPU_PEAK_TFLOPS[profile.device][cfg.model.torch_dtype] * 1e12
    inp = meta_input(cfg, gpus)
    budget_mb = gpu_mem_gb * 1024 * MEMORY_MARGIN
    host = host_side(cfg, gpus, host_link)
    degrees = sequence_degrees(inp, gpus)
    probes_by_degree = count_degrees(inp, gpus, [d for d, why in degrees.items() if why is None], peak * mfu)
    rows = tabulate(inp, gpus, probes_by_degree, {"budget_mb": budget_mb, **host}, profile.allgather_gb_s)
    fitting = [r for r in rows if r["fits"]]
    own_degree = cfg.parallel.sequence_parallel if cfg.parallel.sequence_parallel in probes_by_degree else 1
    report = {
        "published_size": published_size(cfg, inp.policy.denoisers[0]),
        "gpus": gpus,
        "gpu_mem_gb": gpu_mem_gb,
        "budget_mb": budget_mb,
        "assumed": {
            "gpu": profile.device,
            "peak_tflops": peak / 1e12,
            "mfu": mfu,
            "allgather_gb_s": profile.allgather_gb_s,
            "host_link": host_link,
            "host_link_gb_s": host["link_mb_s"] * 2**20 / 1e9,
            "host_budget_mb": host["host_budget_mb"],
            "all_to_all_profile": sim.H100_SXM.name,
            "overlap": cfg.parallel.overlap,
        },
        "probe": probes_by_degree[own_degree][cfg.model.gradient_checkpointing],
        "local_samples": len(at_degree(inp, gpus, own_degree).batch.prompts),
        "sequence_degrees": degrees,
        "combinations": rows,
        # the fastest; of equally fast ones (sharding hides its gathers), the smallest
        "fastest_fitting": min(fitting, key=lambda r: (r["time_iteration_s"], r["peak_memory_mb"]))
        if fitting
        else None,
    }
    report["own"] = own_row(cfg, rows, gpus)
    print_published_size(cfg, report["published_size"])
    print_meta_plan(cfg, report)
    if out:
        write_json(f"{out}/plan.json", report)
    refuse_what_does_not_fit(cfg, report)
    return report


# The config keys a count does not read (a config differing only there counts the same): what the plan's rows vary,
# when the gradients sync, which steps train, and how many samples and updates an iteration has (the count runs one
# step at the rollout micro-batch, which count_key keys instead)
NOT_COUNTED = {
    "train": (
        "schedule",
        RETAIN_OPTIONS.split(".")[1],
        "iterations",
        "prompts_per_iteration",
        "optimizer_steps_per_iteration",
        "num_inner_epochs",
        "on_policy",
    ),
    "parallel": ("layout", "grad_sync", "shard"),  # the count is of one replica; fsdp is modelled from it
    "sample": ("timestep_fraction",),
}
_COUNTS: dict[tuple, dict[int, dict[bool, dict]]] = {}  # count_key -> count_degrees' figures, in this process


def count_key(inp: PlanInput, gpus: int, degrees: list[int]) -> tuple:
    """What :func:`count_degrees` counts from: the config (less :data:`NOT_COUNTED`), each degree's rollout
    micro-batch, the GPUs and the degrees."""
    settings = inp.cfg.to_dict()
    for section, keys in NOT_COUNTED.items():
        settings[section] = {k: v for k, v in settings[section].items() if k not in keys}
    rows = [rollout_rows(inp.cfg, len(at_degree(inp, gpus, d).batch.prompts)) for d in degrees]
    return json.dumps(settings, sort_keys=True, default=repr), tuple(rows), gpus, tuple(degrees)


def count_degrees(inp: PlanInput, gpus: int, degrees: list[int], flops_per_s: float) -> dict[int, dict[bool, dict]]:
    """Per sequence-parallel degree, the probe's figures with checkpointing off and on (:func:`counted`), each pass's
    exposed all-to-all time added. The family's own Ulysses code is installed once and each degree swaps its
    :class:`SimulatedOverlap`; the decode is counted once per decoded micro-batch size. A count is pure and the
    slowest part of a plan: kept per :func:`count_key` in FLOPs (the times at 1 FLOP/s), so that a second plan of a
    config in one process (``lean plan`` after :func:`meta_plan`, another GPU's, a notebook's re-run) reuses it."""
    key = count_key(inp, gpus, degrees)
    if key not in _COUNTS:  # this process's, then the disk's (another process's: lean.plan.count_cache), then count
        _COUNTS[key] = count_cache.load(key)
        if _COUNTS[key] is None:
            _COUNTS[key] = _count_degrees(inp, gpus, degrees)
            count_cache.store(key, _COUNTS[key])
    out = {}
    for degree, by_checkpointing in _COUNTS[key].items():
        at = at_degree(inp, gpus, degree)
        out[degree] = {on: with_all_to_alls(at_rate(m, flops_per_s), at, degree) for on, m in by_checkpointing.items()}
    return out


def at_rate(counted_flops: dict, flops_per_s: float) -> dict:
    """A count's figures with its times (``t_*``, counted in FLOPs) at ``flops_per_s``."""
    return {k: v / flops_per_s if k.startswith("t_") else v for k, v in counted_flops.items()}


def _count_degrees(inp: PlanInput, gpus: int, degrees: list[int]) -> dict[int, dict[bool, dict]]:
    """:func:`count_degrees`, counted, the times in FLOPs."""
    decodes = {}
    count = lambda at: meta_probe(at, 1.0, decodes)  # noqa: E731
    sp, out = None, {}
    for degree in degrees:
        if degree > 1 and sp is None:
            sp = inp.policy.sequence_parallel = enable(inp.policy.networks(), inp.policy.runtime, SimulatedOverlap())
        if sp is not None:
            sp.ov = SimulatedOverlap(inp.cfg.parallel.overlap, size=degree)
        out[degree] = counted(at_degree(inp, gpus, degree), count)
    return out


def host_side(cfg, gpus: int, host_link: str) -> dict:
    """The offload's link (MiB/s per direction) and host budget per process (MiB): ``train.retain``'s where set,
    else :data:`HOST_LINK_GB_S` of ``host_link`` and :data:`HOST_RAM_PER_NODE_GB` x the margin over the node's GPUs."""
    r = cfg.train.retain
    link_gb_s = r.host_link_gb_s or HOST_LINK_GB_S[host_link]
    per_process = HOST_RAM_PER_NODE_GB * 1024 * MEMORY_MARGIN / min(gpus, GPUS_PER_NODE)
    return {"link_mb_s": link_gb_s * 1e9 / 2**20, "host_budget_mb": r.host_memory_budget_mb or per_process}


def tabulate(
    inp: PlanInput, gpus: int, probes_by_degree: dict[int, dict[bool, dict]], budgets: dict, allgather_gb_s: float
) -> list[dict]:
    """Every row (:func:`lean.plan.cost.combinations` of each degree, fsdp modelled from the counted replica, its
    gathers at ``allgather_gb_s``) with its degree and whether it fits ``budgets`` (``budget_mb`` per GPU;
    ``host_budget_mb`` per process for what it offloads, over ``link_mb_s``): the fitting rows first, fastest first,
    then the others, smallest first."""
    link = allgather_gb_s * 1e9 / 2**20
    rows = []
    for degree, by_checkpointing in probes_by_degree.items():
        at = at_degree(inp, gpus, degree)
        probes = shard_probes(at, by_checkpointing, link, overlap=True, probed=SHARDS.default)
        rows += [
            {**r, "sequence_parallel": degree, "fits": r["peak_memory_mb"] <= budgets["budget_mb"] and r["host_fits"]}
            for r in combinations(at, probes, **budgets)
        ]
    return sorted(rows, key=lambda r: (not r["fits"], r["time_iteration_s"] if r["fits"] else r["peak_memory_mb"]))


SETTINGS = {  # a row's settings, as the config keys that choose them
    "schedule": "train.schedule",
    "layout": "parallel.layout",
    "shard": "parallel.shard",
    "sequence_parallel": "parallel.sequence_parallel",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "grad_sync": "parallel.grad_sync",
    "retain_steps": "train.retain.steps",
    "offload": "train.retain.offload",
}


def own_row(cfg, rows: list[dict], gpus: int) -> dict:
    """The config's own settings (``auto`` matches any value) and its rows: ``settings``, ``fits`` (some row of
    them fits), ``nearest`` (the fitting row with the fewest settings changed, then the fastest; None if none
    fits)."""
    settings = {
        "schedule": cfg.train.schedule,
        "layout": cfg.parallel.layout,
        "shard": planned_shard(cfg.parallel.shard, gpus),
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "grad_sync": cfg.parallel.grad_sync,
        "retain_steps": cfg.train.retain.steps,
        "offload": cfg.train.retain.offload,
    }
    changed = lambda r: sum(v != AUTO and r[k] != v for k, v in settings.items())  # noqa: E731
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: (changed(r), r["time_iteration_s"]))
    mine = [r for r in rows if changed(r) == 0]
    return {
        "settings": settings,
        "fits": any(r["fits"] for r in mine),
        "peak_memory_mb": min((r["peak_memory_mb"] for r in mine), default=None),
        "nearest": fitting[0] if fitting else None,
    }


def refuse_what_does_not_fit(cfg, report: dict) -> None:
    """A ConfigError when no row of the config's own settings fits, naming the nearest that does."""
    own = report["own"]
    if own["fits"]:
        return
    budget = report["budget_mb"] / 1024
    predicted = (
        f"is predicted at {own['peak_memory_mb'] / 1024:.1f} GiB per GPU"
        if own["peak_memory_mb"] is not None
        else "cannot run here"
    )
    near = own["nearest"]
    if near is None:
        hint = "no row fits: fewer samples per GPU (train.rollout_batch_size), frames or resolution"
    else:
        changes = [
            f"{key}={_value(near[k])}" for k, key in SETTINGS.items() if own["settings"][k] not in (AUTO, near[k])
        ]
        hint = f"the nearest row that fits ({near['peak_memory_mb'] / 1024:.1f} GiB): --set " + " --set ".join(changes)
    mine = ", ".join(f"{SETTINGS[k]}={_value(v)}" for k, v in own["settings"].items())
    raise ConfigError(
        "--gpu-mem-gb",
        report["gpu_mem_gb"],
        f"this run ({mine}) {predicted}, over the {budget:.0f} GiB budget; {hint}",
    )


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


SYNC_COLUMN = {PER_UPDATE: "update", PER_BACKWARD: "backward"}  # parallel.grad_sync as the table prints it


def print_meta_plan(cfg, r: dict) -> None:
    p, a = r["probe"], r["assumed"]
    print(
        f"lean plan: {cfg.model.family}/{cfg.model.size} {cfg.model.frame_size}"
        + (f" x {cfg.model.num_frames} frames" if family_spec(cfg.model.family).video else "")
        + f" {cfg.model.dtype}, counted on the meta device for {r['gpus']} GPUs of {r['gpu_mem_gb']:g} GB "
        f"({r['local_samples']} samples per data-parallel rank, rollout micro-batch {p['batch']}). Times: FLOPs / "
        f"({a['gpu']}'s {a['peak_tflops']:.0f} TFLOP/s x MFU {a['mfu']:g}), rewards not included; fsdp: the "
        "transformer sharded "
        f"over all {r['gpus']} GPUs, all-gathers at {a['allgather_gb_s']:g} GB/s behind the compute; SP: Ulysses "
        f"over P GPUs, its all-to-alls' exposed time from the timeline model ({a['all_to_all_profile']}, "
        f"{a['overlap']})"
    )
    skipped = {d: why for d, why in r["sequence_degrees"].items() if why is not None}
    if skipped:
        print("not tabulated: " + "; ".join(f"SP={d} ({why})" for d, why in skipped.items()))
    print(
        "Memory terms per GPU (GiB): resident = weights + trainable state (after sharding); step = activations one "
        "tracked step keeps at the micro-batch; bwd = a backward's working set beyond them; decode = the VAE's; "
        "held = what the schedule holds through the rollout for its update (Retain's kept graphs on the device, "
        "Reweight's gradient buffers: Q + 1 whole ones per rank under a sharded full fine-tune). sync = "
        "parallel.grad_sync: once per update, or after every backward (FSDP2's reduce-scatter, the paper's Native). "
        f"Retain: m = trained steps per sample whose graphs are kept (the others recomputed), offload host = kept "
        f"graphs in pinned host memory ({a['host_link']} at {a['host_link_gb_s']:g} GB/s each way, "
        f"{a['host_budget_mb'] / 1024:.0f} GiB per process): host = held there, moved = each way per iteration, "
        "exposed = copy time not hidden behind compute (in time/iter)"
    )
    print(
        f"{'schedule':10} {'layout':6} {'shard':5} {'SP':>2} {'ckpt':>4} {'sync':8} {'m':>3} {'offload':7} "
        f"{'resident':>8} {'step':>6} {'bwd':>6} {'decode':>6} {'held':>6} {'peak':>6} {'host':>6} {'moved':>6} "
        f"{'exposed':>7} {'time/iter s':>11}  fits"
    )
    for row in r["combinations"]:
        m, offload = retain_columns(row)
        print(
            f"{row['schedule']:10} {row['layout']:6} {row['shard']:5} {row['sequence_parallel']:2d} "
            f"{'on' if row['gradient_checkpointing'] else 'off':>4} {SYNC_COLUMN[row['grad_sync']]:8} {m:>3} "
            f"{offload:7} {row['base_mb'] / 1024:8.1f} {row['activation_mb'] / 1024:6.2f} "
            f"{row['backward_transient_mb'] / 1024:6.2f} {row['decode_mb'] / 1024:6.2f} {row['held_mb'] / 1024:6.1f} "
            f"{row['peak_memory_mb'] / 1024:6.1f} {row['host_mb'] / 1024:6.1f} "
            f"{row['d2h_mb'] / 1024:6.1f} {row['exposed_transfer_s']:7.2f} {row['time_iteration_s']:11.1f}  "
            f"{'yes' if row['fits'] else 'no'}"
        )
    best = r["fastest_fitting"]
    if best is None:
        print(f"nothing fits in {r['budget_mb'] / 1024:.0f} GiB per GPU")
    else:
        print(
            f"fastest that fits in {r['budget_mb'] / 1024:.0f} GiB: {best['schedule']}, layout {best['layout']}, "
            f"shard {best['shard']}, sequence parallel {best['sequence_parallel']}, checkpointing "
            f"{'on' if best['gradient_checkpointing'] else 'off'}, parallel.grad_sync={best['grad_sync']}"
            + (
                f", train.retain.steps={best['retain_steps']}, offload={best['offload']}"
                if best["schedule"] == RETAIN
                else ""
            )
        )
