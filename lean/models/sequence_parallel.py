"""Sequence parallelism for the policies (``parallel.sequence_parallel: P``): the transformer's tokens split over the P
ranks of a sequence-parallel group, Ulysses attention inside diffusers' blocks (arXiv:2309.14509).

Every rank of the group holds the same trajectories (data parallelism is over groups); inside the transformer rank r
computes tokens r*S/P .. (r+1)*S/P through every block and all-gathers the output, so the velocity, the SDE step and
the loss are the same on every rank. Attention swaps tokens for heads and back with all-to-alls; the families hook
that in as diffusers attention processors and module hooks (``FamilyRuntime.shard_sequence``, each family's
``sequence_parallel.py``), no model code is forked.

The all-to-alls are fused with the projections around them (``lean.parallel.overlap.ops``), each by
``parallel.overlap``:

    q, k, v of my heads, all tokens  = matmul_all_to_all(x_r, [W_q W_k W_v] column block of each rank)
                                       + s all_gather(x_r A^T) B[my heads]^T                             (LoRA)
    y_r = o @ W_o^T, my tokens       = all_to_all_matmul(o of my heads, W_o^T row block of each rank)
                                       + s reduce_scatter(o A_o[:, my heads]^T) B_o^T                    (LoRA)

so a LoRA adapter stays inside the overlapped projections: its low-rank activations (r columns) travel beside the
blocks, one small all-gather or reduce-scatter, and the frozen base weight needs no gradient. The adapter's own
modules (or, where only a slice of a factor applies, :func:`linear_slice`) compute every LoRA product, so per-sample
gradient capture (``lean.schedules.per_sample``, Reweight and Retain's backward beside the scoring) sees them.

Gradients follow ``lean.parallel.overlap.sequence``'s shares: each rank's weight gradients are its tokens' and heads'
part, and ``World.reduce_gradients_`` sums them over the group (and averages over data-parallel groups).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lean.config import ConfigError
from lean.config.registry import catalog
from lean.parallel.overlap.autograd import AllToAllMatmul, MatmulAllToAll
from lean.parallel.overlap.p2p import Overlap
from lean.parallel.overlap.sequence import all_gather_shares, reduce_scatter_tokens

if TYPE_CHECKING:
    from lean.config import RunConfig


@dataclass
class SequenceParallel:
    """What the installed processors and hooks read at every call: the group and the method (``ov``, which the
    benchmark switches between rounds), and the hooks' handles."""

    ov: Overlap
    handles: list = field(default_factory=list)
    text_tokens: int | None = None  # a joint-attention family's whole text length, noted by its hook each forward

    @property
    def size(self) -> int:
        return self.ov.world


@dataclass(frozen=True)
class LinearParts:
    """A ``nn.Linear`` (or a peft LoRA ``Linear``) as its terms: ``x W^T + b + sum_a s_a B_a(A_a(x))``."""

    weight: Tensor  # (out, in)
    bias: Tensor | None
    lora: list[tuple[nn.Linear, nn.Linear, float]]  # (A: in -> r, B: r -> out, scaling) of each active adapter


def linear_parts(module: nn.Module) -> LinearParts:
    """The terms ``module`` computes now (adapters disabled or merged: none); refuses what it cannot fuse."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return LinearParts(module.weight, module.bias, [])
    lora = []
    if not module.disable_adapters and not module.merged:
        for name in module.active_adapters:
            if name not in module.lora_A:
                continue
            if module.use_dora.get(name) or not isinstance(module.lora_dropout[name], nn.Identity):
                raise ValueError(f"sequence parallelism fuses plain LoRA only (adapter {name!r}: DoRA or dropout)")
            lora.append((module.lora_A[name], module.lora_B[name], module.scaling[name]))
    return LinearParts(base.weight, base.bias, lora)


def linear_slice(module: nn.Linear, x: Tensor, rows: slice | None = None, cols: slice | None = None) -> Tensor:
    """``x @ W[rows, cols]^T`` of a bias-free ``module`` (a LoRA factor), announced to its per-sample recorder
    (``lean.schedules.per_sample.PerSampleGrads``, attached as ``module.per_sample`` while it captures) as the part
    ``[rows, cols]`` of the module's weight that this product uses."""
    w = module.weight[rows or slice(None)][:, cols or slice(None)]
    y = F.linear(x, w)
    recorder = getattr(module, "per_sample", None)
    if recorder is not None:
        recorder.record(module, x, y, rows=rows, cols=cols)
    return y


def heads_slice(rank: int, local_heads: int, head_dim: int) -> slice:
    """Features of rank ``rank``'s heads in a (heads x head_dim) feature axis."""
    return slice(rank * local_heads * head_dim, (rank + 1) * local_heads * head_dim)


