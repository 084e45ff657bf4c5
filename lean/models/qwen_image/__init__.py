"""Qwen-Image (Alibaba Qwen team): :data:`SPEC` (``spec.py``), the runtime :class:`QwenImage` (``model.py``: geometry,
conditioning, the transformer call) and the size table (``sizes.py``). No sequence parallelism yet (see ``spec.py``)."""

from lean.models.qwen_image.model import QwenImage
from lean.models.qwen_image.spec import SPEC

__all__ = ["SPEC", "QwenImage"]
