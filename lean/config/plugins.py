"""Plugins: code outside ``lean/`` that registers algorithms, model families and rewards (and their options), imported
by :func:`lean.config.read.read_config` before the sections are read: an installed package's entry points in
:data:`ENTRY_POINT_GROUPS` (a module, or an object of one, that registers itself when imported), and the config's
``plugins:`` list of module names (``--set plugins=[my_pkg.algo]``) for a module only on ``PYTHONPATH``."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

from lean.config.checks import ConfigError

ENTRY_POINT_GROUPS = ("lean.algorithms", "lean.families", "lean.rewards")
PLUGINS = "plugins"  # the config's top-level key: a list of module names


@functools.cache  # once per process (listing the installed packages' entry points takes ~0.1 s); not after an error
def load_entry_points() -> None:
    for group in ENTRY_POINT_GROUPS:
        for point in importlib.metadata.entry_points(group=group):
            _import(f"entry point {group}:{point.name}", point.value, point.load)


def import_plugins(modules: Any) -> None:
    """Import the modules of the config's ``plugins:`` list (a module imported once stays imported)."""
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(PLUGINS, modules, "must be a list of module names (my_pkg.my_algorithm)")
    for module in modules:
        _import(PLUGINS, module, functools.partial(importlib.import_module, module))


def _import(key: str, value: str, load: Callable[[], Any]) -> None:
    """``load()``; any failure is the plugin's, a one-line :class:`ConfigError` naming it."""
    try:
        load()
    except Exception as err:
        first = (str(err).splitlines() or [""])[0]
        raise ConfigError(key, value, f"failed to import: {type(err).__name__}: {first}") from None
