"""Reading a run's configuration: ``params.yaml`` + ``--preset`` + a stage's ``run:`` + ``--set`` -> a typed
:class:`~lean.config.sections.RunConfig` (:func:`read_config`), each value checked against its field's annotation."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lean.config.checks import ConfigError, suggest
from lean.config.moved import MOVED
from lean.config.plugins import PLUGINS, import_plugins, load_entry_points
from lean.config.presets import PRESETS
from lean.config.sections import SECTIONS, RunConfig, options_type

# An annotation -> the Python types its values take (a bool is no number; ints widen to floats), the message else.
KINDS = {
    bool: ((bool,), "must be true or false"),
    int: ((int,), "must be an integer"),
    float: ((int, float), "must be a number"),
    str: ((str,), "must be a string"),
    list: ((list,), "must be a list"),
    dict: ((dict,), "must be a mapping"),
}


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (ints widen to floats, nothing else converts); a section's key
    that moved names its new place (:data:`~lean.config.moved.MOVED`)."""
    kind, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if kind in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds, wanted = [a for a in args if a is not type(None)], []
        for kind in kinds:  # the first that takes the value (train.retain.steps: an int, else a word)
            try:
                return _coerce(key, value, kind)
            except ConfigError as err:
                wanted.append(err.allowed.removeprefix("must be "))
        raise ConfigError(key, value, "must be " + " or ".join(wanted))
    if dataclasses.is_dataclass(kind):  # a section, or an entry of one (reward.models.<name>)
        value = {} if value is None else value
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a mapping of keys")
        hints = typing.get_type_hints(kind)
        for k, v in value.items():
            if moved := MOVED.get(f"{key}.{k}"):
                raise ConfigError(f"{key}.{k}", v, f"moved to {moved}")
            if k not in hints:
                raise ConfigError(f"{key}.{k}", v, "unknown key" + suggest(k, hints))
        return kind(**{k: _coerce(f"{key}.{k}", v, hints[k]) for k, v in value.items()})
    if kind not in KINDS:
        raise TypeError(f"unsupported annotation {tp} for {key}")
    allowed_types, allowed = KINDS[kind]
    if not isinstance(value, allowed_types) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(key, value, allowed)
    if kind is list:
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if kind is dict:
        return {_coerce(f"{key} key", k, args[0]): _coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()}
    if kind is float and not math.isfinite(float(value)):
        raise ConfigError(key, value, "must be a finite number")
    return float(value) if kind is float else value


def _check_section(name: str, value: Any, where: str = "") -> None:
    if name not in SECTIONS:
        raise ConfigError(f"{where}{name}", value, "unknown section" + suggest(name, SECTIONS))


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one dotted override ``section.key=value`` (or ``plugins=[...]``) to a raw config tree in place; the
    value is a YAML scalar or flow collection (1, 0.5, true, null, [a, b])."""
    if "=" not in assignment:
        raise ConfigError(assignment, None, "an override must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    if parts != [PLUGINS]:
        _check_section(parts[0], text)
        if len(parts) < 2:
            raise ConfigError(dotted, text, "name a key inside the section, e.g. train.iterations=3")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text  # as written
    else:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
    node = tree
    for part in parts[:-1]:
        node[part] = node.get(part) or {}
        node = node[part]
    node[parts[-1]] = value


def apply_run_section(tree: dict, run: Any, where: str) -> None:
    """A stage's ``run:`` mapping (shaped like the run sections) on top of ``tree``: each key it lists replaces the
    section's value whole (a mapping value such as ``reward.weights`` is never merged)."""
    if run is None:
        return
    if not isinstance(run, Mapping):
        raise ConfigError(where, run, "must be a mapping of run sections")
    for section, keys in run.items():
        _check_section(section, keys, f"{where}.")
        if not isinstance(keys, Mapping):
            raise ConfigError(f"{where}.{section}", keys, "must be a mapping of keys")
        tree[section] = {**(tree.get(section) or {}), **keys}


def _deep_merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``, merging nested sections (but never ``reward.weights``: a preset's reward replaces)."""
    out = dict(base)
    for k, v in top.items():
        merge = isinstance(v, dict) and isinstance(out.get(k), dict) and k != "weights"
        out[k] = _deep_merge(out[k], v) if merge else v
    return out


def read_params(path: str | os.PathLike) -> dict:
    """The whole params file: the run sections and the stages' own sections (``bench``, ``prepare``, ...)."""
    if not Path(path).exists():
        raise ConfigError("--params", str(path), "file does not exist")
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError("--params", str(path), f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError("--params", str(path), "must hold a mapping")
    return tree


def read_config(
    params: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    preset: str | None = None,
    tree: dict | None = None,
    stage: str | None = None,
    variant: str | None = None,
) -> RunConfig:
    """The run config, typed but not yet validated (``lean.configure.load_config`` validates it). Layers, each on top
    of the one before: the run sections of ``params`` (or ``tree``), the preset, the ``stage`` section's ``run:`` of
    ``params`` (then its ``<variant>.run:``), the ``--set`` overrides. The plugins (entry points, then the layers'
    ``plugins:`` list) are imported before the sections are read, so their names and options are registered."""
    whole = read_params(params) if params is not None else {}
    load_entry_points()
    raw = dict(tree) if tree is not None else {k: v for k, v in whole.items() if k in SECTIONS or k == PLUGINS}
    if preset is not None:
        if preset not in PRESETS:
            known = f"; known: {', '.join(PRESETS)}"
            raise ConfigError("--preset", preset, "unknown preset" + suggest(preset, PRESETS) + known)
        raw = _deep_merge(raw, yaml.safe_load(PRESETS[preset].read_text()) or {})
    raw = _deep_merge({}, raw)
    if stage is not None:
        apply_run_section(raw, (whole.get(stage) or {}).get("run"), f"{stage}.run")
        if variant is not None:
            apply_run_section(raw, ((whole.get(stage) or {}).get(variant) or {}).get("run"), f"{stage}.{variant}.run")
    for item in overrides:
        apply_override(raw, item)
    import_plugins(raw.pop(PLUGINS, None) or [])
    for name in raw:
        _check_section(name, raw[name])
    return options_type()(**{name: _coerce(name, raw.get(name), SECTIONS[name]) for name in SECTIONS})
