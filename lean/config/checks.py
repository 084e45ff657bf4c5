"""The one error of configuration and the checks the sections share. A :class:`ConfigError` is one line naming the
key, the value and what is allowed (the CLI prints it and exits with status 2). A field that names something (a
schedule, a model family, ...) is a :func:`choice` of its kind's registry, read through ``catalog``: no owner imported.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any

from lean.config.prompts import read_prompts
from lean.config.registry import catalog

AUTO = "auto"  # train.schedule: lean picks the fastest predicted schedule that fits (lean.schedules); layouts too


class ConfigError(ValueError):
    """A bad configuration value. ``str(err)`` is a single line meant for the user. ``fix``: the overrides
    (``key=value``) that a refusal suggests, which make the refused config pass on its key (tests/test_refusals.py
    applies every one)."""

    def __init__(self, key: str, value: Any, allowed: str, fix: list[str] | None = None):
        self.key, self.value, self.allowed, self.fix = key, value, allowed, fix
        super().__init__(f"config error: {key}={value!r}: {allowed}")


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option closest to ``name``, if any is close."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return close[0] if close else None


def did_you_mean(close: str | None) -> str:
    return f" (did you mean {close!r}?)" if close else ""


def suggest(name: str, options: Iterable[str]) -> str:
    return did_you_mean(closest(name, options))


def check_choice(key: str, value: Any, options: Iterable[str]) -> None:
    options = list(options)
    if value not in options:
        close = closest(str(value), options)
        allowed = f"must be one of {', '.join(map(str, options))}{did_you_mean(close)}"
        raise ConfigError(key, value, allowed, [f"{key}={close}"] if close else None)


def check_positive(key: str, value: float, strict: bool = True) -> None:
    if (value <= 0) if strict else (value < 0):
        raise ConfigError(key, value, "must be > 0" if strict else "must be >= 0")


def check_fraction(key: str, value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(key, value, "must be in [0, 1)")


def prompts_of_file(key: str, path: str) -> list[str]:
    """``read_prompts(path)``; a missing, empty or malformed file is a config error of ``key``."""
    try:
        return read_prompts(path)
    except (OSError, ValueError) as err:
        raise ConfigError(key, path, str(err)) from None


def choice(kind: str, default: str | None = None, *, also: tuple[str, ...] = ()) -> Any:
    """A field naming an entry of the registry of ``kind`` (or one of ``also``); without ``default``, the registry's
    first (so a name is spelled in its owner only)."""
    metadata = {"registry": kind, "also": also}
    if default is not None:
        return dataclasses.field(default=default, metadata=metadata)
    return dataclasses.field(default_factory=lambda: catalog(kind).default, metadata=metadata)


def choices(section: Any, prefix: str) -> None:
    """Check every :func:`choice` field of ``section`` against its registry (keys ``<prefix>.<field>``)."""
    for f in dataclasses.fields(section):
        if "registry" in f.metadata:
            allowed = [*catalog(f.metadata["registry"]), *f.metadata["also"]]
            check_choice(f"{prefix}.{f.name}", getattr(section, f.name), allowed)
