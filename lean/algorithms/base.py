"""The algorithm axis: what is optimised, apart from how its gradient is computed (``lean.schedules``).

An algorithm declares
  * the sampler it rolls out with (:data:`ROLLOUTS`; GRPO: SDE transitions with their log-probs);
  * how rewards become its targets, one per sample (:meth:`Algorithm.targets`; GRPO: group advantages), and which
    samples an update keeps (:meth:`Algorithm.kept_samples`);
  * the loss of one trained step (:meth:`Algorithm.step_loss`, of a ``lean.sampling.transition.Transition`` and the
    rows' targets): a term linear in the target (``StepLoss.policy``) plus a target-free regulariser (``StepLoss.kl``)
    weighted by :attr:`Algorithm.kl_weight`; which of the rollout's values of a step it reads (:attr:`Algorithm.reads`:
    GRPO the old log-prob, GRPO-Guard the old mean too), which Recompute stores;
  * the facts that decide which schedules run it exactly (:attr:`Algorithm.facts`): Retain needs the on-policy
    ratio to be identically 1, Reweight also needs the loss to be linear in the target (its A / Â fold);
  * a float64 reference of that loss for the certificate (``lean equivalence``): the same :meth:`step_loss`,
    evaluated by a float64 twin of the policy;
  * where it needs them (GARDO): a factor on each sample's regulariser known after the rewards
    (:meth:`Algorithm.regulariser_factors`, weighed by the schedules), its snapshot as the regulariser's reference
    (:attr:`Algorithm.references_snapshot`), a look at each update's statistics (:meth:`Algorithm.end_iteration`)
    and a state carried across iterations, checkpointed with the weights (:meth:`Algorithm.state_dict`).

Adding an algorithm is one file in ``lean/algorithms/`` and one ``ALGORITHMS`` line (``lean/algorithms/__init__.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from lean.config.registry import Registry
from lean.sampling.transition import OLD_LOG_PROB

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.sampling.sde import StepSelection
    from lean.sampling.transition import Transition

ROLLOUTS: Registry[str] = Registry(
    "rollout",
    [
        ("sde", "stochastic SDE transitions x_i -> x_{i+1}, each with its Gaussian log-prob (FlowGRPO, DanceGRPO)"),
        ("ode", "deterministic steps only; the clean samples are what the update trains on (DiffusionNFT)"),
    ],
)
# What an algorithm's update trains on: the rollout's own SDE steps (GRPO and its kin), or its clean samples x_0
# re-noised afresh (NFT, DPO), where no rollout forward is reused
ROLLOUT_STEPS, CLEAN_SAMPLES = "rollout_steps", "clean_samples"

# The facts a schedule may need from an algorithm to reproduce its objective's gradient (Schedule.needs).
RATIO_ONE_ON_POLICY = "ratio_one_on_policy"  # on-policy, the importance ratio is identically 1 (Retain)
LINEAR_IN_TARGET = "linear_in_target"  # the loss's target-dependent part is linear in the target (Reweight)
FACTS = {  # what a schedule needing the fact requires of the algorithm, for messages
    RATIO_ONE_ON_POLICY: "an on-policy ratio identically 1 (the rollout's own graph then gives the gradient)",
    LINEAR_IN_TARGET: "a loss linear in the target (a provisional target is then corrected afterwards)",
}


def step_targets(targets: Tensor, step) -> Tensor:
    """The targets of a step's rows [b]: ``targets`` [B] (one per sample), or [B, num_steps] (one per edge of a tree
    rollout at its first leaf's row: ``lean.sampling.tree``) read at the step's index."""
    return targets[step.rows] if targets.dim() == 1 else targets[step.rows, step.index]


@dataclass
class StepLoss:
    """The per-sample loss terms of one trained step, all [B]."""

    policy: Tensor  # the term that depends on the target (GRPO: the clipped surrogate)
    kl: Tensor | None  # the target-free regulariser (GRPO: the KL to the reference), or None when it is off
    ratio: Tensor  # p_theta / p_old, detached
    # each row's factor on ``kl`` known after the rewards (Algorithm.regulariser_factors), as a schedule weighted it,
    # for the logs; None: 1 (set by the schedules, not by step_loss)
    kl_factor: Tensor | None = None

    def total(self, kl_weight: float, kl_factor: Tensor | None = None) -> Tensor:
        """policy + kl_weight kl, each row's kl times its ``kl_factor`` [B] where given (known after the rewards:
        :meth:`Algorithm.regulariser_factors`)."""
        if self.kl is None:
            return self.policy
        weight = kl_weight if kl_factor is None else (kl_weight * kl_factor).to(self.kl.dtype)
        return self.policy + weight * self.kl


def loss_stats(losses: list[StepLoss], first_update: int | None = None) -> dict[str, float]:
    """Means over all (sample, step) terms, for logging; the ratio's largest distance from 1 over all of them and over
    the first update's (the first ``first_update`` entries; None: all), which is on-policy: 1 up to the rounding of
    its recompute (0 for the schedules that reuse the rollout's graph). With per-row regulariser factors
    (``StepLoss.kl_factor``), ``kl_weighted``: the KL terms' mean weighted by them (GARDO: over its gated terms), and
    its numerator and denominator (``kl_weighted_sum``, ``kl_factor_sum``: summed over processes, their ratio is the
    whole batch's)."""
    if not losses:
        return {}
    pol = torch.cat([loss.policy.detach() for loss in losses])
    ratio = torch.cat([loss.ratio for loss in losses])
    first = torch.cat([loss.ratio for loss in losses[:first_update]] or [torch.ones_like(ratio[:1])])
    stats = {
        "policy_loss": pol.mean(),
        "ratio_mean": ratio.mean(),
        "ratio_max_dev": (ratio - 1).abs().max(),
        "ratio_max_dev_first_update": (first - 1).abs().max(),
    }
    if losses[0].kl is not None:
        kl = torch.cat([loss.kl.detach() for loss in losses])
        stats["kl"] = kl.mean()
        if losses[0].kl_factor is not None:  # the regulariser as the loss weighs it: factor-weighted mean and sums
            factors = torch.cat([loss.kl_factor for loss in losses]).to(kl.dtype)
            weighted, total = (factors * kl).sum(), factors.sum()
            stats["kl_weighted_sum"], stats["kl_factor_sum"] = weighted, total
            stats["kl_weighted"] = weighted / total.clamp_min(torch.finfo(kl.dtype).tiny)
    values = torch.stack([v.double() for v in stats.values()]).tolist()  # one read per update, for the logs
    return dict(zip(stats, values))


class Algorithm:
    """Base class; the module docstring states the contract. One instance per run and sigma grid (the loss of a
    step may depend on its sigma: GRPO's KL forms)."""

    rollout: ClassVar[str] = ROLLOUTS.default
    facts: ClassVar[frozenset[str]] = frozenset()
    # the fields of the rollout's transition (lean.sampling.transition) step_loss reads beyond those a recomputed
    # forward gives: Recompute stores exactly these of every trained step
    reads: ClassVar[frozenset[str]] = frozenset({OLD_LOG_PROB})
    trains_on: ClassVar[str] = ROLLOUT_STEPS  # or CLEAN_SAMPLES (lean.algorithms.clean_samples)
    uses_snapshot: ClassVar[bool] = False  # keeps a second copy of the trainable weights (lean.run.optimizer.Snapshot)
    trains_trees: ClassVar[bool] = False  # its targets are per edge of a tree rollout (lean.sampling.tree)
    # the regulariser's reference is the algorithm's snapshot (GARDO's old adapter, reset now and then), not the base
    # model: the pipeline hands it to the policy (lean.models.policy.Policy.reference_weights); needs uses_snapshot
    references_snapshot: ClassVar[bool] = False
    feedback: ClassVar[tuple[str, ...]] = ()  # the update's logged statistics end_iteration reads (loss_stats keys)

    def __init__(self, cfg: RunConfig, sigmas: Tensor | None):
        self.cfg = cfg.algorithm
        self.sample = cfg.sample
        self.reward_weights = tuple(cfg.reward.weights.values())  # w_k of the reward columns, in reward.weights order
        # [num_steps + 1]: the rollout's grid, on the device (float64 for the reference); None: targets only
        self.sigmas = sigmas

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        """(key, value, what is allowed) of a setting the algorithm cannot run with (on ``world_size`` processes,
        when known), or None."""
        return None

    @classmethod
    def working_overrides(cls, cfg: RunConfig) -> list[str] | None:
        """``key=value`` overrides with which the algorithm runs on ``cfg`` when :meth:`problem` refuses it (its own
        settings that the shared defaults lack: a tree's shape, the rewards it reads), or None. The refusal prints
        them as a whole ``lean train`` command."""
        return None

    @property
    def kl_weight(self) -> float:
        """The weight of the target-free regulariser in the total loss (0: off, and no reference forward runs)."""
        return 0.0

    @classmethod
    def steps(cls, cfg: RunConfig, iteration: int, batch_size: int) -> StepSelection | None:
        """The SDE and trained steps of ``batch_size`` samples at ``iteration`` when the algorithm places them itself
        (MixGRPO's sliding window); None: the sampler's own selection (``sample.*``,
        ``lean.sampling.sde.select_steps``)."""
        return None

    @classmethod
    def prunes(cls, cfg: RunConfig, iteration: int) -> bool:
        """Whether a tree's pruning of the gradient applies at ``iteration`` (``sample.tree.depth_pruning``, the
        algorithm's own): always, unless the algorithm stops it (BranchGRPO's ``pruning_until``)."""
        return True

    def snapshot_decay(self, optimizer_steps: int) -> float | None:
        """With :attr:`uses_snapshot`, before the rollout that follows ``optimizer_steps`` optimizer steps: the decay
        eta of snapshot <- eta snapshot + (1 - eta) theta (0: a copy), or None: the snapshot stays."""
        return None

    @property
    def rolls_out_snapshot(self) -> bool:
        """Whether the rollout samples with the snapshot's weights (NFT's old policy) instead of the trained ones."""
        return False

    @property
    def terms_per_sample(self) -> int | None:
        """K: the loss terms each trained sample contributes where they are not rollout steps (NFT, DPO: their
        draws); None: its trained steps (the step selection's)."""
        return None

    @property
    def untracked_forwards_per_term(self) -> int:
        """Forwards without gradients each loss term needs beside its own (GRPO: the KL's reference), for ``lean
        plan``."""
        return 1 if self.kl_weight else 0

    @property
    def trained_share(self) -> float:
        """The share of the rollout's samples the update trains (DPO: a pair of each group), for ``lean plan``."""
        return 1.0

    @property
    def reads_reward_components(self) -> bool:
        """Whether :meth:`targets` needs each reward's values, not only their weighted sum
        (``algorithm.reward_combination``)."""
        return self.cfg.reward_combination != "sum"

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        """Every sample's target [N] (float64) from the weighted rewards [N] of the whole batch (all processes) and,
        where :attr:`reads_reward_components`, each reward's unweighted values ``components`` [N, R] (columns in
        ``reward.weights`` order)."""
        raise NotImplementedError

    @property
    def weighs_regulariser(self) -> bool:
        """Whether each sample's regulariser term has a factor known only after the rewards
        (:meth:`regulariser_factors`): Reweight then keeps one KL buffer per trajectory, and the factors are the
        whole batch's (its options group declares ``batch_wide``: no group finishes before the last is scored)."""
        return False

    def regulariser_factors(
        self, targets: Tensor, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None
    ) -> Tensor | None:
        """Each sample's factor [N] (float64) on its regulariser term, from the whole batch's ``targets`` [N] (what
        :meth:`targets` returned) and what :meth:`targets` read; called once per iteration, after it. None: 1 each
        (every algorithm that does not :attr:`weighs_regulariser`)."""
        return None

    def end_iteration(self, iteration: int, stats: dict[str, float]) -> None:
        """After the update of ``iteration``: its logged statistics named in :attr:`feedback`, averaged over processes
        (GARDO: the KL that decides when its reference is reset). By default nothing."""

    def state_dict(self) -> dict:
        """What the algorithm carries from one iteration to the next (GARDO: its gate's controller, its reference's
        reset clock), as plain Python values, saved with the weights (``lean.run.optimizer.TrainState``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    @property
    def drops_samples(self) -> bool:
        """Whether :meth:`kept_samples` can leave samples out (then with their regulariser terms)."""
        return False

    @property
    def drops_terms(self) -> bool:
        """Whether :meth:`kept_terms` can leave samples or a tree's edges out (then with their regulariser terms)."""
        return self.drops_samples

    def kept_samples(self, targets: Tensor) -> tuple[Tensor | None, int | Tensor]:
        """(which samples an update keeps [B], or None for all; how many, the N of the objective's 1/(N K))."""
        return None, targets.shape[0]

    def kept_terms(self, targets: Tensor, trained: Tensor, iteration: int) -> tuple[Tensor | None, int | Tensor]:
        """:meth:`kept_samples` of the local ``targets``, or, where the algorithm keeps some of a tree's trained edges
        only (BranchGRPO's width pruning, decided after the rewards), (which trained cells [B, num_steps] the update
        keeps, on the targets' device; the N of 1/(N K)), given the ``trained`` cells [B, num_steps] of
        ``iteration``."""
        return self.kept_samples(targets)

    def step_loss(self, step: Transition, targets: Tensor) -> StepLoss:
        """The loss terms [B] of the trained step ``step`` (its index an int, or one per row): the policy's
        log-prob, mean and std at it, the rollout's values it :attr:`reads` (``old_log_prob``, ...), the reference's
        mean (None: no regulariser); ``targets`` [B] of its rows."""
        raise NotImplementedError

    def reference_loss(self, policy, step, emb, targets: Tensor, kl_factor: Tensor | None = None) -> Tensor:
        """The float64 anchor of the certificate: the total loss [B] of one recorded trained step ``step``
        (a ``lean.sampling.transition.Transition`` holding x_i and x_{i+1}) recomputed by ``policy`` (a float64 twin)
        with the ratio 1 by construction; ``kl_factor`` [B]: the rows' :meth:`regulariser_factors` (passed only to
        an algorithm that :attr:`weighs_regulariser`)."""
        raise NotImplementedError

    def policy_term(self, ratio: Tensor, targets: Tensor) -> Tensor:
        """The target-dependent term at a given ratio [B] (for the logs of a loss backpropagated with a provisional
        target, recomputed with the true one)."""
        raise NotImplementedError
