"""Stable Diffusion 3 / 3.5 (Stability AI): an MMDiT with joint text-image attention over 2x2 patches of a 16-channel
VAE latent, conditioned on three text encoders, as diffusers' ``StableDiffusion3Pipeline`` runs it.

Text conditioning (``encode_text``): two CLIP text towers with projection (``text_encoder`` = CLIP-L,
``text_encoder_2`` = OpenCLIP bigG) and a T5 encoder (``text_encoder_3``). With h_L, h_G the CLIP towers' penultimate
hidden states ``[B, 77, D_L]``, ``[B, 77, D_G]``, p_L, p_G their projected eos vectors and t the T5 last hidden states
``[B, L, D_T]``:

    tokens = concat_seq( pad_to_D_T( concat_feat(h_L, h_G) ), t )     [B, 77 + L, D_T]
    pooled = concat_feat(p_L, p_G)                                     [B, P_L + P_G]

SD3.5 adds qk RMS-norm and, in its first layers, a second (image-only) self-attention per block ("dual attention").
Latent layout seen by the policy: the VAE latent itself, ``x [B, 16, h, w]`` (the transformer patchifies 2x2 itself).
The transformer takes the timestep in [0, 1000], so it is fed 1000 sigma. The VAE latent is normalised as
z = (z_vae - shift) * scale, decoded as z_vae = z / scale + shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.text import PromptEmbeds, tokenize
from lean.models.vae import kl_vae_config

DISPLAY_NAME = "SD3"
PIPELINE = "StableDiffusion3Pipeline"
COMPONENTS = {  # see lean/models/flux.py
    "transformer": ("diffusers", "SD3Transformer2DModel", None),
    "vae": ("diffusers", "AutoencoderKL", None),
    "text_encoder": ("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),  # CLIP ViT-L/14 text tower
    "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),  # OpenCLIP ViT-bigG/14
    "text_encoder_3": ("transformers", "T5EncoderModel", "T5Config"),  # T5 v1.1 XXL encoder
}
TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}  # SD3.5-M's scheduler_config.json

# FlowGRPO's SD3 targets ("attn.to_q", ... matched as module-name suffixes) reach the joint attention `attn` of every
# block, not the SD3.5 dual-attention `attn2`; the regex below selects exactly those modules.
_ATTN = r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_FFN = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)"


def _vae(channels: tuple[int, ...], layers_per_block: int, groups: int) -> dict:
    """SD3's AutoencoderKL at a given width, with its published latent scale and shift."""
    return kl_vae_config(channels, layers_per_block, groups, scaling_factor=1.5305, shift_factor=0.0609)


def _mmdit(layers: int, heads: int, head_dim: int, text_dim: int, pooled_dim: int, dual: int, max_patches: int) -> dict:
    """SD3.5's transformer layout: the caption projection has the model width; the first ``dual`` blocks also carry
    the image-only second attention; qk RMS-norm everywhere; positions up to ``max_patches`` per side, their sin-cos
    table scaled for SD3.5's default 128 x 128 latent (``sample_size``)."""
    return dict(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=pooled_dim,
        pos_embed_max_size=max_patches,
        qk_norm="rms_norm",
        dual_attention_layers=tuple(range(dual)),
        sample_size=128,
    )


