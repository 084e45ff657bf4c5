"""Wan2.1 image-to-video (Wan2.1-I2V-14B-480P): :data:`SPEC` (``spec.py``), the runtime :class:`WanI2V` (``model.py``:
Wan's, with the conditioning image's VAE latent and mask beside the noisy latent and its CLIP states beside the
text) and the size table (``sizes.py``). Wan2.2-I2V-A14B (``lean.models.wan22_i2v``) runs on the same runtime."""

from lean.models.wan21_i2v.model import WanI2V
from lean.models.wan21_i2v.spec import SPEC

__all__ = ["SPEC", "WanI2V"]
