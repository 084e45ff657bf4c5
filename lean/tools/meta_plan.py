"""``lean plan`` at the published sizes: one GPU's iteration counted on PyTorch's meta device, where no weight is
allocated and no kernel runs, so FLUX.1-dev (11.9B transformer, T5-XXL beside it) is planned on a laptop.

The policy is built as for a run (every component, the adapter, the reference copy of a full fine-tune) on the meta
device, and the probe of :mod:`lean.plan` runs there:

  memory  every tensor an op creates counts while its storage lives (:class:`MetaMemory`, a dispatch mode): the
          activations one tracked step keeps, the peak of its backward beyond them, the VAE decode's working set.
          Resident: every component's weights at ``model.dtype`` (the trainable ones as float32 masters in half
          precision), plus the trainable parameters' gradients and AdamW's two moments.
  time    each call's FLOPs (``FlopCounterMode``) / (the GPU's datasheet peak x ``mfu``, an assumed utilisation).
          The rewards are not modelled (0 s).

The blocks of a denoiser repeat, and every count is affine in how many there are of each kind (each block adds its
own FLOPs, activations, weights and adapter), so the probe runs on the stacks cut to 2 and 3 blocks of each kind and
extrapolates to the whole depth (:func:`depth_extrapolated`): FLUX.1-dev's 19 + 38 blocks are counted through 3
probes of 4-5 blocks, a tenth of the dispatches; a test checks that it gives the whole count.

These figures go through the same cost models as a measured probe (``Schedule.predict`` via
:func:`lean.plan.combinations`) for every layout, ``parallel.shard`` and activation-checkpointing setting, with the
local batch of one of ``gpus`` processes, against ``gpu_mem_gb`` (times :data:`lean.metrics.MEMORY_MARGIN`). The
count is of a whole replica; ``parallel.shard=fsdp`` is modelled from it (:func:`lean.plan.shard_variant`): 1/``gpus``
of the sharded weights and state plus the gathered units, and every pass's all-gather at
:data:`ALLGATHER_GB_S`, hidden behind the pass's compute as FSDP's prefetch does (a pass takes max(compute, gather)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from lean.configure import validate
from lean.iteration import local_batch
from lean.metrics import GPU_PEAK_TFLOPS, MEMORY_MARGIN
from lean.models import build_policy, family_spec, transformer_blocks
from lean.models.sequence_parallel import base_model
from lean.outputs import write_json
from lean.plan import (
    PlanInput,
    combinations,
    print_published_size,
    probe_checkpointing,
    published_size,
    shard_probes,
)
from lean.rollout import policy_step
from lean.sde import sigma_schedule
from lean.sharding import SHARDS

REFERENCE_GPU = "NVIDIA H100 80GB HBM3"  # whose datasheet peak the times assume (H200: the same compute)
ALLGATHER_GB_S = 350.0  # assumed all-gather bus bandwidth of 8 NVLink-4 GPUs (nccl-tests on 8x H100: ~360 GB/s)
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
    return PlanInput(policy, trainable, cfg, sigmas, batch, reward=None, world_size=gpus)


def meta_probe(inp: PlanInput, flops_per_s: float) -> dict:
    """:func:`lean.plan.probe`'s figures, counted on the meta device (see the module docstring)."""
    policy, cfg = inp.policy, inp.cfg
    batch = min(len(inp.batch.prompts), cfg.train.rollout_batch_size)
    with MetaScalars():  # the empty prompt too: CFG's unconditional branch encodes it on first use
        policy.encode_prompts([""])
        emb = policy.encode_prompts(inp.batch.prompts[:batch])
    gens = inp.batch.generators[:batch]
    x = policy.init_latents(gens)
    index = torch.zeros(batch, dtype=torch.long, device="meta")

    def step(rows: slice, grad: bool, backward: bool, memory: MetaMemory) -> tuple[int, int, int]:
        """(FLOPs, bytes kept after the forward, peak bytes of the backward beyond them)."""
        with FlopCounterMode(display=False) as flops:
            start = memory.mark()
            with torch.set_grad_enabled(grad):
                out = policy_step(
                    policy, x[rows], index[rows], emb.index(rows), cfg.sample, inp.sigmas, generators=gens[rows]
                )
            kept = memory.live - start
            before = memory.mark()
            if backward:
                out[1].sum().backward()
            transient = memory.peak - before  # what the backward needs beyond the kept activations
        del out
        for p in inp.trainable:
            p.grad = None
        return flops.get_total_flops(), kept, transient

    with fused_attention(), MetaMemory() as memory:
        f, _, _ = step(slice(0, batch), grad=False, backward=False, memory=memory)
        fb, activation, transient = step(slice(0, batch), grad=True, backward=True, memory=memory)
        fb_one, activation_one, _ = step(slice(0, 1), grad=True, backward=True, memory=memory)
        with FlopCounterMode(display=False) as decode_flops:
            start = memory.mark()
            images = policy.decode(x)
            decode = memory.peak - start
        del images
    trainable = sum(p.numel() * p.element_size() for p in inp.trainable)
    resident = sum(p.numel() * p.element_size() for p in policy.parameters()) + 3 * trainable  # grads, 2 moments
    return {
        "batch": batch,
        "activation_mb": activation / 2**20,
        "activation_one_mb": activation_one / 2**20,
        "backward_transient_mb": transient / 2**20,
        "decode_mb": decode / 2**20,
        "t_forward": f / flops_per_s,
        "t_forward_backward": fb / flops_per_s,
        "t_forward_backward_one": fb_one / flops_per_s,
        "t_decode": decode_flops.get_total_flops() / flops_per_s,
        "t_reward": 0.0,
        "param_mb": trainable / 2**20,
        "base_mb": resident / 2**20,
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


def meta_plan(cfg, gpus: int = 8, gpu_mem_gb: float = 80.0, mfu: float = DEFAULT_MFU, out: str | None = None) -> dict:
    """Every schedule x layout x checkpointing on ``gpus`` GPUs of ``gpu_mem_gb``: predicted per-GPU peak memory and
    time per iteration, whether it fits, and the fastest that does; printed and returned (``out/plan.json``)."""
    peak = GPU_PEAK_TFLOPS[REFERENCE_GPU][cfg.model.torch_dtype] * 1e12
    inp = meta_input(cfg, gpus)
    count = lambda inp: meta_probe(inp, peak * mfu)  # noqa: E731
    by_checkpointing = probe_checkpointing(inp, lambda inp: depth_extrapolated(inp, count))
    # A checkpointed backward recomputes one block at a time and frees it; on the meta device the recomputed storages
    # are only seen freed at the end of the backward, so its transient is modelled instead: the plain backward's plus
    # one block's share of the plain step's activations (small FLUX on a CPU: 27 MiB modelled, 30 measured).
    plain, checkpointed = by_checkpointing[False], by_checkpointing[True]
    blocks = transformer_blocks(inp.policy.transformer.config)
    checkpointed["backward_transient_mb"] = plain["backward_transient_mb"] + plain["activation_mb"] / blocks
    budget_mb = gpu_mem_gb * 1024 * MEMORY_MARGIN
    link = ALLGATHER_GB_S * 1e9 / 2**20
    probes = shard_probes(inp, by_checkpointing, link, overlap=True, probed=SHARDS.default)  # a whole replica counted
    rows = [{**r, "fits": r["peak_memory_mb"] <= budget_mb} for r in combinations(inp, probes)]
    fitting = [r for r in rows if r["fits"]]
    report = {
        "published_size": published_size(cfg, inp.policy.transformer),
        "gpus": gpus,
        "gpu_mem_gb": gpu_mem_gb,
        "budget_mb": budget_mb,
        "assumed": {"gpu": REFERENCE_GPU, "peak_tflops": peak / 1e12, "mfu": mfu, "allgather_gb_s": ALLGATHER_GB_S},
        "probe": by_checkpointing[cfg.model.gradient_checkpointing],
        "local_samples": len(inp.batch.prompts),
        "combinations": rows,
        # the fastest; of equally fast ones (sharding hides its gathers), the smallest
        "fastest_fitting": min(fitting, key=lambda r: (r["time_iteration_s"], r["peak_memory_mb"]))
        if fitting
        else None,
    }
    print_published_size(cfg, report["published_size"])
    print_meta_plan(cfg, report)
    if out:
        write_json(f"{out}/plan.json", report)
    return report


def print_meta_plan(cfg, r: dict) -> None:
    p, a = r["probe"], r["assumed"]
    print(
        f"lean plan: {cfg.model.family}/{cfg.model.size} {cfg.model.resolution} px {cfg.model.dtype}, counted on the "
        f"meta device for {r['gpus']} GPUs of {r['gpu_mem_gb']:g} GB ({r['local_samples']} samples per GPU, rollout "
        f"micro-batch {p['batch']}): a whole replica is {p['base_mb'] / 1024:.1f} GiB (every weight; the trainable "
        f"{p['param_mb'] / 1024:.2f} GiB also as gradients and two AdamW moments); one tracked step keeps "
        f"{p['activation_mb'] / 1024:.2f} GiB at the micro-batch. Times: FLOPs / ({a['peak_tflops']:.0f} TFLOP/s "
        f"x MFU {a['mfu']:g}), rewards not included; fsdp: the transformer sharded over the {r['gpus']} GPUs, "
        f"all-gathers at {a['allgather_gb_s']:g} GB/s behind the compute"
    )
    print(
        f"{'schedule':10} {'layout':7} {'shard':5} {'checkpointing':>13} {'peak GiB':>9} {'time/iteration s':>17}  fits"
    )
    for row in r["combinations"]:
        print(
            f"{row['schedule']:10} {row['layout']:7} {row['shard']:5} "
            f"{'on' if row['gradient_checkpointing'] else 'off':>13} {row['peak_memory_mb'] / 1024:9.1f} "
            f"{row['time_iteration_s']:17.1f}  {'yes' if row['fits'] else 'no'}"
        )
    best = r["fastest_fitting"]
    if best is None:
        print(f"nothing fits in {r['budget_mb'] / 1024:.0f} GiB per GPU")
    else:
        print(
            f"fastest that fits in {r['budget_mb'] / 1024:.0f} GiB: {best['schedule']}, layout {best['layout']}, "
            f"shard {best['shard']}, checkpointing {'on' if best['gradient_checkpointing'] else 'off'}"
        )
