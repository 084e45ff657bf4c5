"""Second copies of the trainable weights, and swapping them into the policy for a forward.

The EMA's weights (``lean.run.optimizer``) and an algorithm's :class:`Snapshot` (DiffusionNFT's old policy, online
DPO's reference) are read by a forward the same way: copied into the parameters for a block, then copied back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from lean.parallel.sharding import local_mb


@contextlib.contextmanager
def swapped_in(params: list[torch.nn.Parameter], values: list[Tensor]) -> Iterator[None]:
    """Inside the block ``params`` hold ``values`` (copied in place, so every forward reads them), and their own
    values again after it."""
    with torch.no_grad():
        own = [p.detach().clone() for p in params]
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, own):
                p.copy_(v)


class Snapshot:
    """A second copy of the trainable weights that an algorithm samples or compares with: DiffusionNFT's old policy
    (soft-updated towards the trained weights once per rollout), online DPO's reference (copied every k optimizer
    steps). It starts as the weights it is built from; ``Algorithm.snapshot_decay`` says when it moves."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.values = [p.detach().clone() for p in params]

    def blend(self, decay: float) -> None:
        """snapshot <- decay snapshot + (1 - decay) theta (decay 0: a copy)."""
        with torch.no_grad():
            for v, p in zip(self.values, self.params):
                v.lerp_(p.detach(), 1 - decay)

    def swapped_in(self):
        """A block inside which the policy's forward reads the snapshot's weights."""
        return swapped_in(self.params, self.values)

    def resident_mb(self) -> float:
        return local_mb(self.values)
