"""Wan2.1 text-to-video: a DiT over causal-3D-VAE latents ``[C, F', h, w]``, conditioned on UMT5 token embeddings.

Latent layout seen by the policy is the VAE's own ``x [B, C, F', h, w]`` with F' = (F - 1) / t + 1 and h = H / s for the
VAE's temporal / spatial factors t, s (the transformer patchifies 1x2x2 itself). The transformer takes the timestep in
[0, 1000], so it is fed 1000 sigma. Latents are normalised per channel: z = (z_vae - mean) / std, decoded as
z_vae = z std + mean (as diffusers' ``WanPipeline``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.sequence_parallel import SequenceParallel, attention, fused_output, fused_projections, heads_slice
from lean.models.text import PromptEmbeds, tokenize
from lean.overlap.p2p import accumulation_dtype
from lean.overlap.sequence import all_reduce_sum, gather_tokens, split_tokens

DISPLAY_NAME = "Wan"
PIPELINE = "WanPipeline"
COMPONENTS = {  # see lean/models/flux.py
    "transformer": ("diffusers", "WanTransformer3DModel", None),
    "vae": ("diffusers", "AutoencoderKLWan", None),
    "text_encoder": ("transformers", "UMT5EncoderModel", "UMT5Config"),
}
KEEPS_FLOAT32 = True  # WanTransformer3DModel._keep_in_fp32_modules: half-precision runs keep some modules float32
FRAME_STEP = 4  # the causal 3D VAE compresses time 4x: videos have 4k + 1 frames
TOKENIZERS = {"text_encoder": "tokenizer"}
# Wan2.1-T2V-1.3B-Diffusers' scheduler/scheduler_config.json: UniPCMultistepScheduler(use_flow_sigmas, flow_shift=3)
SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler",
    "flow_shift": 3.0,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
}

# Self-attention (attn1) and cross-attention (attn2; its to_k/to_v are the text-context projections; add_k/v_proj
# exist only in the image-conditioned variants).
_ATTN = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)"
_FFN = r"blocks\.\d+\.ffn\.net\.(0\.proj|2)"

_DIT = dict(
    patch_size=(1, 2, 2),
    in_channels=16,
    out_channels=16,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
_UMT5 = dict(feed_forward_proj="gated-gelu", dropout_rate=0.0)
SIZES = {
    "tiny": dict(
        transformer=dict(
            num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, **_DIT
        ),
        # two stages, both also temporal: 4x spatial, 4x temporal (5 frames x 32 px -> 2 x 8 x 8 latent -> 32 tokens)
        vae=dict(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[True, True],
            scale_factor_spatial=4,
            scale_factor_temporal=4,
        ),
        text_encoder=dict(d_model=32, d_kv=16, num_heads=2, d_ff=64, num_layers=1, **_UMT5),
    ),
    "small": dict(
        transformer=dict(
            num_attention_heads=4, attention_head_dim=32, text_dim=64, freq_dim=64, ffn_dim=256, num_layers=4, **_DIT
        ),
        vae=dict(
            base_dim=16,
            z_dim=16,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            scale_factor_spatial=8,
            scale_factor_temporal=4,
        ),
        text_encoder=dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, **_UMT5),
    ),
    "full": dict(  # Wan2.1-T2V-1.3B as published: 1.42B transformer, Wan-VAE, UMT5-XXL encoder
        transformer=dict(
            num_attention_heads=12,
            attention_head_dim=128,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            **_DIT,
        ),
        vae=dict(
            base_dim=96,
            z_dim=16,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=2,
            temperal_downsample=[False, True, True],
            scale_factor_spatial=8,
            scale_factor_temporal=4,
        ),
        text_encoder=dict(d_model=4096, d_kv=64, num_heads=64, d_ff=10240, num_layers=24, **_UMT5),
    ),
}


def lora_targets(ffn: bool) -> str:
    """Regex (peft full-match) of the adapted linear layers: self/cross-attention projections, optionally the MLP."""
    return f"{_ATTN}|{_FFN}" if ffn else _ATTN


class Wan:
    """Wan geometry, conditioning and calls for a fixed resolution and frame count (4k + 1 frames)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int):
        t, s = vae_config.scale_factor_temporal, vae_config.scale_factor_spatial
        if (num_frames - 1) % t:
            raise ValueError(f"num_frames={num_frames}: Wan's VAE needs {t}k + 1 frames")
        self.frames, self.h, self.w = (num_frames - 1) // t + 1, resolution // s, resolution // s
        self.patch = tuple(transformer_config.patch_size)  # (t, h, w)
        self.channels = vae_config.z_dim
        self.mean = torch.tensor(vae_config.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(vae_config.latents_std).view(1, -1, 1, 1, 1)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.channels, self.frames, self.h, self.w)

    latent_shape = noise_shape

    @property
    def image_seq_len(self) -> int:
        """Video tokens: the transformer's ``patch_size`` patches of ``[F', h, w]``."""
        pt, ph, pw = self.patch
        return (self.frames // pt) * (self.h // ph) * (self.w // pw)

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        return noise

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device
    ) -> PromptEmbeds:
        """UMT5 last hidden states with the padding positions zeroed (WanPipeline trims and zero-pads them)."""
        ids, mask = tokenize(tokenizers["tokenizer"], prompts, max_length, device)
        tokens = encoders["text_encoder"](ids, mask).last_hidden_state
        return PromptEmbeds(tokens * mask[..., None].to(tokens.dtype))

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, C, F', h, w]``."""
        if guidance_embed is not None:
            raise ValueError("Wan has no distilled-guidance embedding; use CFG")
        return transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=emb.tokens, return_dict=False)[
            0
        ]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Videos in [-1, 1], ``[B, 3, F, H, W]``."""
        z = x * self.std.to(x) + self.mean.to(x)
        return vae.decode(z, return_dict=False)[0]

    splits_text = False  # sequence parallelism splits the video tokens only (cross-attention reads the whole text)

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
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


ARCH = Wan  # the runtime class lean.models.build_policy instantiates
