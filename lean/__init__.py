"""lean: fast, exact diffusion reinforcement learning (LeanGRPO's Recompute, Retain, Reweight) and FlashOverlap
communication overlap. The map of the package is ``docs/architecture.md``."""

__version__ = "0.1.0"
