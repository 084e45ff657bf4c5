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
