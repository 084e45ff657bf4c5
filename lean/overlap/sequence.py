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
They move tensors and compute nothing; ``lean.overlap.ops`` fuses them with the projections around them.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

from lean.overlap.p2p import (
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


class _GatherTokens(Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, ov: Overlap) -> Tensor:
        ctx.dim, ctx.ov, ctx.rows = dim, ov, x.shape[dim]
        return _gather(x, dim, ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return dy.narrow(ctx.dim, ctx.ov.rank * ctx.rows, ctx.rows), None, None


def _gather(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    chunk = x.movedim(dim, 0)
    out = chunk.new_empty((ov.world, *chunk.shape))

    def keep(peers: slice, rows: slice, block: Tensor) -> None:
        out[peers, rows] = block

    all_gather_apply(chunk, keep, dataclasses.replace(ov, method="collective"))
    return out.flatten(0, 1).movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    chunks = x.movedim(dim, 0)
    chunks = chunks.reshape(ov.world, divisible_rows(chunks, ov.world, "reduce_scatter_tokens"), *chunks.shape[1:])
    collective = dataclasses.replace(ov, method="collective")
    out = reduce_scatter_apply(lambda peers, rows: chunks[peers, rows], chunks.shape[1], collective, x.dtype)
    return out.movedim(0, dim)


class _AllGatherShares(Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, ov: Overlap) -> Tensor:
        ctx.dim, ctx.ov = dim, ov
        return _gather(x, dim, ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return _reduce_scatter(dy, ctx.dim, ctx.ov), None, None


class _ReduceScatterTokens(Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, ov: Overlap) -> Tensor:
        ctx.dim, ctx.ov = dim, ov
        return _reduce_scatter(x, dim, ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return _gather(dy, ctx.dim, ctx.ov), None, None


def all_gather_shares(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """Every rank's block of the ``dim`` axis, in rank order, inside the sharded region (backward: reduce-scatter)."""
    return _AllGatherShares.apply(x, dim, ov)


def reduce_scatter_tokens(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """This rank's block of the ``dim`` axis of the sum over ranks of ``x`` (backward: all-gather)."""
    return _ReduceScatterTokens.apply(x, dim, ov)


def gather_tokens(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """Every rank's block of the ``dim`` axis, concatenated in rank order (the inverse of :func:`split_tokens`)."""
    return _GatherTokens.apply(x, dim, ov)


class _AllReduceSum(Function):
    @staticmethod
    def forward(ctx, x: Tensor, ov: Overlap) -> Tensor:
        ctx.ov = ov
        return _all_reduce(x.clone(), ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return _all_reduce(dy.clone(), ctx.ov), None


def _all_reduce(x: Tensor, ov: Overlap) -> Tensor:
    if ov.loopback:
        return x
    wait([dist.all_reduce(x, group=ov.group, async_op=True)], ov, "all-reduce")
    return x


def all_reduce_sum(x: Tensor, ov: Overlap) -> Tensor:
    """``sum_r x_r`` on every rank (small statistics, e.g. a norm's sum of squares over heads held by other ranks)."""
    return _AllReduceSum.apply(x, ov)


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


class _SeqToHeads(Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, ov: Overlap) -> Tensor:
        ctx.dim, ctx.ov = dim, ov
        return _seq_to_heads(x, dim, ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return _heads_to_seq(dy, ctx.dim, ctx.ov), None, None


class _HeadsToSeq(Function):
    @staticmethod
    def forward(ctx, y: Tensor, dim: int, ov: Overlap) -> Tensor:
        ctx.dim, ctx.ov = dim, ov
        return _heads_to_seq(y, dim, ov)

    @staticmethod
    def backward(ctx, dx: Tensor):
        return _seq_to_heads(dx, ctx.dim, ctx.ov), None, None


def seq_to_heads(x: Tensor, dim: int, ov: Overlap) -> Tensor:
    """Sequence-first ``x (s, *B, H, ..)`` with the heads on axis ``dim`` -> ``(P*s, *B, H/P, ..)``: every rank's tokens
    of this rank's heads (rank r keeps heads r*H/P .. (r+1)*H/P)."""
    return _SeqToHeads.apply(x, dim, ov)


def heads_to_seq(y: Tensor, dim: int, ov: Overlap) -> Tensor:
    """The inverse of :func:`seq_to_heads`: ``(P*s, *B, H/P, ..)`` -> this rank's tokens with all heads."""
    return _HeadsToSeq.apply(y, dim, ov)
