"""Differentiable overlap ops: each backward is the dual op, run with the same method.

    y = all_gather_matmul(x, w)       dx = matmul_reduce_scatter(dy, w^T)     dw = all_gather(x)^T dy
    y = matmul_reduce_scatter(x, w)   dx = all_gather_matmul(dy, w^T)         dw = x^T all_gather(dy)
    y = matmul_all_to_all(x, W)       dx = all_to_all_matmul(dy, W^T)         dW_j = x^T (received dy block j)
    y = all_to_all_matmul(o, W)       do = matmul_all_to_all(dy, W^T)         dW_j = (received o block j)^T dy

Weights of the all-to-all ops are replicated over the group; their gradient here is this rank's contribution (from its
rows), so summing it over the group (as data parallelism does anyway) gives the full gradient.

Precision: every weight gradient here is one local GEMM (its contraction over rows never crosses ranks), so in 16-bit
dtypes it accumulates in float32 inside the GEMM and is rounded once; the sums over ranks are the dual ops' (float32
for 16-bit dtypes, see ``p2p.py``). Summing the all-to-all weights' contributions over the group is the caller's: do it
in float32 (or with FSDP's ``reduce_dtype=float32``) for the same contract.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function

from lean.parallel.overlap import ops
from lean.parallel.overlap.p2p import DEFAULT_TIMEOUT_S, Method, Overlap, as_overlap


def weight_grad(x: Tensor, dy: Tensor) -> Tensor:
    """``x^T dy`` over all leading dimensions: the gradient of ``w`` in ``y = x @ w``."""
    return x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])


class AllGatherMatmul(Function):
    @staticmethod
    def forward(ctx, x_shard: Tensor, w: Tensor, ov: Overlap) -> Tensor:
        y, x_full = ops.all_gather_matmul(x_shard, w, ov, keep_input=ctx.needs_input_grad[1])
        ctx.ov = ov
        ctx.save_for_backward(x_full, w)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_full, w = ctx.saved_tensors
        dx = ops.matmul_reduce_scatter(dy, w.t(), ctx.ov) if ctx.needs_input_grad[0] else None
        dw = weight_grad(x_full, dy) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class MatmulReduceScatter(Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, ov: Overlap) -> Tensor:
        ctx.ov = ov
        ctx.save_for_backward(x, w)
        return ops.matmul_reduce_scatter(x, w, ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dx, dy_full = ops.all_gather_matmul(dy, w.t(), ctx.ov, keep_input=ctx.needs_input_grad[1])
        dw = weight_grad(x, dy_full) if ctx.needs_input_grad[1] else None
        return dx if ctx.needs_input_grad[0] else None, dw, None


class MatmulAllToAll(Function):
    @staticmethod
    def forward(ctx, x_shard: Tensor, w_blocks: Tensor, ov: Overlap) -> Tensor:
        ctx.ov = ov
        ctx.save_for_backward(x_shard, w_blocks)
        return ops.matmul_all_to_all(x_shard, w_blocks, ov)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_blocks = ctx.saved_tensors
        dx, received = ops.all_to_all_matmul(dy, w_blocks.transpose(1, 2), ctx.ov, keep_input=ctx.needs_input_grad[1])
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.stack([weight_grad(x, block) for block in received])
        return dx if ctx.needs_input_grad[0] else None, dw, None


class AllToAllMatmul(Function):
    @staticmethod
    def forward(ctx, o: Tensor, w_blocks: Tensor, ov: Overlap) -> Tensor:
        y, received = ops.all_to_all_matmul(o, w_blocks, ov, keep_input=ctx.needs_input_grad[1])
        ctx.ov = ov
        ctx.save_for_backward(received, w_blocks)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        received, w_blocks = ctx.saved_tensors
        do = ops.matmul_all_to_all(dy, w_blocks.transpose(1, 2), ctx.ov) if ctx.needs_input_grad[0] else None
        dw = torch.stack([weight_grad(block, dy) for block in received]) if ctx.needs_input_grad[1] else None
        return do, dw, None


def all_gather_matmul(
    x_shard: Tensor,
    w: Tensor,
    method: Method | Overlap = "flash",
    group=None,
    *,
    slices: int | None = None,
    bidirectional: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """``all_gather(x_shard) @ w`` (sequence-sharded input times column-parallel weight), differentiable."""
    return AllGatherMatmul.apply(x_shard, w, as_overlap(method, group, slices, bidirectional, timeout))


def matmul_reduce_scatter(
    x: Tensor,
    w: Tensor,
    method: Method | Overlap = "flash",
    group=None,
    *,
    slices: int | None = None,
    bidirectional: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """This rank's sequence shard of ``sum over ranks of x @ w`` (row-parallel weight), differentiable."""
    return MatmulReduceScatter.apply(x, w, as_overlap(method, group, slices, bidirectional, timeout))


def matmul_all_to_all(
    x_shard: Tensor,
    w_blocks: Tensor,
    method: Method | Overlap = "flash",
    group=None,
    *,
    slices: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """Full sequence of this rank's feature block ``[x_j @ w_blocks[rank]]_j`` (Ulysses QKV), differentiable."""
    return MatmulAllToAll.apply(x_shard, w_blocks, as_overlap(method, group, slices, False, timeout))


def all_to_all_matmul(
    o: Tensor,
    w_blocks: Tensor,
    method: Method | Overlap = "flash",
    group=None,
    *,
    slices: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """This rank's rows of ``sum_j o_j @ w_blocks[j]`` (Ulysses output projection), differentiable."""
    return AllToAllMatmul.apply(o, w_blocks, as_overlap(method, group, slices, False, timeout))
