"""Component configs the families' size tables share: the 16-channel ``AutoencoderKL`` of FLUX and SD3, the T5 v1.1
encoders of all three (UMT5 takes the same arguments) and the CLIP text towers of FLUX and SD3, at any width."""

from __future__ import annotations

from typing import Any

T5_XXL = (4096, 64, 64, 10240, 24)  # T5 v1.1 XXL's encoder (FLUX, SD3) and UMT5-XXL's (Wan): t5_encoder(*T5_XXL)


def kl_vae_config(
    channels: tuple[int, ...], layers_per_block: int, groups: int, *, scaling_factor: float, shift_factor: float
) -> dict[str, Any]:
    """AutoencoderKL config: len(channels) levels (2^(len-1)x downsampling), 16 latent channels, no quant convs."""
    return dict(
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=layers_per_block,
        norm_num_groups=groups,
        latent_channels=16,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


def t5_encoder(d_model: int, d_kv: int, num_heads: int, d_ff: int, num_layers: int) -> dict[str, Any]:
    """A T5 v1.1 (or UMT5) encoder config: gated-GELU feed-forward, no dropout."""
    return dict(
        d_model=d_model,
        d_kv=d_kv,
        num_heads=num_heads,
        d_ff=d_ff,
        num_layers=num_layers,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
    )


def clip_text(hidden: int, intermediate: int, layers: int, heads: int, **extra: Any) -> dict[str, Any]:
    """A CLIP text tower config (``extra``: projection_dim, max_position_embeddings, hidden_act, ...)."""
    return dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads, **extra
    )
