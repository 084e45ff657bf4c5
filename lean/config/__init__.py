"""Typed run configuration: ``params.yaml`` + ``--preset`` + a stage's ``run:`` + ``--set`` -> :class:`RunConfig`.

The mechanism only, at the bottom of the house: it imports no domain module (``tests/test_architecture.py``).

    checks.py        ConfigError, suggest, check_*, choice/choices (fields named by a registry), prompts_of_file
    sections.py      RunConfig and register_options: the sections and their nested option groups, as registered
    read.py          read_params, read_config: files, presets, a stage's run:, --set overrides, type coercion
    moved.py         MOVED: a key that moved answers with its new place; relocated: an old tree at the new places
    plugins.py       entry points and the config's plugins: list
    run_sections.py  train, optimizer, ema, checkpoint, eval: their owners (lean.run, lean.train, ...) sit above
    registry.py, dtypes.py, prompts.py, presets/: the registries, the dtypes, prompt files, the recipes

Every other section is registered beside what it configures (``lean.models.options``, ``lean.sampling.options``,
``lean.rewards.options``, ``lean.algorithms.options``, ``lean.parallel.options``); ``lean.configure`` imports them,
composes their cross-section rules and validates.
"""

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
from lean.config.read import read_config, read_params
from lean.config.run_sections import DEFAULT_PROMPTS, TrainConfig
from lean.config.sections import SECTIONS, RunConfig, options_type, register_options

__all__ = ["AUTO", "ConfigError", "DEFAULT_PROMPTS", "MOVED", "SECTIONS", "RunConfig", "TrainConfig", "dtypes"]
__all__ += ["check_choice", "options_type", "prompts_of_file", "read_config", "read_params", "register_options"]
# what a component's options (in lean or in a plugin) declare and check their fields with
__all__ += ["suggest", "check_fraction", "check_positive", "choice", "choices"]
