"""What is optimised: one file per algorithm behind the contract of ``base.py``, registered once.

Schedules (``lean.schedules``) compute the gradient of whichever algorithm runs; an algorithm whose facts a schedule
needs but does not have is refused at configuration (``lean.schedules.algorithm_problem``). Adding an algorithm is one
new file plus one :data:`ALGORITHMS` line (docs/architecture.md).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from lean.algorithms.awm import AWM
from lean.algorithms.base import CLEAN_SAMPLES, FACTS, ROLLOUT_STEPS, ROLLOUTS, Algorithm, StepLoss, loss_stats
from lean.algorithms.branch_grpo import BranchGRPO
from lean.algorithms.clean_samples import CleanSampleAlgorithm
from lean.algorithms.dpo import DPO
from lean.algorithms.e_grpo import EGRPO
from lean.algorithms.flash_grpo import FlashGRPO
from lean.algorithms.flow_dppo import FlowDPPO
from lean.algorithms.gardo import GARDO
from lean.algorithms.groups import STD_ESTIMATORS
from lean.algorithms.grpo import ALL_ZERO_ADVANTAGES, GRPO, KL_FORMS
from lean.algorithms.grpo_guard import GRPOGuard
from lean.algorithms.mixgrpo import MixGRPO
from lean.algorithms.nft import NFT
from lean.algorithms.reward_combination import REWARD_COMBINATIONS
from lean.algorithms.tempflow_grpo import TempFlowGRPO
from lean.algorithms.tree_grpo import TreeGRPO
from lean.config import ConfigError
from lean.config.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

    from lean.config import RunConfig

ALGORITHMS: Registry[type[Algorithm]] = Registry(
    "algorithm",
    [
        ("grpo", GRPO),  # FlowGRPO's and DanceGRPO's objective, and the default
        ("grpo_guard", GRPOGuard),  # FlowGRPO's GRPO-Guard: RatioNorm and per-step gradient reweighting
        ("mixgrpo", MixGRPO),  # Tencent-Hunyuan's MixGRPO: GRPO on a sliding SDE window of an ODE rollout
        ("nft", NFT),  # NVlabs' DiffusionNFT: negative-aware flow matching on re-noised clean samples
        ("dpo", DPO),  # FlowGRPO's online Diffusion-DPO on each group's best/worst pair
        ("flow_dppo", FlowDPPO),  # UniRL's Flow-DPPO: a Gaussian-KL trust-region mask in place of the ratio clip
        ("branch_grpo", BranchGRPO),  # BranchGRPO (Fredreic1849): GRPO on a tree rollout, depth-wise advantages
        ("flash_grpo", FlashGRPO),  # Flash-GRPO (Shredded-Pork): one drawn SDE step per rollout, rectified gradients
        ("tempflow_grpo", TempFlowGRPO),  # TempFlow-GRPO (Shredded-Pork): branches at one step, noise-aware weights
        ("e_grpo", EGRPO),  # E-GRPO (shengjun-zhang/VisualGRPO): one high-entropy SDE step per rollout, ODE elsewhere
        ("awm", AWM),  # advantage-weighted matching (scxue): an advantage-weighted flow-matching loss, re-noised x_0
        ("gardo", GARDO),  # FlowGRPO's GARDO: gated KL, reference reset, diversity-aware advantages
        ("tree_grpo", TreeGRPO),  # TreeGRPO (zh-ding): GRPO on a tree whose SDE steps branch, leaf-mean advantages
    ],
)


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """The algorithm runs with the other sections' settings (``Algorithm.problem``)."""
    algorithm = ALGORITHMS[cfg.algorithm.name]
    if cfg.sample.tree.branch_points and not algorithm.trains_trees:
        raise ConfigError(
            "sample.tree.branch_points",
            cfg.sample.tree.branch_points,
            f"algorithm.name={cfg.algorithm.name} has one target per sample; a tree's are per edge (branch_grpo)",
        )
    if cfg.train.edges_per_update is not None and not cfg.sample.tree.branch_points:
        raise ConfigError(
            "train.edges_per_update",
            cfg.train.edges_per_update,
            "splits a tree rollout's edges into updates; a flat rollout's: train.optimizer_steps_per_iteration",
            ["train.edges_per_update=null"],
        )
    problem = algorithm.problem(cfg, world_size)
    if problem is not None:
        key, value, allowed, *own = problem  # a problem may name its own fix
        fix = own[0] if own else algorithm.working_overrides(cfg)
        if fix and not own:  # the whole command, so that the line itself runs
            sets = " ".join(f"--set {shlex.quote(o)}" for o in [f"algorithm.name={cfg.algorithm.name}", *fix])
            allowed = f"{allowed}; it runs with: lean train {sets}"
        raise ConfigError(key, value, f"{allowed} (algorithm.name={cfg.algorithm.name})", fix)


def build_algorithm(cfg: RunConfig, sigmas: Tensor | None) -> Algorithm:
    """The run's algorithm (``algorithm.name``) over the sigma grid ``sigmas`` [num_steps + 1] (None: for its
    targets only, as the DVC advantage stage uses it)."""
    return ALGORITHMS[cfg.algorithm.name](cfg, sigmas)


__all__ = [
    "ALGORITHMS",
    "CLEAN_SAMPLES",
    "ROLLOUT_STEPS",
    "CleanSampleAlgorithm",
    "FACTS",
    "KL_FORMS",
    "ALL_ZERO_ADVANTAGES",
    "REWARD_COMBINATIONS",
    "ROLLOUTS",
    "STD_ESTIMATORS",
    "Algorithm",
    "StepLoss",
    "build_algorithm",
    "check_config",
    "loss_stats",
]
