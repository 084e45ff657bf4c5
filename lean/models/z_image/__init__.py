"""Z-Image (Tongyi-MAI; Z-Image-Turbo and the base Z-Image): :data:`SPEC` (``spec.py``), the runtime :class:`ZImage`
(``model.py``: geometry, conditioning, the transformer call) and the size table (``sizes.py``). No sequence
parallelism yet (see ``spec.py``)."""

from lean.models.z_image.model import ZImage
from lean.models.z_image.spec import SPEC

__all__ = ["SPEC", "ZImage"]
