"""The four GEMM + communication operations, forward math only (autograd lives in ``autograd.py``).

Layout: sequence first, ``(rows, *batch, features)`` as in Megatron, so that a sequence shard is a contiguous block of
dimension 0. P is the group's world size, r this rank, ``x_j`` rank j's input, ``s`` the rows per rank.

    all_gather_matmul      y   = [x_0; ..; x_{P-1}] @ w                          (P*s, *B, n)   TP+SP entry
    matmul_reduce_scatter  y_r = rows r*s..(r+1)*s of  sum_j x_j @ w_j              (s, *B, n)   TP+SP exit
    matmul_all_to_all      y_r = [x_0 @ W_r; ..; x_{P-1} @ W_r]                     (P*s, *B, c) Ulysses QKV
    all_to_all_matmul      y_r = sum_j o_j[rows of r] @ W_j                         (s, *B, d)   Ulysses output

Their gradients are each other: d(all_gather_matmul)/dx is a matmul_reduce_scatter by w^T and vice versa, and
d(matmul_all_to_all)/dx is an all_to_all_matmul by W^T and vice versa. Every op follows ``ov.method`` (see ``p2p.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.parallel.overlap.p2p import (
    Overlap,
    accumulation_dtype,
    all_gather_apply,
    all_to_all_apply,
    divisible_rows,
    reduce_scatter_apply,
)


def matmul(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` over the last dimension as one 2-D GEMM (a strided N-D view would take a slow batched path)."""
    return (x.reshape(-1, x.shape[-1]) @ w).view(*x.shape[:-1], w.shape[-1])


def matmul_into(out: Tensor, x: Tensor, w: Tensor) -> None:
    """``out[...] = x @ w``, written in place by the GEMM when ``out`` is contiguous (no temporary, no copy)."""
    if out.is_contiguous():
        torch.mm(x.reshape(-1, x.shape[-1]), w, out=out.view(-1, w.shape[-1]))
    else:
        out.copy_(matmul(x, w))


def add_matmul_(acc: Tensor, x: Tensor, w: Tensor) -> None:
    """``acc += x @ w`` for 2-D ``x``, ``w``: in place by the GEMM when the dtypes agree; a float32 ``acc`` of 16-bit
    operands gets the product rounded once to their dtype (a GEMM's output) and keeps the sum in float32.

    Over P products that is P + 1 roundings of a product or the sum, where a 16-bit ``addmm_`` per product rounds the
    running sum P times: rms u sqrt(2P) against u sqrt(P(P+1)/2) for independent products, so float32 is worse at
    P = 2 (by 15%), even at 3 and better from 4 on, and only it rounds the sum once. (CPU GEMMs have no float32 output
    for 16-bit operands; CUDA's ``out_dtype=torch.float32`` would drop the products' rounding.)"""
    if acc.dtype == x.dtype:
        acc.addmm_(x, w)
    else:
        acc += x @ w


def all_gather_matmul(
    x_shard: Tensor, w: Tensor, ov: Overlap, keep_input: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``(all_gather(x_shard) @ w, all_gather(x_shard) if keep_input else None)``;
    x_shard ``(s, *B, k)``, w ``(k, n)``."""
    world = ov.world
    y = x_shard.new_empty((world, *x_shard.shape[:-1], w.shape[-1]))
    x_full = x_shard.new_empty((world, *x_shard.shape)) if keep_input else None

    def consume(peers: slice, rows: slice, block: Tensor) -> None:
        matmul_into(y[peers, rows], block, w)
        if x_full is not None:
            x_full[peers, rows] = block

    all_gather_apply(x_shard, consume, ov)
    return y.flatten(0, 1), None if x_full is None else x_full.flatten(0, 1)


def matmul_reduce_scatter(x: Tensor, w: Tensor, ov: Overlap) -> Tensor:
    """This rank's row shard of ``sum over ranks of x @ w``; x ``(P*s, *B, k)``, w ``(k, n)`` -> ``(s, *B, n)``."""
    world = ov.world
    chunks = x.reshape(world, divisible_rows(x, world, "matmul_reduce_scatter"), *x.shape[1:])
    return reduce_scatter_apply(lambda peers, rows: matmul(chunks[peers, rows], w), chunks.shape[1], ov, x.dtype)


def _check_blocks(w_blocks: Tensor, world: int, op: str) -> None:
    if w_blocks.dim() != 3 or w_blocks.shape[0] != world:
        raise ValueError(
            f"{op}: weight blocks must have shape (world size {world}, in, out), got {tuple(w_blocks.shape)}"
        )


def matmul_all_to_all(x_shard: Tensor, w_blocks: Tensor, ov: Overlap) -> Tensor:
    """Rank j's ``x_j @ w_blocks[r]`` for every j, stacked: x_shard ``(s, *B, d)``, w_blocks ``(P, d, c)`` ->
    ``(P*s, *B, c)``.

    Each rank multiplies its sequence shard by every rank's column block and sends block j to rank j, so that rank r
    ends with the full sequence of its own feature block (Ulysses: heads).
    """
    world = ov.world
    _check_blocks(w_blocks, world, "matmul_all_to_all")
    s, batch, d = x_shard.shape[0], x_shard.shape[1:-1], x_shard.shape[-1]
    y = x_shard.new_empty((world, s, *batch, w_blocks.shape[-1]))

    def produce(peers: slice, rows: slice) -> Tensor:  # (n_peers, rows, *B, c)
        block = x_shard[rows].reshape(-1, d) @ w_blocks[peers]  # broadcast over peers: one batched GEMM
        return block.view(block.shape[0], -1, *batch, block.shape[-1])

    all_to_all_apply(produce, None, s, ov, into=lambda peers, rows: y[peers, rows])
    return y.flatten(0, 1)


def all_to_all_matmul(
    o: Tensor, w_blocks: Tensor, ov: Overlap, keep_input: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``sum_j o_j[rows of r] @ w_blocks[j]``: o ``(P*s, *B, c)``, w_blocks ``(P, c, d)`` -> ``(s, *B, d)``.

    Also returns (if ``keep_input``) the received blocks ``(P, s, *B, c)``: rank j's features of this rank's rows.
    """
    world = ov.world
    _check_blocks(w_blocks, world, "all_to_all_matmul")
    chunks = o.reshape(world, divisible_rows(o, world, "all_to_all_matmul"), *o.shape[1:])
    s, batch, c = chunks.shape[1], chunks.shape[2:-1], chunks.shape[-1]
    # flash consumes one peer at a time, so its rows get P products to sum (in float32 for 16-bit dtypes); collective
    # and sliced consume all peers of a row at once, in one GEMM that rounds the whole sum once
    y = o.new_zeros(
        (s, *batch, w_blocks.shape[-1]), dtype=accumulation_dtype(o.dtype) if ov.method == "flash" else None
    )
    received = o.new_empty(chunks.shape) if keep_input else None

    def consume(peers: slice, rows: slice, block: Tensor) -> None:  # block (n_peers, rows, *B, c)
        lhs = block.movedim(0, -2).reshape(-1, block.shape[0] * c)  # contract over (peer, c) in one GEMM
        add_matmul_(y[rows].view(lhs.shape[0], -1), lhs, w_blocks[peers].reshape(-1, w_blocks.shape[-1]))

    keep = None if received is None else lambda peers, rows: received[peers, rows]
    all_to_all_apply(lambda peers, rows: chunks[peers, rows], consume, s, ov, into=keep)
    return y.to(o.dtype), received
