"""Blocks built from the overlap ops, and the single-process math they must equal.

Inputs and outputs are sequence shards ``(s, *batch, d)`` of a sequence-first ``(P*s, *batch, d)`` tensor.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from lean.parallel.overlap.autograd import AllGatherMatmul, AllToAllMatmul, MatmulAllToAll, MatmulReduceScatter
from lean.parallel.overlap.p2p import Overlap, divisible_rows


def mlp(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """``gelu(x @ w1) @ w2``: the single-process MLP."""
    return F.gelu(x @ w1) @ w2


def attend(qkv: Tensor, causal: bool) -> Tensor:
    """Softmax attention of each head over the sequence: qkv ``(S, *B, 3, h, hd)`` -> ``(S, *B, h, hd)``."""
    q, k, v = (t.movedim(0, -2) for t in qkv.unbind(-3))  # (*B, h, S, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).movedim(-2, 0)


def attention(x: Tensor, w_qkv: Tensor, w_o: Tensor, heads: int, causal: bool = True) -> Tensor:
    """Single-process multi-head attention: ``attend((x @ w_qkv) as (3, heads, hd)) @ w_o``."""
    qkv = (x @ w_qkv).unflatten(-1, (3, heads, -1))
    return attend(qkv, causal).flatten(-2) @ w_o


class SequenceParallelMLP(nn.Module):
    """Tensor + sequence parallel MLP: ``y_r = reduce_scatter(gelu(all_gather(x) @ W1[:, F_r]) @ W2[F_r, :])``.

    Rank r holds column block F_r of W1 and the matching row block of W2 (Megatron's column/row split); the hidden
    activation is full-sequence but F/P wide. Equals ``mlp`` on the full sequence, shard r of it.
    """

    def __init__(self, w1_shard: Tensor, w2_shard: Tensor, ov: Overlap):
        super().__init__()
        self.w1, self.w2, self.ov = nn.Parameter(w1_shard), nn.Parameter(w2_shard), ov

    @classmethod
    def from_full(cls, w1: Tensor, w2: Tensor, ov: Overlap) -> SequenceParallelMLP:
        """This rank's shards of the full ``(d, f)`` and ``(f, d)`` weights (every rank passes the same ones)."""
        f = divisible_rows(w2, ov.world, "SequenceParallelMLP hidden size")
        cols = slice(ov.rank * f, (ov.rank + 1) * f)
        return cls(w1[:, cols].clone(), w2[cols].clone(), ov)

    def forward(self, x_shard: Tensor) -> Tensor:
        hidden = F.gelu(AllGatherMatmul.apply(x_shard, self.w1, self.ov))
        return MatmulReduceScatter.apply(hidden, self.w2, self.ov)


class UlyssesAttention(nn.Module):
    """Sequence-parallel attention (DeepSpeed-Ulysses) with the all-to-alls fused into the projections.

    ``x_r -> matmul_all_to_all`` gives the Q, K, V of this rank's H/P heads over the full sequence, attention runs
    locally per head, and ``all_to_all_matmul`` returns to sequence shards through the output projection. The weights
    are replicated; their gradients are this rank's contribution (sum them over the group, as data parallelism does).
    """

    def __init__(self, w_qkv: Tensor, w_o: Tensor, heads: int, ov: Overlap, causal: bool = True):
        super().__init__()
        if heads % ov.world:
            raise ValueError(
                f"UlyssesAttention: {heads} heads (weight shape {tuple(w_qkv.shape)}) cannot be split "
                f"over world size {ov.world}"
            )
        self.w_qkv, self.w_o = nn.Parameter(w_qkv), nn.Parameter(w_o)
        self.heads, self.ov, self.causal = heads, ov, causal

    def forward(self, x_shard: Tensor) -> Tensor:
        world, d = self.ov.world, self.w_qkv.shape[0]
        local_heads, head_dim = self.heads // world, self.w_qkv.shape[1] // (3 * self.heads)
        # column block j of the QKV weight: q, k and v of the heads j*H/P .. (j+1)*H/P
        w_blocks = self.w_qkv.view(d, 3, world, local_heads, head_dim).permute(2, 0, 1, 3, 4).reshape(world, d, -1)
        qkv = MatmulAllToAll.apply(x_shard, w_blocks, self.ov).unflatten(-1, (3, local_heads, head_dim))
        o = attend(qkv, self.causal).flatten(-2)
        return AllToAllMatmul.apply(o, self.w_o.view(world, local_heads * head_dim, -1), self.ov)
