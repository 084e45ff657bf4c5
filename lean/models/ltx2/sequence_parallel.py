"""LTX-2's sequence parallelism (``lean.models.sequence_parallel``): the video tokens split over the group, the audio
stream replicated.

The video tokens (S_v = 6144 at 512 x 768 x 121 frames, against 126 audio tokens) split at the first block and are
gathered after ``proj_out``. In each block:

* video self-attention (``attn1``): Ulysses with fused projections (:class:`UlyssesVideoSelfAttention`): its q/k
  RMS norm across heads, its split rotary table restricted to this rank's heads, its per-head gates (LTX-2.3's gated
  attention: the gate logits of every token all-gathered, this rank's heads kept);
* video text cross-attention (``attn2``): unchanged, this rank's queries against the whole text;
* audio-to-video attention: this rank's video queries (their rows of the rotary table) against every audio token
  (:class:`VideoQueriesShare`), no communication;
* video-to-audio attention: the audio queries against every video token, all-gathered
  (:class:`EveryVideoToken`; backward: a reduce-scatter);
* the audio stream (its self-attention, text cross-attention, MLP): the same on every rank.

Gradient shares (``lean.parallel.overlap.sequence``): the video output's gather hands each rank its rows of the
gradient; the audio output, which every rank computes whole, hands each rank 1/P of its gradient
(:func:`replicated_share`), so the shares' sum over the group is dL/dW for every weight the audio stream reaches too.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function

from lean.models.sequence_parallel import SequenceParallel, attention, fused_output, fused_projections
from lean.models.wan.sequence_parallel import rms_norm_across_heads
from lean.parallel.overlap.sequence import all_gather_shares, gather_tokens, split_tokens


class _OneShare(Function):
    """Identity forward; backward: the gradient / P (the share of a rank among P computing the same output)."""

    @staticmethod
    def forward(ctx, x: Tensor, ranks: int) -> Tensor:
        ctx.ranks = ranks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return dy / ctx.ranks, None


def replicated_share(x: Tensor, sp: SequenceParallel) -> Tensor:
    """``x``, computed whole on every rank of the group; its gradient shared equally among them."""
    return _OneShare.apply(x, sp.size)


def shard_sequence(net, sp: SequenceParallel) -> list:
    """Install the processors and hooks (module docstring) on ``net``; returns the hooks' handles."""
    if net.config.rope_type != "split":
        raise ValueError("LTX-2's sequence parallelism rotates with the split rotary table (LTX-2.3's rope_type)")

    def split_video(module, args, kwargs):
        if args:
            return (split_tokens(args[0], 1, sp.ov), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": split_tokens(kwargs["hidden_states"], 1, sp.ov)}

    for block in net.transformer_blocks:
        block.attn1.set_processor(UlyssesVideoSelfAttention(sp))
        block.audio_to_video_attn.set_processor(VideoQueriesShare(sp, block.audio_to_video_attn.processor))
        block.video_to_audio_attn.set_processor(EveryVideoToken(sp, block.video_to_audio_attn.processor))
    return [
        net.transformer_blocks[0].register_forward_pre_hook(split_video, with_kwargs=True),
        net.proj_out.register_forward_hook(lambda module, args, out: gather_tokens(out, 1, sp.ov)),
        net.audio_proj_out.register_forward_hook(lambda module, args, out: replicated_share(out, sp)),
    ]


def rotate_split(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """LTX-2's split rotary embedding (``apply_split_rotary_emb``) on ``x (S, B, h, hd)``: the halves (x1, x2) of each
    head turned to (x1 cos - x2 sin, x2 cos + x1 sin), computed in float32 as diffusers does; ``cos``, ``sin``
    ``(S, B, h, hd / 2)``."""
    x1, x2 = x.float().unflatten(-1, (2, -1)).unbind(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class UlyssesVideoSelfAttention:
    """diffusers attention processor for LTX-2's video ``attn1`` on this rank's tokens ``[B, s, D]``: fused QKV ->
    norm across heads -> split rotary of my heads -> attention of my heads over every token -> my heads' gates ->
    fused output projection."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(
        self,
        attn,
        hidden_states: Tensor,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
        perturbation_mask=None,
        all_perturbed=None,
    ) -> Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or perturbation_mask is not None:
            raise ValueError("UlyssesVideoSelfAttention runs LTX-2's unmasked, unperturbed video self-attention only")
        ov = self.sp.ov
        qkv = fused_projections(hidden_states.transpose(0, 1), (attn.to_q, attn.to_k, attn.to_v), attn.heads, ov)
        q, k, v = qkv.unbind(-3)  # (S, B, H/P, hd)
        local = q.shape[-2]
        mine = slice(ov.rank * local, (ov.rank + 1) * local)
        q, k = rms_norm_across_heads(q, attn.norm_q, self.sp), rms_norm_across_heads(k, attn.norm_k, self.sp)
        if query_rotary_emb is not None:
            cos, sin = (f[:, mine].permute(2, 0, 1, 3) for f in query_rotary_emb)  # (B, H, S, r) -> (S, B, H/P, r)
            q, k = rotate_split(q, cos, sin), rotate_split(k, cos, sin)
        o = attention(q, k, v).type_as(q)  # (S, B, H/P * hd)
        if attn.to_gate_logits is not None:  # every token's gates of my heads
            logits = all_gather_shares(attn.to_gate_logits(hidden_states), 1, ov)[..., mine]  # (B, S, H/P)
            gates = 2.0 * torch.sigmoid(logits).transpose(0, 1).unsqueeze(-1)
            o = (o.unflatten(-1, (local, -1)) * gates).flatten(-2)
        return attn.to_out[1](fused_output(o, attn.to_out[0], ov).transpose(0, 1))


class VideoQueriesShare:
    """Audio-to-video attention on this rank's video queries: their rows of the query rotary table, then the
    family's own processor (``inner``) against every audio token."""

    def __init__(self, sp: SequenceParallel, inner):
        self.sp, self.inner = sp, inner

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
        key_rotary_emb=None,
    ) -> Tensor:  # fmt: skip
        if query_rotary_emb is not None:  # (B, H, S_v, r): this rank's token rows
            query_rotary_emb = tuple(split_tokens(f, 2, self.sp.ov) for f in query_rotary_emb)
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)


class EveryVideoToken:
    """Video-to-audio attention: the audio queries (every rank's the same) against every video token, all-gathered
    (the key rotary table is the whole video's), through the family's own processor (``inner``)."""

    def __init__(self, sp: SequenceParallel, inner):
        self.sp, self.inner = sp, inner

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
        key_rotary_emb=None,
    ) -> Tensor:  # fmt: skip
        video = all_gather_shares(encoder_hidden_states, 1, self.sp.ov)
        return self.inner(attn, hidden_states, video, attention_mask, query_rotary_emb, key_rotary_emb)
