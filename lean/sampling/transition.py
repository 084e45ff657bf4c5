"""One SDE step of some trajectories as a record: what the rollout hands to a schedule's ``on_step``, what Recompute
stores of a trained step, and what an algorithm's ``step_loss`` reads.

A feature that needs one more input of the loss adds a field here and names it in its algorithm's ``reads``
(``lean.algorithms.base.Algorithm.reads``): Recompute stores exactly the fields the algorithm reads, and the
schedules that reuse the rollout's graph hand it the rollout's transition whole. No signature grows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

# Fields of a rollout's transition an algorithm may read beyond what a recomputed forward gives (Algorithm.reads)
OLD_LOG_PROB, OLD_MEAN = "old_log_prob", "old_mean"
# What a recomputed forward starts from: Recompute stores these for every trained step
RECOMPUTE_INPUTS = ("sample", "next_sample")


@dataclass(kw_only=True)
class Transition:
    """The step i -> i+1 of b trajectories, x_{i+1} ~ N(mean, std^2 I). Latents are [b, ...] (the sample's shape);
    the rollout hands the step of a micro-batch (or the rows of it that a step tracks), Recompute one update
    micro-batch whose rows may sit at different steps.

    A tracked step's ``log_prob`` and ``mean`` carry its graph; ``old_*`` are the rollout's values, detached (the
    rollout's own transition is on-policy: ``old_log_prob = log_prob.detach()``). Fields a step has not computed are
    None (the input of a policy step: ``sample`` and ``index`` only; a recorded trajectory: the two latents).
    """

    index: int | Tensor  # step i: an int for every row, or a LongTensor [b] (one step per row)
    rows: slice | Tensor | None = None  # which trajectories of the local batch: a contiguous slice, or ids [b]
    sample: Tensor  # x_i [b, ...], detached
    next_sample: Tensor | None = None  # x_{i+1} [b, ...], detached (None: not yet sampled)
    log_prob: Tensor | None = None  # log p_theta(x_{i+1} | x_i) [b], averaged over the latent's elements
    mean: Tensor | None = None  # mean of p_theta(x_{i+1} | x_i) [b, ...], in the compute dtype
    std: Tensor | None = None  # std of the Gaussian transition [b, 1, ..., 1], in the compute dtype
    old_log_prob: Tensor | None = None  # log p_old(x_{i+1} | x_i) [b]: the rollout's, detached
    old_mean: Tensor | None = None  # the rollout's mean [b, ...], detached (GRPO-Guard's RatioNorm reads it)
    ref_mean: Tensor | None = None  # the reference policy's mean [b, ...] (the KL term; None: off)
    sigmas: Tensor | None = None  # the grid the step walks [num_steps + 1]: sigma, sigma_next, dt below

    @property
    def size(self) -> int:
        """b: how many trajectories the step holds."""
        return self.rows.stop - self.rows.start if isinstance(self.rows, slice) else len(self.rows)

    @property
    def sigma(self) -> Tensor:
        """sigma_i: a scalar, or [b] for one step per row."""
        return self.sigmas[self.index]

    @property
    def sigma_next(self) -> Tensor:
        """sigma_{i+1}: a scalar, or [b]."""
        return self.sigmas[self.index + 1]

    @property
    def dt(self) -> Tensor:
        """sigma_{i+1} - sigma_i (negative: sampling walks down the grid)."""
        return self.sigma_next - self.sigma

    def on_policy(self) -> Transition:
        """The step as its own old policy: ``old_*`` the detached ``log_prob`` and ``mean`` (the rollout's transition
        in the schedules that reuse its graph; a float64 recompute of it in the certificate)."""
        old_mean = None if self.mean is None else self.mean.detach()
        return dataclasses.replace(self, old_log_prob=self.log_prob.detach(), old_mean=old_mean)
