"""Shared test set-up: tiny configs, few threads, and nothing written to the user's outputs or MLflow store."""

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)  # relative outputs/ land in the test's own folder


def tiny(*overrides: str, **tree) -> "RunConfig":  # noqa: F821
    """A fast run config: tiny model, 4 steps, 2 prompts x 2 samples."""
    from lean.config import load_config

    base = ["train.prompts_per_iteration=2", "train.group_size=2", "train.rollout_batch_size=4",
            "train.train_batch_size=4", "sample.num_steps=4", "train.iterations=1"]
    return load_config(None, [*base, *overrides])
