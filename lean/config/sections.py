"""The run's sections, assembled from what their owners register (:func:`register_options`).

A dataclass is registered at a key: a section (``model``) or a group nested in a registered one (``algorithm.mixgrpo``,
declared in ``lean/algorithms/mixgrpo.py``), so a new algorithm with options touches its own file only. The type of a
key (:func:`options_type`; the run's is ``""``) is its dataclass with the groups below it as nested fields, cached per
composition; its instances pickle by value (the receiver rebuilds the type from the groups' own classes)."""

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
    """A run's configuration: one attribute per registered section (``cfg.model.family``, ``cfg.optimizer.lr``, ...)."""

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
        known = OPTIONS.get(key, cls)  # the same class again (its module reloaded) replaces it
        if (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"options {key!r} are registered twice ({known.__module__}, {cls.__module__})")
        OPTIONS[key] = cls
        return cls

    return add


def _groups(key: str) -> list[str]:
    """The names registered directly below ``key`` (for the run's ``""``: the sections, in :data:`ORDER`)."""
    prefix = f"{key}." if key else ""
    names = [k[len(prefix) :] for k in OPTIONS if k.startswith(prefix) and "." not in k[len(prefix) :]]
    return names if key else sorted(names, key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))


def options_type(key: str = "") -> type:
    """The dataclass of ``key`` with its registered groups as nested fields (the registered class itself if none)."""
    groups = tuple((name, options_type(f"{key}.{name}" if key else name)) for name in _groups(key))
    return _assemble(key, OPTIONS[key] if key else RunConfig, groups)


@functools.cache
def _assemble(key: str, base: type, groups: tuple[tuple[str, type], ...]) -> type:
    if not groups:
        return base
    names = tuple(name for name, _ in groups)
    if taken := sorted({f.name for f in dataclasses.fields(base)} & set(names)):
        raise ValueError(f"options {key!r}: groups {taken} clash with fields of {base.__name__}")

    def validate(self, *key_arg: str) -> None:
        """The base's own checks, then each group's (``validate("<key>.<group>")``; a section's takes no key)."""
        if hasattr(base, "validate"):
            base.validate(self, *key_arg)
        prefix = key_arg[0] if key_arg else key
        for name in names:
            getattr(self, name).validate(*([f"{prefix}.{name}"] if prefix else []))

    def reduce(self) -> tuple:
        return _rebuild, (key, base, names, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    fields = [(name, tp, dataclasses.field(default_factory=tp)) for name, tp in groups]
    namespace = {"validate": validate, "__reduce__": reduce, "__module__": base.__module__}
    namespace["__qualname__"] = base.__qualname__
    return dataclasses.make_dataclass(base.__name__, fields, bases=(base,), namespace=namespace)


def _rebuild(key: str, base: type, names: tuple[str, ...], values: dict[str, Any]) -> Any:
    """An assembled instance from its values (unpickled, the groups' own classes have registered again)."""
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
