"""Wan2.2-T2V-A14B's sizes, per expert (both experts share the architecture): tiny and small are Wan2.1's; full is
Wan2.1-T2V-14B's transformer (each expert 14B as published), the Wan2.1 VAE and UMT5-XXL."""

from __future__ import annotations

from lean.models.spec import Size
from lean.models.wan.sizes import SIZES as WAN_SIZES
from lean.models.wan.sizes import _dit

SIZES = {
    "tiny": WAN_SIZES["tiny"],
    "small": WAN_SIZES["small"],
    "full": Size(  # from memory: Wan2.2-T2V-A14B-Diffusers' transformer{,_2}/config.json (5120 = 40 heads x 128)
        transformer=_dit(heads=40, head_dim=128, text_dim=4096, freq_dim=256, ffn_dim=13824, layers=40),
        vae=WAN_SIZES["full"].vae,  # T2V-A14B keeps the Wan2.1 VAE (z_dim 16); only TI2V-5B has the Wan2.2 VAE
        text_encoders=WAN_SIZES["full"].text_encoders,
    ),
}