_T5 = dict(feed_forward_proj="gated-gelu", dropout_rate=0.0)
# The two CLIP towers have different widths on purpose (as in the real model), so a swapped or mis-padded concat
# cannot go unnoticed; the T5 width is the joint text width the CLIP states are zero-padded to.
SIZES = {
    "tiny": dict(
        transformer=_mmdit(layers=2, heads=2, head_dim=16, text_dim=48, pooled_dim=16 + 24, dual=1, max_patches=64),
        vae=_vae((8, 16, 16, 16), 1, 4),  # 8x like the real one: 32 px -> 4x4 latent -> 4 patches; 512 px -> 1024
        text_encoder=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=16,
            max_position_embeddings=16,
        ),
        text_encoder_2=dict(
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=24,
            max_position_embeddings=16,
            hidden_act="gelu",
        ),
        text_encoder_3=dict(d_model=48, d_kv=16, num_heads=2, d_ff=64, num_layers=1, **_T5),
    ),
    "small": dict(
        transformer=_mmdit(layers=4, heads=4, head_dim=32, text_dim=96, pooled_dim=32 + 64, dual=2, max_patches=64),
        vae=_vae((16, 32, 32, 32), 1, 8),
        text_encoder=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=32,
            max_position_embeddings=77,
        ),
        text_encoder_2=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            projection_dim=64,
            max_position_embeddings=77,
            hidden_act="gelu",
        ),
        text_encoder_3=dict(d_model=96, d_kv=16, num_heads=4, d_ff=192, num_layers=2, **_T5),
    ),
    "full": dict(  # stabilityai/stable-diffusion-3.5-medium as published: MMDiT-X, 24 blocks (0-12 dual), width 1536
        transformer=_mmdit(
            layers=24, heads=24, head_dim=64, text_dim=4096, pooled_dim=768 + 1280, dual=13, max_patches=384
        ),
        vae=_vae((128, 256, 512, 512), 2, 32),
        text_encoder=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            projection_dim=768,
            max_position_embeddings=77,
        ),
        text_encoder_2=dict(
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=20,
            projection_dim=1280,
            max_position_embeddings=77,
            hidden_act="gelu",
        ),
        text_encoder_3=dict(d_model=4096, d_kv=64, num_heads=64, d_ff=10240, num_layers=24, **_T5),
    ),
}


def lora_targets(ffn: bool) -> str:
    """Regex (peft full-match) of the adapted linear layers: joint-attention projections, optionally the MLPs."""
    return f"{_ATTN}|{_FFN}" if ffn else _ATTN


class SD3:
    """SD3 geometry, conditioning and calls for a fixed resolution (``num_frames`` is ignored: images)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int = 1):
        scale = 2 ** (len(vae_config.block_out_channels) - 1)
        self.h = self.w = resolution // scale
        patch, max_patches = transformer_config.patch_size, transformer_config.pos_embed_max_size
        if self.h % patch or self.h // patch > max_patches:
            raise ValueError(
                f"resolution {resolution} gives a {self.h}x{self.h} latent; SD3 needs a multiple of "
                f"{patch} with at most {max_patches} patches per side"
            )
        self.patch = patch
        self.channels = vae_config.latent_channels
        self.scaling, self.shift = vae_config.scaling_factor, vae_config.shift_factor

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.channels, self.h, self.w)

    latent_shape = noise_shape

    @property
    def image_seq_len(self) -> int:
        """Image tokens (StableDiffusion3Pipeline's ``image_seq_len`` for a dynamically shifting scheduler)."""
        return (self.h // self.patch) * (self.w // self.patch)

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        return noise

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device
    ) -> PromptEmbeds:
        """CLIP penultimate states (both towers, padded to their full context, no mask) side by side, zero-padded
        to the T5 width, followed by the T5 last hidden states (``max_length`` tokens, no mask); pooled: the two
        projected CLIP eos vectors side by side. As ``StableDiffusion3Pipeline.encode_prompt`` without clip_skip."""
        clip_len = encoders["text_encoder"].config.max_position_embeddings
        states, pooled = [], []
        for name, tok_name in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
            ids, _ = tokenize(tokenizers[tok_name], prompts, clip_len, device)
            out = encoders[name](ids, output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        ids, _ = tokenize(tokenizers["tokenizer_3"], prompts, max_length, device)
        t5 = encoders["text_encoder_3"](ids)[0]
        clip = torch.cat(states, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return PromptEmbeds(torch.cat([clip, t5], dim=1), torch.cat(pooled, dim=-1))

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, 16, h, w]``."""
        if guidance_embed is not None:
            raise ValueError("SD3 has no distilled-guidance embedding; use CFG")
        return transformer(
            hidden_states=x,
            encoder_hidden_states=emb.tokens,
            pooled_projections=emb.pooled,
            timestep=sigma * 1000,
            return_dict=False,
        )[0]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Images in [-1, 1], ``[B, 3, H, W]``."""
        return vae.decode(x / self.scaling + self.shift, return_dict=False)[0]


ARCH = SD3  # the runtime class lean.models.build_policy instantiates
