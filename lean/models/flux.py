"""FLUX.1 (Black Forest Labs): an MMDiT over 2x2-packed VAE latents, conditioned on T5 token embeddings
(``text_encoder_2``) and a CLIP pooled vector (``text_encoder``), with a distilled-guidance embedding.

Latent layout seen by the policy: packed tokens ``x [B, N, 4C]``, N = (h/2)(w/2) for a ``[C, h, w]`` VAE latent,
exactly as diffusers' ``FluxPipeline`` packs it. The transformer takes sigma in [0, 1] (it multiplies by 1000 itself).
The VAE's latent is normalised as z = (z_vae - shift) * scale, so decoding uses z_vae = z / scale + shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.sequence_parallel import SequenceParallel, attention, fused_output, fused_projections
from lean.models.text import PromptEmbeds, tokenize
from lean.models.vae import kl_vae_config
from lean.overlap.sequence import gather_tokens, heads_to_seq, split_tokens

DISPLAY_NAME = "FLUX"
PIPELINE = "FluxPipeline"
# component folder -> (library, model class, transformers config class or None), as model_index.json names them;
# lean.models.component_classes imports them on first use (diffusers takes seconds to import)
COMPONENTS = {
    "transformer": ("diffusers", "FluxTransformer2DModel", None),
    "vae": ("diffusers", "AutoencoderKL", None),
    "text_encoder": ("transformers", "CLIPTextModel", "CLIPTextConfig"),  # pooled vector
    "text_encoder_2": ("transformers", "T5EncoderModel", "T5Config"),  # token embeddings
}
GUIDANCE_EMBED = True  # FLUX.1-dev is guidance-distilled: it takes the guidance value as an embedding
TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
# FLUX.1-dev's scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler): FluxPipeline shifts by e^mu, mu
# linear in the image token count (lean.models.time_shift); the static shift is unused
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

_ATTN = (
    r"(single_)?transformer_blocks\.\d+\.attn\."
    r"(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
)
# The single-stream blocks fuse the MLP into proj_mlp (in) and proj_out (attention + MLP out).
_FFN = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)|single_transformer_blocks\.\d+\.(proj_mlp|proj_out)"


def _vae(channels: tuple[int, ...], layers_per_block: int, groups: int) -> dict:
    """FLUX's AutoencoderKL at a given width, with its published latent scale and shift."""
    return kl_vae_config(channels, layers_per_block, groups, scaling_factor=0.3611, shift_factor=0.1159)


_T5 = dict(feed_forward_proj="gated-gelu", dropout_rate=0.0)  # T5 v1.1, as FLUX uses
SIZES = {
    "tiny": dict(
        transformer=dict(
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
        vae=_vae((8, 16, 16), 1, 4),  # 4x downsampling: 32 px -> 8x8 latent -> 16 tokens
        text_encoder=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        text_encoder_2=dict(d_model=32, d_kv=16, num_heads=2, d_ff=64, num_layers=1, **_T5),
    ),
    "small": dict(
        transformer=dict(
            in_channels=64,
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=64,
            pooled_projection_dim=64,
            guidance_embeds=True,
            axes_dims_rope=(8, 12, 12),
        ),
        vae=_vae((16, 32, 32, 32), 1, 8),  # 8x like the real one: 256 px -> 32x32 latent -> 256 tokens
        text_encoder=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
        text_encoder_2=dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, **_T5),
    ),
    "medium": dict(  # GPU benchmarks: FLUX's block structure at 1/2 width, 4 + 8 blocks (~0.5B); 512 px -> 1024 tokens
        transformer=dict(
            in_channels=64,
            num_layers=4,
            num_single_layers=8,
            attention_head_dim=128,
            num_attention_heads=12,
            joint_attention_dim=512,
            pooled_projection_dim=256,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
        vae=_vae((16, 32, 32, 32), 1, 8),
        text_encoder=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4),
        text_encoder_2=dict(d_model=512, d_kv=64, num_heads=8, d_ff=1024, num_layers=2, **_T5),
    ),
    "full": dict(  # FLUX.1-dev as published: 11.9B transformer, CLIP ViT-L/14 text tower, T5 v1.1 XXL encoder
        transformer=dict(
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
        vae=_vae((128, 256, 512, 512), 2, 32),
        text_encoder=dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, projection_dim=768
        ),
        text_encoder_2=dict(d_model=4096, d_kv=64, num_heads=64, d_ff=10240, num_layers=24, **_T5),
    ),
}


