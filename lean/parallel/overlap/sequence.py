"""Sequence parallelism's tensor ops: a token sequence split over the ranks of a group, every op differentiable.

Gradient semantics ("shares"). Between :func:`split_tokens` and :func:`gather_tokens` each rank computes its share
L_r of the loss, with sum_r L_r = L: its own tokens' outputs and, after a Ulysses all-to-all, its own heads. Every
gradient a rank computes there is its share's, so a replicated weight's gradient summed over the group is dL/dW (the
sum data parallelism takes anyway, ``World.reduce_gradients_``). At the ends of that region:

    split_tokens      forward: this rank's tokens of a replicated sequence; backward: its rows of the gradient, zeros
                      elsewhere (its share; ``Tensor.narrow``'s own backward)
    gather_tokens     forward: every rank's tokens, in order; backward: this rank's rows of dL/dy. After the gather
                      every rank computes the same, replicated L, so its rows of dL/dy are exactly its share's gradient.
    all_reduce_sum    forward: the sum over ranks; backward: the sum over ranks of the shares' gradients
    all_gather_shares forward: every rank's tokens; backward: the sum over ranks of the gradients of this rank's rows
                      (a reduce-scatter: inside the region every rank's rows feed every rank's share)
    reduce_scatter_tokens  forward: this rank's rows of the sum over ranks; backward: the gradient all-gathered
    seq_to_heads      (s, *B, H, ..) sequence shard, all heads -> (P*s, *B, H/P, ..) whole sequence, this rank's heads
    heads_to_seq      its inverse; each of the two is the other's backward (DeepSpeed-Ulysses, arXiv:2309.14509)

Both all-to-alls run by ``ov.method`` (``p2p.all_to_all_apply``): one collective, row slices, or one P2P step per peer.
They move tensors and compute nothing; ``lean.parallel.overlap.ops`` fuses them with the projections around them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

from lean.parallel.overlap.p2p import (
    Overlap,
    all_gather_apply,
    all_to_all_apply,
    divisible_rows,
    reduce_scatter_apply,
    wait,
)


def split_tokens(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """This rank's contiguous block of the ``dim`` axis of a tensor every rank holds whole."""
    n = x.shape[dim]
    if n % ov.world:
        raise ValueError(
            f"sequence parallelism: {n} tokens (dimension {dim} of shape {tuple(x.shape)}) do not split over "
            f"{ov.world} ranks"
        )
    s = n // ov.world
    return x.narrow(dim, ov.rank * s, s)


# ---------------------------------------------------------------- the maps (forward math; each op pairs two)


def _gather(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """Every rank's ``x``, concatenated along ``dim`` in rank order."""
    chunk = x.movedim(dim, 0)
    out = chunk.new_empty((ov.world, *chunk.shape))

    def keep(peers: slice, rows: slice, block: Tensor) -> None:
        out[peers, rows] = block

    all_gather_apply(chunk, keep, dataclasses.replace(ov, method="collective"))
    return out.flatten(0, 1).movedim(0, dim)


def _own_rows(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """This rank's block of the ``dim`` axis (no communication)."""
    s = x.shape[dim] // ov.world
    return x.narrow(dim, ov.rank * s, s)


def _reduce_scatter(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """This rank's block of the ``dim`` axis of the sum over ranks of ``x``."""
    chunks = x.movedim(dim, 0)
    chunks = chunks.reshape(ov.world, divisible_rows(chunks, ov.world, "reduce_scatter_tokens"), *chunks.shape[1:])
    collective = dataclasses.replace(ov, method="collective")
    out = reduce_scatter_apply(lambda peers, rows: chunks[peers, rows], chunks.shape[1], collective, x.dtype)
    return out.movedim(0, dim)


def _all_reduce(x: Tensor, dim: int | None, ov: Overlap) -> Tensor:
    """The sum over ranks of ``x`` (``dim`` unused)."""
    x = x.clone()
    if not ov.loopback:
        wait([dist.all_reduce(x, group=ov.group, async_op=True)], ov, "all-reduce")
    return x


def _seq_to_heads(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    world = ov.world
    heads = divisible_rows(x.movedim(dim, 0), world, "seq_to_heads (heads)")
    blocks = x.unflatten(dim, (world, heads)).movedim(dim, 0)  # (P, s, *B, H/P, ..): block j goes to rank j
    out = blocks.new_empty(blocks.shape)
    all_to_all_apply(lambda peers, rows: blocks[peers, rows], None, x.shape[0], ov, into=lambda p, r: out[p, r])
    return out.flatten(0, 1)


def _heads_to_seq(y: Tensor, dim: int, ov: Overlap) -> Tensor:
    world = ov.world
    s = divisible_rows(y, world, "heads_to_seq (tokens)")
    chunks = y.unflatten(0, (world, s))  # (P, s, *B, H/P, ..): chunk j holds rank j's tokens
    out = y.new_empty((s, *y.shape[1:dim], world, *y.shape[dim:]))  # (s, *B, P, H/P, ..)
    by_peer = out.movedim(dim, 0)
    all_to_all_apply(lambda peers, rows: chunks[peers, rows], None, s, ov, into=lambda p, r: by_peer[p, r])
    return out.flatten(dim, dim + 1)


Map = Callable[[Tensor, int | None, Overlap], Tensor]


class _Pair(Function):
    """``y = forward(x)``, whose backward is ``dx = backward(dy)``: the op's gradient map under the shares semantics
    (the adjoint of ``forward``, except at the exits of the region, see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int | None, ov: Overlap, forward: Map, backward: Map) -> Tensor:
        ctx.dim, ctx.ov, ctx.backward_map = dim, ov, backward
        return forward(x, dim, ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return ctx.backward_map(dy, ctx.dim, ctx.ov), None, None, None, None


# ---------------------------------------------------------------- the ops


def gather_tokens(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """Every rank's block of the ``dim`` axis, concatenated in rank order (the inverse of :func:`split_tokens`);
    backward: this rank's rows (the exit of the sharded region)."""
    return _Pair.apply(x, dim, ov, _gather, _own_rows)


def all_gather_shares(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """Every rank's block of the ``dim`` axis, in rank order, inside the sharded region (backward: reduce-scatter)."""
    return _Pair.apply(x, dim, ov, _gather, _reduce_scatter)


def reduce_scatter_tokens(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """This rank's block of the ``dim`` axis of the sum over ranks of ``x`` (backward: all-gather)."""
    return _Pair.apply(x, dim, ov, _reduce_scatter, _gather)


def all_reduce_sum(x: Tensor, ov: Overlap) -> Tensor:
    """``sum_r x_r`` on every rank (small statistics, e.g. a norm's sum of squares over heads held by other ranks)."""
    return _Pair.apply(x, None, ov, _all_reduce, _all_reduce)


def seq_to_heads(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """Sequence-first ``x (s, *B, H, ..)`` with the heads on axis ``dim`` -> ``(P*s, *B, H/P, ..)``: every rank's tokens
    of this rank's heads (rank r keeps heads r*H/P .. (r+1)*H/P)."""
    return _Pair.apply(x, dim, ov, _seq_to_heads, _heads_to_seq)


def heads_to_seq(y: Tensor, dim: int, ov: Overlap) -> Tensor:
    """The inverse of :func:`seq_to_heads`: ``(P*s, *B, H/P, ..)`` -> this rank's tokens with all heads."""
    return _Pair.apply(y, dim, ov, _heads_to_seq, _seq_to_heads)
