"""Plugins: code outside ``lean/`` that registers algorithms, model families and rewards (and their options).

Two ways in, both read by :func:`lean.config.read.read_config` before the sections are: an installed package's entry
points in the groups :data:`ENTRY_POINT_GROUPS` (each names a module, or an object of one, that registers itself when
imported), and the config's top-level ``plugins:`` list of importable module names (``--set plugins=[my_pkg.algo]``)
for a module that is not installed, only on ``PYTHONPATH``. A plugin that fails to import is a one-line
:class:`ConfigError` naming it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Any

from lean.config.checks import ConfigError

ENTRY_POINT_GROUPS = ("lean.algorithms", "lean.families", "lean.rewards")
PLUGINS = "plugins"  # the config's top-level key: a list of module names


@functools.cache  # once per process (listing the installed packages' entry points takes ~0.1 s); not after an error
def load_entry_points() -> None:
    """Import every entry point of :data:`ENTRY_POINT_GROUPS`."""
    for group in ENTRY_POINT_GROUPS:
        for point in importlib.metadata.entry_points(group=group):
            _import(f"entry point {group}:{point.name}", point.value, point.load)


def import_plugins(modules: Any) -> None:
    """Import the modules of the config's ``plugins:`` list (a module imported once stays imported)."""
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(PLUGINS, modules, "must be a list of module names (my_pkg.my_algorithm)")
    for module in modules:
        _import(PLUGINS, module, lambda module=module: importlib.import_module(module))


def _import(key: str, value: str, load) -> None:
    try:
        load()
    except Exception as err:  # any failure of a plugin's import is the plugin's, reported in one line
        first = (str(err).splitlines() or [""])[0]
        raise ConfigError(key, value, f"failed to import: {type(err).__name__}: {first}") from None