def lora_targets(ffn: bool) -> str:
    """Regex (peft full-match) of the adapted linear layers: attention + context projections, optionally the MLPs."""
    return f"{_ATTN}|{_FFN}" if ffn else _ATTN


def pack(z: Tensor) -> Tensor:
    """``[B, C, h, w] -> [B, (h/2)(w/2), 4C]``: each 2x2 latent patch becomes one token (row-major)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    """Inverse of :func:`pack` for an ``h x w`` latent."""
    b, _, d = x.shape
    c = d // 4
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


class Flux:
    """FLUX geometry, conditioning and calls for a fixed resolution (``num_frames`` is ignored: images)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int = 1):
        scale = 2 ** (len(vae_config.block_out_channels) - 1)
        self.h = self.w = resolution // scale
        if self.h % 2:
            raise ValueError(f"resolution {resolution} gives an odd {self.h}x{self.w} latent; FLUX packs 2x2 patches")
        self.channels = vae_config.latent_channels
        self.scaling, self.shift = vae_config.scaling_factor, vae_config.shift_factor
        self.has_guidance = transformer_config.guidance_embeds
        self._ids: dict[tuple, tuple[Tensor, Tensor]] = {}

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.channels, self.h, self.w)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return ((self.h // 2) * (self.w // 2), self.channels * 4)

    @property
    def image_seq_len(self) -> int:
        """Image tokens (FluxPipeline's ``latents.shape[1]``, what its dynamic shift depends on)."""
        return (self.h // 2) * (self.w // 2)

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        return pack(noise)

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device
    ) -> PromptEmbeds:
        """T5 last hidden states (no attention mask, as FluxPipeline) + CLIP pooled (eos) vector."""
        ids, _ = tokenize(tokenizers["tokenizer_2"], prompts, max_length, device)
        tokens = encoders["text_encoder_2"](ids)[0]
        clip = encoders["text_encoder"]
        # CLIP is causal, so its eos state does not depend on padding: pad to its full context, like FluxPipeline.
        ids, _ = tokenize(tokenizers["tokenizer"], prompts, clip.config.max_position_embeddings, device)
        return PromptEmbeds(tokens, clip(ids).pooler_output)

    def _positions(self, text_len: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """RoPE positions: image token (i, j) -> (0, i, j); text tokens all at 0. Batch-independent, cached."""
        key = (text_len, device, dtype)
        if key not in self._ids:
            i, j = torch.meshgrid(torch.arange(self.h // 2), torch.arange(self.w // 2), indexing="ij")
            img = torch.stack([torch.zeros_like(i), i, j], dim=-1).reshape(-1, 3)
            self._ids[key] = (img.to(device, dtype), torch.zeros(text_len, 3, device=device, dtype=dtype))
        return self._ids[key]

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, N, 4C]``; ``guidance_embed`` feeds the distilled-guidance embedder (1.0 when unset)."""
        if self.has_guidance:
            guidance = sigma.new_full(sigma.shape, 1.0 if guidance_embed is None else guidance_embed)
        elif guidance_embed is not None:
            raise ValueError("this FLUX transformer has no guidance embedder (guidance_embeds=False)")
        else:
            guidance = None
        img_ids, txt_ids = self._positions(emb.tokens.shape[1], x.device, x.dtype)
        return transformer(
            hidden_states=x,
            encoder_hidden_states=emb.tokens,
            pooled_projections=emb.pooled,
            timestep=sigma,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Images in [-1, 1], ``[B, 3, H, W]``."""
        z = unpack(x, self.h, self.w) / self.scaling + self.shift
        return vae.decode(z, return_dict=False)[0]

    splits_text = True  # sequence parallelism splits the text tokens too (joint attention)

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
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


ARCH = Flux  # the runtime class lean.models.build_policy instantiates
