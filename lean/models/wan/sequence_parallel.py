"""Wan's sequence parallelism (``lean.models.sequence_parallel``): the video tokens split, self-attention as Ulysses
with its q/k norm across heads (:class:`UlyssesSelfAttention`), cross-attention unchanged."""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.sequence_parallel import SequenceParallel, attention, fused_output, fused_projections, heads_slice
from lean.parallel.overlap.p2p import accumulation_dtype
from lean.parallel.overlap.sequence import all_reduce_sum, gather_tokens, split_tokens


def shard_sequence(net, sp: SequenceParallel) -> list:
    """Sequence parallelism (``lean.models.sequence_parallel``): the video tokens split at the first block and
    gathered after ``proj_out``; self-attention is Ulysses with fused projections (:class:`UlyssesSelfAttention`).
    Cross-attention needs no communication: this rank's queries attend to the whole text, which every rank holds.
    The rotary table stays whole: the heads' owners apply it to every token."""

    def split_hidden(module, args, kwargs):
        if args:
            return (split_tokens(args[0], 1, sp.ov), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": split_tokens(kwargs["hidden_states"], 1, sp.ov)}

    for block in net.blocks:
        block.attn1.set_processor(UlyssesSelfAttention(sp))
    return [
        net.blocks[0].register_forward_pre_hook(split_hidden, with_kwargs=True),
        net.proj_out.register_forward_hook(lambda module, args, out: gather_tokens(out, 1, sp.ov)),
    ]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Wan's rotary embedding (``WanAttnProcessor``): feature pairs (2i, 2i+1) rotated by the token's angle i."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2).type_as(x)


def rms_norm_across_heads(x: Tensor, norm: torch.nn.RMSNorm, sp: SequenceParallel) -> Tensor:
    """Wan's q/k norm over all H heads of a token, ``x / rms(x) * g``, on ``x (S, *B, H/P, hd)``: this rank's heads.
    The sum of squares over the other ranks' heads arrives by an all-reduce of one number per token."""
    local, head_dim = x.shape[-2:]
    squares = all_reduce_sum(x.to(accumulation_dtype(x.dtype)).square().sum((-2, -1)), sp.ov)
    inv_rms = torch.rsqrt(squares / (local * head_dim * sp.size) + norm.eps).to(x.dtype)
    gain = norm.weight[heads_slice(sp.ov.rank, local, head_dim)].view(local, head_dim)
    return x * inv_rms[..., None, None] * gain


class UlyssesSelfAttention:
    """diffusers attention processor for Wan's ``attn1`` on this rank's tokens ``[B, s, D]`` (see
    ``lean.models.sequence_parallel``): fused QKV -> norm across heads -> rotary -> attention of my heads over all
    tokens -> fused output projection."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None or attn.add_k_proj is not None:
            raise ValueError("UlyssesSelfAttention runs Wan's unmasked self-attention only")
        ov = self.sp.ov
        qkv = fused_projections(hidden_states.transpose(0, 1), (attn.to_q, attn.to_k, attn.to_v), attn.heads, ov)
        q, k, v = qkv.unbind(-3)  # (S, B, H/P, hd)
        q, k = rms_norm_across_heads(q, attn.norm_q, self.sp), rms_norm_across_heads(k, attn.norm_k, self.sp)
        if rotary_emb is not None:
            cos, sin = (f.transpose(0, 1) for f in rotary_emb)  # (1, S, 1, hd) -> (S, 1, 1, hd)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = attention(q, k, v).type_as(q)
        return attn.to_out[1](fused_output(o, attn.to_out[0], ov).transpose(0, 1))
