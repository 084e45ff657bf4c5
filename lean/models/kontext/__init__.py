"""FLUX.1 Kontext [dev] (Black Forest Labs): FLUX.1 conditioned on a reference image for editing. :data:`SPEC`
(``spec.py``) and the runtime :class:`Kontext` (``model.py``: the reference's latent tokens beside the noisy ones)."""

from lean.models.kontext.model import Kontext
from lean.models.kontext.spec import SPEC

__all__ = ["SPEC", "Kontext"]
