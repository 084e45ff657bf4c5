"""Typed run configuration: ``params.yaml`` + ``--preset`` + a stage's ``run:`` + ``--set`` -> :class:`RunConfig`.

Everything downstream takes a ``RunConfig`` (or one of its sections), never a raw dict. This package is the bottom of
the house and holds the mechanism only; it imports no domain module (``tests/test_architecture.py``):

    checks.py        ConfigError, suggest, check_*, choice/choices (fields named by a registry), prompts_of_file
    sections.py      RunConfig and register_options: the sections and their nested option groups, as registered
    read.py          read_params, read_config: files, presets, a stage's run:, --set overrides, type coercion
    moved.py         MOVED: keys that moved answer with their new place
    plugins.py       entry points (lean.algorithms, lean.families, lean.rewards) and the config's plugins: list
    run_sections.py  the run-level sections every layer reads (train, eval): they have no owner below configure
    registry.py, dtypes.py, prompts.py, presets/: the registries, the dtypes, prompt files, the recipes

Each section is declared beside what it configures and registered there (``lean.models.options``,
``lean.sampling.options``, ``lean.rewards.options``, ``lean.algorithms.options`` and each algorithm's own group,
``lean.parallel.options``); ``lean.configure`` imports them, composes their cross-section rules and validates.
"""

from __future__ import annotations

from lean.config import dtypes
from lean.config.checks import (
    AUTO,
    ConfigError,
    check_choice,
    check_fraction,
    check_positive,
    choice,
    choices,
    prompts_of_file,
    suggest,
)
from lean.config.moved import MOVED
from lean.config.plugins import PLUGINS
from lean.config.read import apply_override, apply_run_section, read_config, read_params
from lean.config.run_sections import DEFAULT_PROMPTS, EvalConfig, TrainConfig
from lean.config.sections import SECTIONS, RunConfig, options_type, register_options

# Sections that moved to their owners: importing one from here says where it is now.
MOVED_NAMES = {
    "ModelConfig": "lean.models.options",
    "SampleConfig": "lean.sampling.options",
    **dict.fromkeys(("RewardConfig", "RewardModelConfig", "RemoteRewardConfig"), "lean.rewards.options"),
    "AlgorithmConfig": "lean.algorithms.options",
    "MixGRPOConfig": "lean.algorithms.mixgrpo",
    "NFTConfig": "lean.algorithms.nft",
    "DPOConfig": "lean.algorithms.dpo",
    "ParallelConfig": "lean.parallel.options",
}


def __getattr__(name: str):
    if name in MOVED_NAMES:  # an ImportError: `from lean.config import X` would replace an AttributeError's message
        raise ImportError(f"lean.config.{name} moved to {MOVED_NAMES[name]} (import it from there)", name=name)
    raise AttributeError(f"module 'lean.config' has no attribute {name!r}")


__all__ = [
    "AUTO",
    "DEFAULT_PROMPTS",
    "MOVED",
    "PLUGINS",
    "SECTIONS",
    "ConfigError",
    "EvalConfig",
    "RunConfig",
    "TrainConfig",
    "apply_override",
    "apply_run_section",
    "check_choice",
    "check_fraction",
    "check_positive",
    "choice",
    "choices",
    "dtypes",
    "options_type",
    "prompts_of_file",
    "read_config",
    "read_params",
    "register_options",
    "suggest",
]
