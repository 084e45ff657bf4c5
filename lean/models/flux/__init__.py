"""FLUX.1 (Black Forest Labs): :data:`SPEC` (``spec.py``), the runtime :class:`Flux` (``model.py``: geometry,
conditioning, the transformer call), the size table (``sizes.py``) and its sequence parallelism
(``sequence_parallel.py``: joint Ulysses attention)."""

from lean.models.flux.model import Flux
from lean.models.flux.spec import SPEC

__all__ = ["SPEC", "Flux"]
