"""FLUX.2's time shift: the pipelines' ``compute_empirical_mu`` (diffusers' ``pipeline_flux2.py``, from
black-forest-labs/flux2 ``src/flux2/sampling.py``), which replaces the scheduler config's linear mu rule.

mu depends on the image token count N *and* the step count T: above 4300 tokens mu = a2 N + b2; below, mu is the
line in T through mu(N, 200) = a2 N + b2 and mu(N, 10) = a1 N + b1. The sigma grid is then shifted by e^mu
(``time_shift_type`` exponential): sigma' = e^mu sigma / (1 + (e^mu - 1) sigma), as lean's ``sigma_schedule`` shifts.
"""

from __future__ import annotations

A1, B1 = 8.73809524e-05, 1.89833333
A2, B2 = 0.00016927, 0.45666666


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """Flux2Pipeline's / Flux2KleinPipeline's ``compute_empirical_mu(image_seq_len, num_steps)``."""
    if image_seq_len > 4300:
        return float(A2 * image_seq_len + B2)
    m_200 = A2 * image_seq_len + B2
    m_10 = A1 * image_seq_len + B1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)
