"""Wan2.2-TI2V-5B's sizes: tiny (tests), small (CPU bench) and full (as published), each with the Wan2.2 VAE.

The Wan2.2 VAE is ``AutoencoderKLWan`` with ``is_residual`` blocks, a 2x2 pixel patchify before the encoder
(``patch_size`` 2: 3 x 2 x 2 = 12 input channels) and 48 latent channels, normalised by its own 48 means and standard
deviations. Its spatial factor is the patchify times 2 per down stage (16 as published: 2 x 2^3), its temporal factor
4 at every size here (the family's ``4k + 1`` frames). The transformer is Wan's ``WanTransformer3DModel`` taking and
returning those 48 channels.
"""

from __future__ import annotations

from typing import Any

from lean.models.sizes import T5_XXL, t5_encoder
from lean.models.spec import Size
from lean.models.wan.sizes import SIZES as WAN_SIZES
from lean.models.wan.sizes import _dit, _vae

CHANNELS = 48  # the Wan2.2 VAE's z_dim, the transformer's in/out channels
PATCH = 2  # the VAE's pixel patchify (patch_size): 3 x 2 x 2 = 12 channels enter its encoder

# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json, as copied into nvidia/Cosmos3-Edge's vae/config.json (whose
# _name_or_path is Wan-AI/Wan2.2-TI2V-5B-Diffusers) and Intel/Wan2.2-TI2V-5B-Diffusers-int4-AutoRound's; both agree.
LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip


def _dit48(**arch: int) -> dict[str, Any]:
    """Wan's transformer config (1x2x2 patches, q/k RMS-norm across heads) on the 48-channel latent."""
    return {**_dit(**arch), "in_channels": CHANNELS, "out_channels": CHANNELS}


def _vae22(
    base_dim: int, decoder_base_dim: int | None, dim_mult: list[int], res_blocks: int, temporal: list[bool]
) -> dict[str, Any]:
    """The Wan2.2 VAE: residual down/up blocks, the 2x2 pixel patchify, 48 latent channels and their statistics;
    spatial factor ``PATCH x 2^(len(dim_mult) - 1)``, temporal ``2^(number of temporal stages)``."""
    spatial = PATCH * 2 ** (len(dim_mult) - 1)
    config = _vae(base_dim, dim_mult, res_blocks, temporal, spatial=spatial)
    assert config["scale_factor_temporal"] == 2 ** sum(temporal)
    return {
        **config,
        "decoder_base_dim": decoder_base_dim,
        "z_dim": CHANNELS,
        "is_residual": True,
        "patch_size": PATCH,
        "in_channels": 3 * PATCH * PATCH,
        "out_channels": 3 * PATCH * PATCH,
        "latents_mean": LATENTS_MEAN,
        "latents_std": LATENTS_STD,
    }


SIZES = {
    "tiny": Size(
        transformer=_dit48(heads=2, head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, layers=1),
        # two stages, both temporal: 2 x 4 = 8x spatial, 4x temporal (5 frames x 32 px -> 2 x 4 x 4 latent -> 8 tokens)
        vae=_vae22(8, None, [1, 1, 1], 1, [True, True]),
        text_encoders=WAN_SIZES["tiny"].text_encoders,
    ),
    "small": Size(
        transformer=_dit48(heads=4, head_dim=32, text_dim=64, freq_dim=64, ffn_dim=256, layers=4),
        vae=_vae22(16, None, [1, 2, 4, 4], 1, [False, True, True]),  # the published 16x spatial, 4x temporal
        text_encoders=WAN_SIZES["small"].text_encoders,
    ),
    # Wan2.2-TI2V-5B as published: 4.99B transformer (3072 = 24 heads x 128; Wan-Video/Wan2.2's
    # wan/configs/wan_ti2v_5B.py: dim 3072, ffn_dim 14336, freq_dim 256, 24 heads, 30 layers, patch (1, 2, 2), VAE
    # stride (4, 16, 16)), the Wan2.2 VAE (base_dim 160, decoder_base_dim 256) and UMT5-XXL
    "full": Size(
        transformer=_dit48(heads=24, head_dim=128, text_dim=4096, freq_dim=256, ffn_dim=14336, layers=30),
        vae=_vae22(160, 256, [1, 2, 4, 4], 2, [False, True, True]),
        text_encoders=dict(text_encoder=t5_encoder(*T5_XXL)),
    ),
}
