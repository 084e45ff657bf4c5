"""lean.tracking: off by default and import-free, a real MLflow run when on (SQLite store of the test), a failing
store that warns once and never stops the caller, and the store location rules."""

import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from lean import tracking

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module: creating one runs MLflow's migrations (seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _fresh_tracking(monkeypatch, store):
    monkeypatch.delenv("LEAN_TRACKING", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    tracking.reset()
    yield
    tracking.reset()


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])


def test_off_by_default_never_imports_mlflow():
    code = ("import sys; from lean import tracking; run = tracking.start_run('x', params={'a': 1}); "
            "run.log_metrics({'m': 1.0}, step=0); run.child('c').finish(); run.finish(); "
            "assert run.run_id is None and not tracking.enabled(); assert 'mlflow' not in sys.modules, 'imported'")
    env = {k: v for k, v in os.environ.items() if k != "LEAN_TRACKING"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("LEAN_TRACKING", "1")
    assert tracking.enabled()
    tracking.configure(enabled=False)  # an explicit choice wins
    assert not tracking.enabled()


def test_store_location(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo"))
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path / 'repo' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.tracking_uri() == "http://127.0.0.1:5000"


def test_flatten():
    assert tracking.flatten({"model": {"family": "flux", "lora": {"r": 8}}, "x": 1, "empty": {}}) == {
        "model.family": "flux", "model.lora.r": 8, "x": 1, "empty": {}}


def test_run_with_tags_params_metrics_child_and_figure(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("DVC_STAGE", "train@retain")
    tracking.configure(enabled=True, experiment="lean-test")
    with tracking.start_run("train[retain]", schedule="retain", params={"train": {"lr": 0.001}}) as run:
        for step in range(3):
            run.log_metrics({"reward_mean": 0.5 + step / 10, "label": "skipped", "flag": True}, step=step)
        with run.child("bench[retain]", schedule="retain") as child:
            child.log_metrics({"speedup": 1.5})
        fig, ax = plt.subplots()
        ax.plot([0, 1])
        run.log_figure(fig, "curve.png")
        run_id = run.run_id
    client = _client()
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.data.tags["lean.stage"] == "train@retain" and got.data.tags["lean.schedule"] == "retain"
    assert got.data.params["train.lr"] == "0.001"
    history = client.get_metric_history(run_id, "reward_mean")
    assert [m.step for m in history] == [0, 1, 2] and history[-1].value == pytest.approx(0.7)
    assert "label" not in got.data.metrics and "flag" not in got.data.metrics
    children = client.search_runs([got.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert [c.data.metrics["speedup"] for c in children] == [1.5]
    assert [a.path for a in client.list_artifacts(run_id, "figures")] == ["figures/curve.png"]


def test_unreachable_store_warns_once_and_continues(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    tracking.configure(enabled=True)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = tracking.start_run("x", params={"a": 1})
        run.log_metrics({"m": 1.0})
        tracking.start_run("y").finish()
    assert time.perf_counter() - start < 60
    assert run.run_id is None and not tracking.enabled()
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning) and "lean.tracking" in str(w.message)]) == 1


@pytest.mark.timeout(120)
def test_train_logs_every_iteration():
    from conftest import tiny
    from lean.train import train

    tracking.configure(enabled=True)
    tracking.configure(experiment="lean-test-train")
    history = train(tiny("train.iterations=2", "train.schedule=retain"), out="out")
    client = _client()
    experiment = client.get_experiment_by_name("lean-test-train")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["lean.schedule"] == "retain" and run.info.status == "FINISHED"
    curve = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "reward_mean"), key=lambda m: m.step)]
    assert curve == pytest.approx([row["reward_mean"] for row in history])
    assert run.data.params["model.family"] == "flux"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"metrics.csv", "metrics.json"}
