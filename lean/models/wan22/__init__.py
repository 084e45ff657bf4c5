"""Wan2.2 text-to-video A14B: :data:`SPEC` (``spec.py``), two experts of Wan2.1-14B's architecture (``transformer``
for high noise, ``transformer_2`` for low noise, switched at the published boundary) on Wan2.1's runtime, VAE and
UMT5 (``lean.models.wan``), with the size table of ``sizes.py``."""

from lean.models.wan22.spec import SPEC

__all__ = ["SPEC"]
