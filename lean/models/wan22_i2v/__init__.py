"""Wan2.2 image-to-video A14B: :data:`SPEC` (``spec.py``), two experts (``transformer`` for high noise,
``transformer_2`` for low noise, switched at the published boundary 0.9) of Wan2.1-I2V's architecture without its
CLIP cross-attention, on Wan2.1-I2V's runtime (``lean.models.wan21_i2v``: the image's VAE latent and mask beside the
noisy latent), Wan2.1's VAE and UMT5, with the size table of ``sizes.py``."""

from lean.models.wan22_i2v.spec import SPEC

__all__ = ["SPEC"]
