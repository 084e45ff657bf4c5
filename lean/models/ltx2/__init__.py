"""LTX-2 (Lightricks; LTX-2.3 as published for diffusers): :data:`SPEC` (``spec.py``), the runtime :class:`LTX2`
(``model.py``: the joint video and audio state, Gemma-3 and the text connectors, the transformer call, the video and
audio decodes), the size table (``sizes.py``) and its sequence parallelism (``sequence_parallel.py``: the video tokens
split with Ulysses self-attention, the audio stream whole on every process)."""

from lean.models.ltx2.model import LTX2
from lean.models.ltx2.spec import SPEC

__all__ = ["LTX2", "SPEC"]
