"""Test set-up: few threads, and nothing written to the user's outputs or MLflow store (shared helpers:
``tests/helpers.py``)."""

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)  # relative outputs/ land in the test's own folder


@pytest.fixture(scope="session")
def clip_folder(tmp_path_factory):
    """A tiny random CLIP folder the model rewards load (``helpers.save_tiny_clip``), built once per session."""
    from helpers import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("clip"))
