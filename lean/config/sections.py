"""The run's sections, assembled from what their owners register: :class:`RunConfig`, :func:`register_options`.

A dataclass of options is registered under a dotted key: a section of the run (``model``: ``lean.models.options``
registers its ``ModelConfig``) or a nested group inside a registered one (``algorithm.mixgrpo``: MixGRPO's window,
declared in ``lean/algorithms/mixgrpo.py``; a reward's or a family's own group under ``reward.<name>`` or
``model.<name>``). The type of a key is its registered dataclass with every group registered below it added as a
nested field (``dataclasses.make_dataclass``), built when the config is read, so a new algorithm with options touches
its own file only. The run itself is key ``""``: :class:`RunConfig` with the sections as fields.

An assembled type is cached per composition and its instances pickle (and deep-copy) by value: the receiving
process rebuilds the same type from the groups' own classes, which import (and register) their owners.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

OPTIONS: dict[str, type] = {}  # "model", "algorithm.mixgrpo", ... -> its dataclass, in registration order
# The order sections are read, checked and written in (config.json, MLflow); a section not listed follows these.
ORDER = ("model", "sample", "reward", "algorithm", "train", "optimizer", "ema", "checkpoint", "parallel", "eval")


@dataclasses.dataclass
class RunConfig:
    """A run's configuration: one attribute per registered section (``cfg.model.family``, ``cfg.train.lr``, ...).
    Its instances are of :func:`options_type` ``("")``, this class with the sections as fields."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def samples_per_iteration(self) -> int:
        return self.train.prompts_per_iteration * self.train.group_size


def register_options(key: str):
    """Class decorator: register the dataclass as the options at ``key`` (a section, or ``<section>.<group>``)."""

    def add(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"options {key!r}: {cls.__name__} is not a dataclass")
        known = OPTIONS.get(key)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"options {key!r} are registered twice ({known.__module__}, {cls.__module__})")
        OPTIONS[key] = cls
        return cls

    return add


def _groups(key: str) -> list[str]:
    """The names of the options registered directly below ``key`` (sections in :data:`ORDER` for the run)."""
    prefix = f"{key}." if key else ""
    names = [k[len(prefix) :] for k in OPTIONS if k.startswith(prefix) and "." not in k[len(prefix) :]]
    if not key:
        names.sort(key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))
    return names


def options_type(key: str = "") -> type:
    """The dataclass of ``key`` with its registered groups as nested fields (the registered class itself if none)."""
    base = RunConfig if not key else OPTIONS[key]
    groups = tuple((name, options_type(f"{key}.{name}" if key else name)) for name in _groups(key))
    return _assemble(key, base, groups)


@functools.cache
def _assemble(key: str, base: type, groups: tuple[tuple[str, type], ...]) -> type:
    if not groups:
        return base
    taken = {f.name for f in dataclasses.fields(base)} & {name for name, _ in groups}
    if taken:
        raise ValueError(f"options {key!r}: groups {sorted(taken)} clash with fields of {base.__name__}")
    names = tuple(name for name, _ in groups)

    def validate(self, *key_arg: str) -> None:
        """The base's own checks, then each group's (``validate("<key>.<group>")``)."""
        if hasattr(base, "validate"):
            base.validate(self, *key_arg)
        prefix = key_arg[0] if key_arg else key
        for name in names:  # a section of the run validates itself with no key
            getattr(self, name).validate(*([f"{prefix}.{name}"] if prefix else []))

    def reduce(self) -> tuple:
        return _rebuild, (key, base, names, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    fields = [(name, tp, dataclasses.field(default_factory=tp)) for name, tp in groups]
    namespace = {"validate": validate, "__reduce__": reduce, "__module__": base.__module__}
    namespace["__qualname__"] = base.__qualname__
    return dataclasses.make_dataclass(base.__name__, fields, bases=(base,), namespace=namespace)


def _rebuild(key: str, base: type, names: tuple[str, ...], values: dict[str, Any]) -> Any:
    """An assembled instance from its values: the type of the groups the values hold (unpickled: registered)."""
    return _assemble(key, base, tuple((name, type(values[name])) for name in names))(**values)


class _Sections(Mapping):
    """Section name -> its assembled type, in :data:`ORDER`: what the owners imported so far registered."""

    def __getitem__(self, name: str) -> type:
        if name not in _groups(""):
            raise KeyError(name)
        return options_type(name)

    def __iter__(self) -> Iterator[str]:
        return iter(_groups(""))

    def __len__(self) -> int:
        return len(_groups(""))


SECTIONS: Mapping[str, type] = _Sections()
