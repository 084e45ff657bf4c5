"""Sampling: the SDE step with its log-probability and the step selections (``sde``), the one sampling loop
(``rollout``)."""
