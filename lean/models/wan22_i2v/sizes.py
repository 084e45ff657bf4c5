"""Wan2.2-I2V-A14B's sizes, per expert (both experts share the architecture): Wan2.1-I2V's transformer on the same
36 channels without the CLIP cross-attention (``image_dim`` None), Wan2.1's VAE and UMT5.

The full size is diffusers' conversion of Wan2.2-I2V-A14B (huggingface/diffusers@7d56827
scripts/convert_wan_to_diffusers.py, ``get_transformer_config("Wan2.2-I2V-14B-720p")``: 40 heads x 128, ffn 13824,
40 layers, in_channels 36, out_channels 16, added_kv_proj_dim None); the tiny and small sizes are Wan2.1-I2V's
without the image encoder.
"""

from __future__ import annotations

from lean.models.spec import Size
from lean.models.wan.sizes import SIZES as WAN_SIZES
from lean.models.wan21_i2v.sizes import dit_i2v

SIZES = {
    "tiny": Size(
        transformer=dit_i2v(None, heads=2, head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, layers=1),
        vae=WAN_SIZES["tiny"].vae,
        text_encoders=WAN_SIZES["tiny"].text_encoders,
    ),
    "small": Size(
        transformer=dit_i2v(None, heads=4, head_dim=32, text_dim=64, freq_dim=64, ffn_dim=256, layers=4),
        vae=WAN_SIZES["small"].vae,
        text_encoders=WAN_SIZES["small"].text_encoders,
    ),
    "full": Size(  # each expert of Wan2.2-I2V-A14B; the Wan2.1 VAE (z_dim 16) and UMT5-XXL
        transformer=dit_i2v(None, heads=40, head_dim=128, text_dim=4096, freq_dim=256, ffn_dim=13824, layers=40),
        vae=WAN_SIZES["full"].vae,
        text_encoders=WAN_SIZES["full"].text_encoders,
    ),
}
