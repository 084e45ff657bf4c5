"""FLUX.2 [dev] (Black Forest Labs): :data:`SPEC` (``spec.py``), the runtime :class:`Flux2` (``model.py``: latent
geometry with the VAE's BatchNorm normalisation, 4-D rotary ids, the transformer call, decoding), the Mistral text
conditioning (``text.py``), the empirical time shift (``schedule.py``) and the size table (``sizes.py``). FLUX.2
[klein] (``lean.models.flux2_klein``) reuses all but the text encoder. Both generate from text or edit a reference
image per prompt (``model.edit``: the reference's latent tokens beside the noisy ones, as the pipelines' ``image=``).
No sequence parallelism (``model.NO_SEQUENCE_PARALLEL``)."""

from lean.models.flux2.model import Flux2
from lean.models.flux2.spec import SPEC

__all__ = ["SPEC", "Flux2"]
