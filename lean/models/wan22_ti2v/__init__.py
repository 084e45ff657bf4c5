"""Wan2.2-TI2V-5B in text-to-video mode: :data:`SPEC` (``spec.py``), one dense WanTransformer3DModel on the Wan2.2
VAE's 48-channel latents (16x spatial, 4x temporal), conditioned like Wan2.1 on UMT5; the runtime :class:`Wan22TI2V`
(``model.py``: Wan's, with WanPipeline's per-token timestep) and the size table (``sizes.py``)."""

from lean.models.wan22_ti2v.model import Wan22TI2V
from lean.models.wan22_ti2v.spec import SPEC

__all__ = ["SPEC", "Wan22TI2V"]
