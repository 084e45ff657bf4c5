"""Benchmarks behind ``lean bench``: ``schedules`` (Recompute vs Retain vs Reweight, interleaved, with MFU and the
analytic bound) and ``overlap`` (FlashOverlap's collective vs sliced vs flash, next to its timeline model)."""
