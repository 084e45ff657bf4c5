"""Data parallelism with the gradient reduce-scatter fused into each layer's weight-gradient GEMM.

A data-parallel linear layer ``y = x @ W`` whose weight rows are sharded over the group (ZeRO-3 / FSDP layout: rank r
stores ``W_r``, rows ``r*k/P .. (r+1)*k/P`` of W, and updates only those). Each layer is one gradient bucket.

    forward   y  = x @ all_gather(W_r) = sum_j x[:, K_j] @ W_j     the gather overlapped with the partial GEMMs
    backward  dx = dy @ W^T                                          (local)
              dW_r = sum over ranks q of (x_q^T dy_q)[K_r]         = matmul_reduce_scatter(x^T, dy) over the group

So the bucket's reduce-scatter *is* a matmul_reduce_scatter whose rows are the weight's input features and whose
contraction runs over the local batch. With ``flash`` the partial ``x[:, K_c]^T dy`` of bucket chunk c is accumulated
while it travels the ring and the last step computes this rank's own chunk, so even the last bucket of the backward pass
(the first layer) leaves no transfer exposed after its GEMM; with ``sliced`` the last slice's reduce-scatter is exposed.
The gradient is the sum over ranks: scale the loss by 1/P for the mean over the global batch.

Precision (``p2p.py``): in float16/bfloat16 both sums over ranks, the forward's over the gathered blocks and the
gradient's reduce-scatter, are accumulated in float32 and rounded once (with ``flash`` the gradient's partials then go
straight to their owner instead of round the ring). The weight-gradient GEMM over the local batch is one GEMM, which
accumulates in float32 itself.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.autograd import Function

from lean.parallel.overlap import ops
from lean.parallel.overlap.p2p import (
    DEFAULT_TIMEOUT_S,
    Method,
    Overlap,
    accumulation_dtype,
    all_gather_apply,
    as_overlap,
    divisible_rows,
)


def gather_linear(x: Tensor, w_shard: Tensor, ov: Overlap) -> tuple[Tensor, Tensor]:
    """``(x @ W, W)`` with ``W = all_gather(w_shard)`` (rows), the gather overlapped with the partial products."""
    world, k_shard, n = ov.world, w_shard.shape[0], w_shard.shape[1]
    if x.shape[-1] != world * k_shard:
        raise ValueError(
            f"data_parallel_linear: input with shape {tuple(x.shape)} has {x.shape[-1]} features, but the "
            f"weight shard {tuple(w_shard.shape)} times world size {world} has {world * k_shard}"
        )
    xs = x.reshape(-1, world, k_shard)
    # flash (one peer at a time) and sliced (a slice of every peer's rows at a time) add several products into y, in
    # float32 for 16-bit dtypes; collective adds one GEMM over all of them, which rounds the whole sum once
    y = x.new_zeros((xs.shape[0], n), dtype=accumulation_dtype(x.dtype) if ov.method != "collective" else None)
    w = w_shard.new_empty((world, k_shard, n))

    def consume(peers: slice, rows: slice, block: Tensor) -> None:  # block: rows `rows` of the shards of `peers`
        w[peers, rows] = block
        ops.add_matmul_(y, xs[:, peers, rows].reshape(xs.shape[0], -1), block.reshape(-1, n))

    all_gather_apply(w_shard, consume, ov)
    return y.to(x.dtype).view(*x.shape[:-1], n), w.flatten(0, 1)


class DataParallelLinear(Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_shard: Tensor, ov: Overlap) -> Tensor:
        y, w = gather_linear(x, w_shard, ov)
        ctx.ov = ov
        ctx.save_for_backward(x, w)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dx = dy @ w.t() if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = ops.matmul_reduce_scatter(x.reshape(-1, x.shape[-1]).t(), dy.reshape(-1, dy.shape[-1]), ctx.ov)
        return dx, dw, None


def data_parallel_linear(
    x: Tensor,
    w_shard: Tensor,
    method: Method | Overlap = "flash",
    group=None,
    *,
    slices: int | None = None,
    bidirectional: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """``x @ all_gather(w_shard)``; the gradient of ``w_shard`` is this rank's shard of the sum over ranks."""
    return DataParallelLinear.apply(x, w_shard, as_overlap(method, group, slices, bidirectional, timeout))


class ShardedLinear(nn.Module):
    """A bias-free linear layer ``y = x @ W`` whose rows of W are sharded over the data-parallel group."""

    def __init__(self, w_shard: Tensor, ov: Overlap):
        super().__init__()
        self.weight = nn.Parameter(w_shard)
        self.ov = ov

    @classmethod
    def from_full(cls, w: Tensor, ov: Overlap) -> ShardedLinear:
        """This rank's shard of the full ``(k, n)`` weight ``w`` (every rank passes the same ``w``)."""
        rows = divisible_rows(w, ov.world, "ShardedLinear")
        return cls(w[ov.rank * rows : (ov.rank + 1) * rows].clone(), ov)

    def forward(self, x: Tensor) -> Tensor:
        return data_parallel_linear(x, self.weight, self.ov)
