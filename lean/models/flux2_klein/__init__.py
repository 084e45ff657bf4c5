"""FLUX.2 [klein] (Black Forest Labs): :data:`SPEC` (``spec.py``), the runtime :class:`Flux2Klein` (``model.py``:
FLUX.2's runtime with the Qwen3 text conditioning) and the size table (``sizes.py``, klein 9B as published)."""

from lean.models.flux2_klein.model import Flux2Klein
from lean.models.flux2_klein.spec import SPEC

__all__ = ["SPEC", "Flux2Klein"]
