"""Wan2.1 text-to-video: :data:`SPEC` (``spec.py``), the runtime :class:`Wan` (``model.py``: video latent geometry,
UMT5 conditioning, the transformer call), the size table (``sizes.py``) and its sequence parallelism
(``sequence_parallel.py``: Ulysses self-attention with the q/k norm across heads)."""

from lean.models.wan.model import Wan
from lean.models.wan.spec import SPEC

__all__ = ["SPEC", "Wan"]
