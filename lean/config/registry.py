"""One registry per kind of name (schedules, algorithms, model families, dtypes, rewards, presets, ...), each in the
one module that owns the names and entered in :data:`CATALOG`: configuration (through :func:`catalog`, importing no
owner), the CLI and the notebooks read the names there, so a new schedule is one new file plus one registry line."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

CATALOG: dict[str, Registry] = {}  # kind -> its registry, filled as the modules that own the names are imported


class Registry(dict[str, T], Generic[T]):
    """``name -> what the name stands for``, in registration order; the first name is the default."""

    def __init__(self, kind: str, entries: Iterable[tuple[str, T]] = ()):
        if kind in CATALOG:
            raise ValueError(f"a registry of {kind}s exists already")
        super().__init__(entries)
        self.kind = kind  # what the names name ("schedule", "model family", ...), for messages
        CATALOG[kind] = self

    @property
    def default(self) -> str:
        return next(iter(self))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REWARDS.register("color_match")``."""

        def add(value: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = value
            return value

        return add

    def get_or_raise(self, name: str) -> T:
        """The entry, or a ``KeyError`` that lists the known names."""
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self)}")
        return self[name]


def catalog(kind: str) -> Registry:
    """The registry of ``kind``; a ``LookupError`` if its owner is not imported yet."""
    if kind not in CATALOG:
        raise LookupError(f"no registry of {kind}s: the module that owns them is not imported (lean.configure does)")
    return CATALOG[kind]
