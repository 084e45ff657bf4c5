"""FLUX's sequence parallelism (``lean.models.sequence_parallel``): image and text tokens both split, joint attention
as Ulysses over every rank's text and image tokens (:class:`UlyssesJointAttention`)."""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.sequence_parallel import SequenceParallel, attention, fused_output, fused_projections
from lean.parallel.overlap.sequence import gather_tokens, heads_to_seq, split_tokens


def shard_sequence(net, sp: SequenceParallel) -> list:
    """Sequence parallelism (``lean.models.sequence_parallel``): image and text tokens both split after their
    embedders, the image tokens gathered after ``proj_out``; joint attention is Ulysses over the text and image
    tokens of every rank (:class:`UlyssesJointAttention`). The rotary table stays whole."""

    def split_output(module, args, out):
        return split_tokens(out, 1, sp.ov)

    def split_text(module, args, out):
        sp.text_tokens = out.shape[1]  # the single blocks' joint sequence needs it to order its rotary table
        return split_tokens(out, 1, sp.ov)

    for block in (*net.transformer_blocks, *net.single_transformer_blocks):
        block.attn.set_processor(UlyssesJointAttention(sp))
    return [
        net.x_embedder.register_forward_hook(split_output),
        net.context_embedder.register_forward_hook(split_text),
        net.proj_out.register_forward_hook(lambda module, args, out: gather_tokens(out, 1, sp.ov)),
    ]


def rotate(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """FLUX's rotary embedding (diffusers' ``apply_rotary_emb``) on a sequence-first ``(S, *B, h, hd)`` tensor."""
    from diffusers.models.embeddings import apply_rotary_emb  # local: diffusers takes seconds to import

    return apply_rotary_emb(x.transpose(0, 1), rope, sequence_dim=1).transpose(0, 1)


def joint_order(rope: Tensor, text_tokens: int, world: int) -> Tensor:
    """The rows of a ``[text; image]`` table in the order the single blocks' tokens arrive in: every rank's
    ``[its text; its image]`` in rank order."""
    t, s = text_tokens // world, (rope.shape[0] - text_tokens) // world
    rows = [
        torch.cat([torch.arange(j * t, (j + 1) * t), text_tokens + torch.arange(j * s, (j + 1) * s)])
        for j in range(world)
    ]
    return rope[torch.cat(rows).to(rope.device)]


class UlyssesJointAttention:
    """diffusers attention processor for FLUX's joint attention on this rank's tokens (see
    ``lean.models.sequence_parallel``).

    Double-stream blocks: the image and the text tokens each through their own fused QKV, their per-head norms, then
    ``[text; image]`` of my heads in the original order, the rotary table, attention, and each stream's fused output
    projection. Single-stream blocks: one fused QKV of this rank's ``[text; image]`` tokens (their concatenation
    arrives in rank order, :func:`joint_order`), attention, and the all-to-all back (the block's ``proj_out`` mixes
    attention and MLP outside the processor)."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(
        self, attn, hidden_states: Tensor, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        if attention_mask is not None:
            raise ValueError("UlyssesJointAttention runs unmasked attention only")
        ov, heads = self.sp.ov, attn.heads
        qkv = fused_projections(hidden_states.transpose(0, 1), (attn.to_q, attn.to_k, attn.to_v), heads, ov)
        q, k, v = qkv.unbind(-3)  # (S, B, H/P, hd)
        q, k = attn.norm_q(q), attn.norm_k(k)
        rope = image_rotary_emb
        if encoder_hidden_states is not None:
            text = fused_projections(
                encoder_hidden_states.transpose(0, 1), (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), heads, ov
            )
            tq, tk, tv = text.unbind(-3)
            q, k, v = torch.cat([attn.norm_added_q(tq), q]), torch.cat([attn.norm_added_k(tk), k]), torch.cat([tv, v])
        elif rope is not None:
            rope = tuple(joint_order(f, self.sp.text_tokens, ov.world) for f in rope)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        o = attention(q, k, v).to(q.dtype)  # (T + S, B, H/P * hd)
        if encoder_hidden_states is None:
            return heads_to_seq(o.unflatten(-1, (heads // ov.world, -1)), 2, ov).flatten(-2).transpose(0, 1)
        text_tokens = encoder_hidden_states.shape[1] * ov.world
        image = attn.to_out[1](fused_output(o[text_tokens:], attn.to_out[0], ov).transpose(0, 1))
        return image, fused_output(o[:text_tokens], attn.to_add_out, ov).transpose(0, 1)
