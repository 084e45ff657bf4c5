"""SD3's sizes: tiny (tests), small (CPU bench) and full (stable-diffusion-3.5-medium as published).

The two CLIP towers have different widths on purpose (as in the real model), so a swapped or mis-padded concat
cannot go unnoticed; the T5 width is the joint text width the CLIP states are zero-padded to.
"""

from __future__ import annotations

from typing import Any

from lean.models.sizes import T5_XXL, clip_text, kl_vae_config, t5_encoder
from lean.models.spec import Size


def _vae(channels: tuple[int, ...], layers_per_block: int, groups: int) -> dict[str, Any]:
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


def _clip(hidden: int, layers: int, heads: int, positions: int, **extra: Any) -> dict[str, Any]:
    """A reduced CLIP text tower with projection: MLP twice the width, projected to the width."""
    extra |= dict(projection_dim=hidden, max_position_embeddings=positions)
    return clip_text(hidden, 2 * hidden, layers, heads, **extra)


SIZES = {
    "tiny": Size(
        transformer=_mmdit(layers=2, heads=2, head_dim=16, text_dim=48, pooled_dim=16 + 24, dual=1, max_patches=64),
        vae=_vae((8, 16, 16, 16), 1, 4),  # 8x like the real one: 32 px -> 4x4 latent -> 4 patches; 512 px -> 1024
        text_encoders=dict(
            text_encoder=_clip(16, layers=2, heads=2, positions=16),
            text_encoder_2=_clip(24, layers=2, heads=2, positions=16, hidden_act="gelu"),
            text_encoder_3=t5_encoder(48, 16, 2, 64, 1),
        ),
    ),
    "small": Size(
        transformer=_mmdit(layers=4, heads=4, head_dim=32, text_dim=96, pooled_dim=32 + 64, dual=2, max_patches=64),
        vae=_vae((16, 32, 32, 32), 1, 8),
        text_encoders=dict(
            text_encoder=_clip(32, layers=2, heads=2, positions=77),
            text_encoder_2=_clip(64, layers=2, heads=4, positions=77, hidden_act="gelu"),
            text_encoder_3=t5_encoder(96, 16, 4, 192, 2),
        ),
    ),
    "full": Size(  # stabilityai/stable-diffusion-3.5-medium as published: MMDiT-X, 24 blocks (0-12 dual), width 1536
        transformer=_mmdit(
            layers=24, heads=24, head_dim=64, text_dim=4096, pooled_dim=768 + 1280, dual=13, max_patches=384
        ),
        vae=_vae((128, 256, 512, 512), 2, 32),
        text_encoders=dict(
            text_encoder=clip_text(768, 3072, 12, 12, projection_dim=768, max_position_embeddings=77),  # CLIP-L
            text_encoder_2=clip_text(  # OpenCLIP ViT-bigG/14
                1280, 5120, 32, 20, projection_dim=1280, max_position_embeddings=77, hidden_act="gelu"
            ),
            text_encoder_3=t5_encoder(*T5_XXL),
        ),
    ),
}
