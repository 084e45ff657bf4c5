"""Wan's sizes: tiny (tests), small (CPU bench), full (Wan2.1-T2V-1.3B as published) and full-14b (Wan2.1-T2V-14B)."""

from __future__ import annotations

from typing import Any

from lean.models.sizes import T5_XXL, t5_encoder
from lean.models.spec import Size


def _dit(heads: int, head_dim: int, text_dim: int, freq_dim: int, ffn_dim: int, layers: int) -> dict[str, Any]:
    """WanTransformer3DModel: 1x2x2 patches of the 16-channel latent, qk RMS-norm across heads."""
    return dict(
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        text_dim=text_dim,
        freq_dim=freq_dim,
        ffn_dim=ffn_dim,
        num_layers=layers,
        patch_size=(1, 2, 2),
        in_channels=16,
        out_channels=16,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )


def _vae(base_dim: int, dim_mult: list[int], res_blocks: int, temporal: list[bool], spatial: int) -> dict[str, Any]:
    """AutoencoderKLWan: 16 latent channels, 4x temporal compression, ``spatial``x spatial."""
    return dict(
        base_dim=base_dim,
        z_dim=16,
        dim_mult=dim_mult,
        num_res_blocks=res_blocks,
        temperal_downsample=temporal,
        scale_factor_spatial=spatial,
        scale_factor_temporal=4,
    )


SIZES = {
    "tiny": Size(
        transformer=_dit(heads=2, head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, layers=1),
        # two stages, both also temporal: 4x spatial, 4x temporal (5 frames x 32 px -> 2 x 8 x 8 latent -> 32 tokens)
        vae=_vae(8, [1, 1, 1], 1, [True, True], spatial=4),
        text_encoders=dict(text_encoder=t5_encoder(32, 16, 2, 64, 1)),
    ),
    "small": Size(
        transformer=_dit(heads=4, head_dim=32, text_dim=64, freq_dim=64, ffn_dim=256, layers=4),
        vae=_vae(16, [1, 2, 4, 4], 1, [False, True, True], spatial=8),
        text_encoders=dict(text_encoder=t5_encoder(64, 16, 4, 128, 2)),
    ),
    "full": Size(  # Wan2.1-T2V-1.3B as published: 1.42B transformer, Wan-VAE, UMT5-XXL encoder
        transformer=_dit(heads=12, head_dim=128, text_dim=4096, freq_dim=256, ffn_dim=8960, layers=30),
        vae=_vae(96, [1, 2, 4, 4], 2, [False, True, True], spatial=8),
        text_encoders=dict(text_encoder=t5_encoder(*T5_XXL)),
    ),
    # Wan2.1-T2V-14B as published (its transformer/config.json: 40 heads x 128, ffn 13824, 40 layers); the same
    # Wan-VAE and UMT5-XXL. Planned on the meta device (lean plan), LeanGRPO's Fig. 3(f)
    "full-14b": Size(
        transformer=_dit(heads=40, head_dim=128, text_dim=4096, freq_dim=256, ffn_dim=13824, layers=40),
        vae=_vae(96, [1, 2, 4, 4], 2, [False, True, True], spatial=8),
        text_encoders=dict(text_encoder=t5_encoder(*T5_XXL)),
    ),
}