def fused_projections(x: Tensor, projections: Sequence[nn.Module], heads: int, ov: Overlap) -> Tensor:
    """Ulysses entry: this rank's heads of every projection, for every token of the group.

    ``x (s, *B, D)`` this rank's tokens (sequence first) -> ``(P*s, *B, n, H/P, hd)``, n = len(projections), each
    projection ``D -> H*hd`` (e.g. to_q, to_k, to_v). Rank j's column block of the stacked weights is computed and
    sent as soon as it is ready (``matmul_all_to_all``); biases and LoRA are added on the receiving side.
    """
    world, parts = ov.world, [linear_parts(m) for m in projections]
    n, (features, d) = len(parts), parts[0].weight.shape
    local, head_dim = heads // world, features // heads
    width = local * head_dim
    # block j: [W_1^T | .. | W_n^T] restricted to the columns of rank j's heads  (P, D, n * width)
    w_blocks = torch.stack([p.weight for p in parts]).view(n, world, width, d).permute(1, 3, 0, 2).reshape(world, d, -1)
    y = MatmulAllToAll.apply(x, w_blocks, ov).unflatten(-1, (n, width))
    mine = heads_slice(ov.rank, local, head_dim)
    if all(p.bias is not None for p in parts):
        y = y + torch.stack([p.bias[mine] for p in parts])
    if any(p.lora for p in parts):
        # u = A(x) of every adapter on this rank's tokens (batch first, as the adapter's hooks expect), gathered;
        # each adapter's B restricted to my heads' rows then gives its projection's columns
        batch_first = x.movedim(0, -2)  # (*B, s, D)
        u = all_gather_shares(torch.cat([a(batch_first) for p in parts for a, _, _ in p.lora], -1), -2, ov)
        lora, start = [], 0
        for p in parts:
            term = 0
            for a, b, s in p.lora:
                term = term + linear_slice(b, u[..., start : start + a.out_features], rows=mine) * s
                start += a.out_features
            lora.append(term if p.lora else u.new_zeros(()).expand(*u.shape[:-1], width))
        y = y + torch.stack(lora, -2).movedim(-3, 0)  # (*B, S, n, width) -> (S, *B, n, width)
    return y.unflatten(-1, (local, head_dim))


def fused_output(o: Tensor, projection: nn.Module, ov: Overlap) -> Tensor:
    """Ulysses exit: ``o (P*s, *B, H/P * hd)`` (this rank's heads, every token) -> this rank's tokens of
    ``o_all_heads @ W^T + b`` (+ LoRA), ``(s, *B, D)``; rank j's rows arrive while the next block multiplies."""
    world, parts = ov.world, linear_parts(projection)
    d, width = parts.weight.shape[0], o.shape[-1]
    w_blocks = parts.weight.t().reshape(world, width, d)  # row block j: rank j's heads
    y = AllToAllMatmul.apply(o, w_blocks, ov)
    if parts.lora:
        # z = A(o): my heads' columns of each A give a partial sum over heads, reduce-scattered to token owners
        mine, batch_first = slice(ov.rank * width, (ov.rank + 1) * width), o.movedim(0, -2)  # (*B, S, width)
        partial = torch.cat([linear_slice(a, batch_first, cols=mine) for a, _, _ in parts.lora], -1)
        z = reduce_scatter_tokens(partial, -2, ov).split([a.out_features for a, _, _ in parts.lora], -1)
        y = y + sum(b(zi) * s for (_, b, s), zi in zip(parts.lora, z, strict=True)).movedim(-2, 0)
    return y if parts.bias is None else y + parts.bias


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Non-causal softmax attention of sequence-first ``(S, *B, h, hd)`` tensors -> ``(S, *B, h * hd)``."""
    to_heads_first = lambda t: t.movedim(0, -2)  # noqa: E731  (*B, h, S, hd)
    o = F.scaled_dot_product_attention(to_heads_first(q), to_heads_first(k), to_heads_first(v))
    return o.movedim(-2, 0).flatten(-2)


def base_model(transformer: nn.Module) -> nn.Module:
    """The diffusers model under a peft wrapper (hooks go on its submodules: peft calls its ``forward`` directly)."""
    return transformer.get_base_model() if hasattr(transformer, "get_base_model") else transformer


def sequence_problem(policy, size: int) -> str | None:
    """Why ``policy`` cannot split over ``size`` ranks (heads and tokens must divide), or None."""
    heads = math.lcm(*(base_model(net).config.num_attention_heads for net in policy.denoisers))  # each must divide
    tokens = {"heads": heads, "image/video tokens": policy.runtime.image_seq_len}
    if policy.runtime.splits_text:
        tokens["text tokens (model.text_max_length)"] = policy.text_max_length
    bad = [f"{n} {what}" for what, n in tokens.items() if n % size]
    return f"must divide the {', '.join(bad)}" if bad else None


def enable(transformers: Sequence[nn.Module], runtime, ov: Overlap) -> SequenceParallel:
    """Install the family's sequence parallelism (``runtime.shard_sequence``) on each transformer (the policy's
    denoisers and, in a full fine-tune, their reference copies: ``Policy.networks``); one :class:`SequenceParallel`
    drives them all."""
    sp = SequenceParallel(ov)
    for net in transformers:
        sp.handles += runtime.shard_sequence(base_model(net), sp)
    return sp


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """Sequence parallelism's rules, all of them (the heads and tokens that must divide are checked when the policy
    is built: :func:`sequence_problem`): the family has it, the processes form its groups."""
    p = cfg.parallel
    if p.sequence_parallel == 1:
        return
    families = catalog("model family")  # lean.models.registry.FAMILIES, whose family packages import this module
    family = families[cfg.model.family]
    if not family.sequence_parallel:
        able = ", ".join(n for n, f in families.items() if f.sequence_parallel)
        raise ConfigError(
            "parallel.sequence_parallel",
            p.sequence_parallel,
            f"{family.display_name} has no sequence parallelism yet (families with it: {able})",
        )
    world_size = p.sequence_parallel if world_size is None else world_size
    if world_size % p.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel",
            p.sequence_parallel,
            f"must divide the {world_size} processes into sequence-parallel groups (run it under "
            f"`lean launch -n {p.sequence_parallel * max(1, world_size // p.sequence_parallel)} -- ...`)",
        )
