"""Thin DVC stage scripts: argument parsing and I/O only; the logic lives in ``lean`` (run as ``python -m pipelines.X``
from the repository root, which puts ``lean`` on the path without installing it)."""
