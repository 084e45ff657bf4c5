"""The ``algorithm`` section: the algorithm's name and GRPO's keys (registered with ``lean.config.sections``). The
section's type is assembled with the nested option groups the algorithms register in their own files
(``@register_options("algorithm.<name>")``), so a new algorithm with options touches its own file only."""

from __future__ import annotations

from dataclasses import dataclass

from lean.config.checks import AUTO, ConfigError, check_positive, choice, choices
from lean.config.sections import register_options

BATCH_RENORMALISED = ("gdpo", "pref_gdpo")  # the reward combinations renormalised over the whole batch


@register_options("algorithm")
@dataclass
class AlgorithmConfig:
    """What is optimised (``lean.algorithms``): the algorithm and GRPO's keys (``lean/algorithms/grpo.py``: the group
    advantages, the clipped surrogate and the KL term), which grpo, grpo_guard and mixgrpo share. Each algorithm's own
    keys are a nested group it registers in its file (``algorithm.mixgrpo``, ``algorithm.nft``, ``algorithm.dpo``)."""

    name: str = choice("algorithm")
    """A name of ``lean.algorithms.ALGORITHMS``."""
    clip_range: float = 1e-4
    """PPO's clip range c of the surrogate max(-A r, -A clip(r, 1 - c, 1 + c))."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to [-adv_clip_max, adv_clip_max]."""
    global_std: bool = False
    """Normalise advantages by the std of the whole batch instead of the group's."""
    adv_std: str = choice("std estimator")
    """The std of the advantage normalisation: a name of ``lean.algorithms.STD_ESTIMATORS`` (FlowGRPO: population,
    DanceGRPO: unbiased)."""
    adv_eps: float = 1e-4
    """A = (r - mean) / (std + adv_eps) (FlowGRPO 1e-4, DanceGRPO 1e-8)."""
    reward_combination: str = choice("reward combination")
    """How several rewards become one advantage: a name of ``lean.algorithms.REWARD_COMBINATIONS`` (sum: the weighted
    sum is normalised, FlowGRPO; per_reward: each reward is normalised, then weighted and summed, MixGRPO; gdpo: as
    per_reward with std floored at 1e-6, then renormalised over the batch, Flow-Factory; pref_gdpo: Pref-GRPO's, the
    unbiased std + 1e-8 in both). The same with one reward but for the gdpo kinds' renormalisation
    (``lean/algorithms/reward_combination.py``)."""
    beta: float = 0.0
    """KL weight against the reference policy (adapter off)."""
    kl_form: str = choice("KL form")
    """The KL term: a name of ``lean.algorithms.KL_FORMS`` (exact: the KL of the two Gaussian steps; flow_grpo:
    FlowGRPO's SD3/FLUX scripts, which divide by the SDE's noise scale before its sqrt(-dt) factor)."""
    skip_zero_advantage: bool = False
    """Samples whose advantage is 0 (a group with equal rewards) leave the update, and the loss is averaged over the
    others (FlowGRPO's SD3, Fast and Wan scripts filter them; its FLUX script does not)."""
    all_zero_advantage: str = choice("all-zero advantage")
    """With ``skip_zero_advantage``, when every sample of a process has advantage 0: a name of
    ``lean.algorithms.ALL_ZERO_ADVANTAGES`` (drop: none is trained, the update's gradient is 0; keep: all are, so the
    KL term keeps acting, as FlowGRPO's Wan script, which adds 1e-6 to their advantages; lean keeps them at 0)."""
    zero_advantage_order: str = choice("zero-advantage order", AUTO, also=(AUTO,))
    """With ``skip_zero_advantage`` and several updates per rollout, a name of
    ``lean.schedules.recompute.ZERO_ADVANTAGE_ORDERS``: ``filter_then_split`` (FlowGRPO: the kept samples are split
    into the updates), ``split_then_filter`` (the updates' samples are drawn from all before the rollout, each update
    drops its zero-advantage ones: what the hybrid schedules need), or ``auto``: the second under a hybrid schedule,
    else the first."""

    def validate(self) -> None:
        choices(self, "algorithm")
        for key in ("clip_range", "adv_clip_max"):
            check_positive(f"algorithm.{key}", getattr(self, key))
        for key in ("adv_eps", "beta"):
            check_positive(f"algorithm.{key}", getattr(self, key), strict=False)
        if self.reward_combination in BATCH_RENORMALISED and self.global_std:
            why = f"{self.reward_combination} normalises by each group's std, then the batch's: set false"
            raise ConfigError("algorithm.global_std", True, why)

    @property
    def batch_wide(self) -> bool:
        """Whether a sample's targets depend on rewards outside its group: the batch's std, or what the algorithm's
        own options group declares (``batch_wide``: GARDO's gate ranks every reward of the batch)."""
        own = getattr(self, self.name, None)  # the algorithm's own group, where it registered one
        renormalised = self.reward_combination in BATCH_RENORMALISED
        return self.global_std or renormalised or bool(getattr(own, "batch_wide", False))
