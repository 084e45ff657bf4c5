"""A run's configuration, read and checked: :func:`load_config` is ``lean.config.read_config`` then :func:`validate`.

``lean.config`` holds the mechanism; each section is declared and registered beside what it configures (:data:`OWNERS`
imports them, so the sections and the registries their ``choice`` fields name are filled) and checks each field
alone; the rules that span sections live with the module that owns them, and :data:`RULES` lists them in the order
they run. Each takes the config and the number of processes (None: not known yet) and raises a one-line
:class:`~lean.config.ConfigError`. Plugins (entry points, the config's ``plugins:`` list) are imported by
``read_config`` before it reads the sections (``lean.config.plugins``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable

from lean import algorithms, models, rewards, schedules
from lean.algorithms import options as algorithm_options
from lean.config import SECTIONS, ConfigError, RunConfig, dtypes, read_config, run_sections
from lean.models import checks, sequence_parallel
from lean.models import options as model_options
from lean.parallel import grad_sync, layout, sharding
from lean.parallel import options as parallel_options
from lean.parallel.overlap import p2p
from lean.rewards import options as reward_options
from lean.rewards import pickle_servers
from lean.rewards.base import GROUP_REWARDS
from lean.sampling import options as sample_options
from lean.sampling import rollout, sde
from lean.sampling import tree as sample_tree

# The modules that register the sections (lean.config.sections) and the registries the sections' choice fields name
# (lean.config.registry.CATALOG): imported, they are filled.
SECTION_OWNERS = (model_options, sample_options, reward_options, algorithm_options, run_sections, parallel_options)
OWNERS = (
    algorithms,
    dtypes,
    grad_sync,
    layout,
    models,
    p2p,
    rewards,
    rollout,
    schedules,
    sde,
    sharding,
    sample_tree,
    *SECTION_OWNERS,
)


def shared_layout_problem(cfg: RunConfig) -> str | None:
    """What the shared layout (``lean.parallel.layout``) cannot split over ranks exactly, or None: a tree's leaves
    share their trunk's forwards and its edges' advantages, and a group-wise reward scores a group's images together;
    both need a prompt's samples on one process."""
    if sample_tree.tree_shape(cfg.sample) is not None:
        return "a tree's leaves share their trunk's forwards, so a prompt's samples stay on one process: use group"
    if grouped := [name for name in cfg.reward.weights if name in GROUP_REWARDS]:
        return f"the group-wise reward {grouped[0]} scores a group's images together on one process: use group"
    return None


def check_shared_layout(cfg: RunConfig, world_size: int | None = None) -> None:
    if cfg.parallel.layout == layout.SHARED and (problem := shared_layout_problem(cfg)):
        raise ConfigError("parallel.layout", cfg.parallel.layout, problem, [f"parallel.layout={layout.GROUP}"])


Rule = Callable[[RunConfig, "int | None"], None]

RULES: tuple[Rule, ...] = (
    checks.check_config,  # the family: its sizes, frame counts, capabilities, the pretrained folder
    sde.check_config,  # which SDE kind runs on which sigma grid and noise level
    algorithms.check_config,  # what the algorithm runs with (GRPO-Guard: a Gaussian transition)
    pickle_servers.check_config,  # FlowGRPO's pickle reward servers: their names, GenEval's prompt metadata
    rewards.check_config,  # the reward names and the model rewards' folders
    schedules.check_config,  # what each schedule reproduces exactly: on-policy, the algorithm's facts, sharded
    sequence_parallel.check_config,  # the family has it, the processes form its groups
    layout.check_config,  # the batch over the data-parallel ranks, the group layout, the optimizer steps
    check_shared_layout,  # what the shared layout cannot split over ranks: trees, group-wise rewards
    sharding.check_config,  # hsdp's replicas over the processes
)


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    """Raise :class:`~lean.config.ConfigError` on the first bad value: each section's own fields, then
    :data:`RULES`. ``world_size`` (processes; None: not known yet, as if one data-parallel rank) checks that the batch
    divides over the data-parallel ranks (processes / ``parallel.sequence_parallel``)."""
    for name in SECTIONS:
        getattr(cfg, name).validate()
    checks.family_defaults(cfg)  # an editing family's default prompts carry reference images
    for rule in RULES:
        rule(cfg, world_size)


def on_policy_form(cfg: RunConfig) -> RunConfig:
    """``cfg``'s one-step form (``train.on_policy=true``: S rollouts of one optimizer step each, the samples per step
    kept), validated; a new config."""
    form = copy.deepcopy(cfg)
    form.train.on_policy = True
    validate(form)
    return form


def load_config(
    params: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    preset: str | None = None,
    tree: dict | None = None,
    stage: str | None = None,
    variant: str | None = None,
) -> RunConfig:
    """The run config, validated (the layers: ``lean.config.read_config``)."""
    cfg = read_config(params, overrides, preset, tree, stage, variant)
    validate(cfg)
    return cfg
