"""FLUX's sizes: tiny (tests), small (CPU bench), medium (GPU benchmarks) and full (FLUX.1-dev as published)."""

from __future__ import annotations

from typing import Any

from lean.models.sizes import T5_XXL, clip_text, kl_vae_config, t5_encoder
from lean.models.spec import Size


def _vae(channels: tuple[int, ...], layers_per_block: int, groups: int) -> dict[str, Any]:
    """FLUX's AutoencoderKL at a given width, with its published latent scale and shift."""
    return kl_vae_config(channels, layers_per_block, groups, scaling_factor=0.3611, shift_factor=0.1159)


def _mmdit(double: int, single: int, head_dim: int, heads: int, text_dim: int, pooled_dim: int, rope) -> dict:
    """FluxTransformer2DModel: ``double`` double-stream and ``single`` single-stream blocks over 2x2-packed 16-channel
    latents (64 inputs), with the guidance embedder of FLUX.1-dev; ``rope``: the rotary axes (summing to head_dim)."""
    return dict(
        in_channels=64,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim,
        guidance_embeds=True,
        axes_dims_rope=rope,
    )


SIZES = {
    "tiny": Size(
        transformer=_mmdit(1, 1, head_dim=16, heads=2, text_dim=32, pooled_dim=32, rope=(4, 6, 6)),
        vae=_vae((8, 16, 16), 1, 4),  # 4x downsampling: 32 px -> 8x8 latent -> 16 tokens
        text_encoders=dict(
            text_encoder=clip_text(32, 64, layers=1, heads=2),
            text_encoder_2=t5_encoder(32, 16, 2, 64, 1),
        ),
    ),
    "small": Size(
        transformer=_mmdit(2, 4, head_dim=32, heads=4, text_dim=64, pooled_dim=64, rope=(8, 12, 12)),
        vae=_vae((16, 32, 32, 32), 1, 8),  # 8x like the real one: 256 px -> 32x32 latent -> 256 tokens
        text_encoders=dict(
            text_encoder=clip_text(64, 128, layers=2, heads=4),
            text_encoder_2=t5_encoder(64, 16, 4, 128, 2),
        ),
    ),
    "medium": Size(  # GPU benchmarks: FLUX's block structure at 1/2 width, 4 + 8 blocks (~0.5B); 512 px -> 1024 tokens
        transformer=_mmdit(4, 8, head_dim=128, heads=12, text_dim=512, pooled_dim=256, rope=(16, 56, 56)),
        vae=_vae((16, 32, 32, 32), 1, 8),
        text_encoders=dict(
            text_encoder=clip_text(256, 512, layers=2, heads=4),
            text_encoder_2=t5_encoder(512, 64, 8, 1024, 2),
        ),
    ),
    "full": Size(  # FLUX.1-dev as published: 11.9B transformer, CLIP ViT-L/14 text tower, T5 v1.1 XXL encoder
        transformer=_mmdit(19, 38, head_dim=128, heads=24, text_dim=4096, pooled_dim=768, rope=(16, 56, 56)),
        vae=_vae((128, 256, 512, 512), 2, 32),
        text_encoders=dict(
            text_encoder=clip_text(768, 3072, layers=12, heads=12, projection_dim=768),
            text_encoder_2=t5_encoder(*T5_XXL),
        ),
    ),
}
