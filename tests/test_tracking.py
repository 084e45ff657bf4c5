"""lean.observe.tracking: off by default and import-free, a real MLflow run when on (SQLite store of the test), a
failing store that warns once and never stops the caller, and the store location rules."""

import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from lean.observe import tracking

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
    code = (
        "import sys; from lean.observe import tracking; run = tracking.start_run('x', params={'a': 1}); "
        "run.log_metrics({'m': 1.0}, step=0); run.child('c').finish(); run.finish(); "
        "assert run.run_id is None and not tracking.enabled(); assert 'mlflow' not in sys.modules, 'imported'"
    )
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
        "model.family": "flux",
        "model.lora.r": 8,
        "x": 1,
        "empty": {},
    }


def test_run_with_tags_params_metrics_child_and_figure(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("DVC_STAGE", "train@retain")
    monkeypatch.setenv("DVC_EXP_NAME", "wan-video")  # what `dvc exp run -n wan-video` puts in a stage's environment
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "0123abcd")
    monkeypatch.chdir(ROOT)  # DVC runs a stage at the repository root, beside params.yaml
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
    assert got.data.tags["dvc.exp_name"] == "wan-video" and got.data.tags["dvc.exp_baseline_rev"] == "0123abcd"
    assert got.data.tags["dvc.params_hash"] == tracking.params_hash(ROOT / "params.yaml")
    assert got.data.params["train.lr"] == "0.001"
    history = client.get_metric_history(run_id, "reward_mean")
    assert [m.step for m in history] == [0, 1, 2] and history[-1].value == pytest.approx(0.7)
    assert "label" not in got.data.metrics and "flag" not in got.data.metrics
    children = client.search_runs([got.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert [c.data.metrics["speedup"] for c in children] == [1.5]
    assert [a.path for a in client.list_artifacts(run_id, "figures")] == ["figures/curve.png"]


def test_experiments_are_tagged_as_model_training():
    """New experiments, and existing ones without a kind (or with one MLflow inferred), open on their runs in the
    MLflow UI; a kind a user chose stays."""
    client = _client()
    for name, kind in [("lean-kind-none", None), ("lean-kind-inferred", "genai_development_inferred")]:
        client.create_experiment(name, tags={} if kind is None else {tracking.EXPERIMENT_KIND: kind})
    client.create_experiment("lean-kind-user", tags={tracking.EXPERIMENT_KIND: "genai_development"})
    for name in ("lean-kind-new", "lean-kind-none", "lean-kind-inferred", "lean-kind-user"):
        tracking.reset()
        tracking.configure(enabled=True, experiment=name)
        tracking.start_run("x").finish()
    kinds = {
        name: client.get_experiment_by_name(name).tags.get("mlflow.experimentKind")
        for name in ("lean-kind-new", "lean-kind-none", "lean-kind-inferred", "lean-kind-user")
    }
    assert kinds == {
        "lean-kind-new": "custom_model_development",
        "lean-kind-none": "custom_model_development",
        "lean-kind-inferred": "custom_model_development",
        "lean-kind-user": "genai_development",
    }


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
    assert (
        len([w for w in caught if issubclass(w.category, RuntimeWarning) and "lean.observe.tracking" in str(w.message)])
        == 1
    )


@pytest.mark.timeout(120)
def test_train_logs_every_iteration():
    from helpers import tiny

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


@pytest.mark.timeout(60)
def test_failed_calls_wait_in_the_spool_and_are_replayed_once(monkeypatch, tmp_path):
    """The store fails for a while (injected): those calls go to the spool in order, warned once, and the next call
    that reaches the store sends them first; every step ends up in the store exactly once."""
    tracking.configure(enabled=True, experiment="lean-test-spool")
    monkeypatch.setattr(tracking, "RETRY_AFTER_S", 0.0)
    spool = tmp_path / tracking.SPOOL
    run = tracking.start_run("spooled", spool=spool)
    apply, down = tracking._apply, [False]

    def flaky(entry):
        if down[0]:
            raise ConnectionError("store down")
        apply(entry)

    monkeypatch.setattr(tracking, "_apply", flaky)
    run.log_metrics({"reward_mean": 0.0}, step=0)
    down[0] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.log_metrics({"reward_mean": 1.0}, step=1)
        run.log_params({"train": {"lr": 0.5}})
        run.log_metrics({"reward_mean": 2.0}, step=2)
    assert len([w for w in caught if "lean.observe.tracking" in str(w.message)]) == 1
    assert [("metrics" in e, "params" in e) for e in tracking._read_spool(spool)] == [(1, 0), (0, 1), (1, 0)]
    assert tracking.enabled()
    down[0] = False
    run.log_metrics({"reward_mean": 3.0}, step=3)
    assert not spool.exists()
    run_id = run.run_id
    run.finish()
    history = _client().get_metric_history(run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    got = _client().get_run(run_id)
    assert got.data.params["train.lr"] == "0.5" and got.info.status == "FINISHED"


@pytest.mark.timeout(180)
def test_resumed_training_continues_its_run_and_logs_each_step_once(monkeypatch):
    """Killed after logging iteration 2 but before its checkpoint: --resume re-runs iteration 2 in the same run,
    and the store still holds each step of reward_mean once."""
    from helpers import tiny

    from lean import checkpoint
    from lean.train import train

    tracking.configure(enabled=True, experiment="lean-test-resume")
    cfg = tiny("train.iterations=4", "train.schedule=retain", "checkpoint.every=1")
    save = checkpoint.save

    def killed_at_2(folder, iteration, state, keep):
        if iteration == 2:
            raise KeyboardInterrupt("killed")
        return save(folder, iteration, state, keep)

    monkeypatch.setattr(checkpoint, "save", killed_at_2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out="out")
    monkeypatch.setattr(checkpoint, "save", save)
    history = train(cfg, out="out", resume=True)
    client = _client()
    (run,) = client.search_runs([client.get_experiment_by_name("lean-test-resume").experiment_id])
    assert run.info.status == "FINISHED"
    steps = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    assert [s for s, _ in steps] == [0, 1, 2, 3]
    assert [v for _, v in steps] == pytest.approx([row["reward_mean"] for row in history])
