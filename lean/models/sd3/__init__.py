"""Stable Diffusion 3 / 3.5 (Stability AI): :data:`SPEC` (``spec.py``), the runtime :class:`SD3` (``model.py``:
geometry, the three-encoder text conditioning, the transformer call) and the size table (``sizes.py``). No sequence
parallelism yet."""

from lean.models.sd3.model import SD3
from lean.models.sd3.spec import SPEC

__all__ = ["SD3", "SPEC"]
