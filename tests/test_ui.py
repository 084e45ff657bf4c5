"""``lean ui``: its help, the runs-view URL (``workflowType=machine_learning`` after the hash, the experiment's id),
the saved view it writes into the store, its one-line refusals, and ``mlflow ui``'s process group stopped by the
signal ``lean ui`` gets. Stores here are SQLite files made with sqlite3 (the two tables lean ui reads), except one
real MLflow store that checks MLflow reads the saved view back."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from lean.cli import main
from lean.tools import ui

ROOT = Path(__file__).resolve().parent.parent


def fake_store(path: Path, experiments: dict[str, int], deleted: tuple[str, ...] = ()) -> Path:
    """A SQLite file with MLflow's ``experiments`` and ``experiment_tags`` tables (3.17's columns that lean ui uses)."""
    with sqlite3.connect(path) as con:
        con.execute(
            "CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name VARCHAR(256) NOT NULL, "
            "artifact_location VARCHAR(256), lifecycle_stage VARCHAR(32), workspace VARCHAR(63) DEFAULT 'default')"
        )
        con.execute(
            "CREATE TABLE experiment_tags (key VARCHAR(250) NOT NULL, value TEXT, experiment_id INTEGER NOT NULL, "
            "PRIMARY KEY (key, experiment_id))"
        )
        for name, experiment_id in experiments.items():
            stage = "deleted" if name in deleted else "active"
            con.execute("INSERT INTO experiments VALUES (?, ?, NULL, ?, 'default')", (experiment_id, name, stage))
    con.close()
    return path


def tag(path: Path, experiment_id: int, key: str = ui.VIEW_TAG + ui.VIEW_KEY) -> str | None:
    with sqlite3.connect(path) as con:
        row = con.execute(
            "SELECT value FROM experiment_tags WHERE key = ? AND experiment_id = ?", (key, experiment_id)
        ).fetchone()
    con.close()
    return row[0] if row else None


def lean_ui(capsys, *args: str) -> tuple[int, list[str], str]:
    code = main(["ui", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ui", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--store", "--experiment", "--host", "--port", "--no-serve", "--print-url"):
        assert option in out


def test_prints_the_runs_view_of_the_experiment(tmp_path, capsys):
    db = fake_store(tmp_path / "m.db", {"Default": 0, "other": 3, "lean-workbench": 7})
    code, lines, err = lean_ui(capsys, "--store", str(db), "--no-serve", "--port", "5123")
    assert code == 0, err
    runs, view = lines
    assert runs == "http://127.0.0.1:5123/#/experiments/7/runs?workflowType=machine_learning"
    split = urlsplit(view)  # the query is the hash route's: the UI reads it there, not before the '#'
    assert split.query == "" and split.fragment.startswith("/experiments/7/runs?")
    query = parse_qs(split.fragment.split("?", 1)[1])
    assert query == {
        "workflowType": ["machine_learning"],
        "compareRunsMode": ["CHART"],
        "viewStateShareKey": ["lean-schedules"],
    }
    assert "'lean-workbench' (id 7)" in err


def test_the_saved_view(tmp_path, capsys):
    db = fake_store(tmp_path / "m.db", {"lean-workbench": 2})
    assert lean_ui(capsys, "--store", str(db), "--print-url")[0] == 0
    envelope = json.loads(tag(db, 2))
    assert envelope["name"] == ui.VIEW_NAME and envelope["createdAt"] == envelope["updatedAt"]
    state = json.loads(envelope["state"])  # what the UI applies: charts, their section first, grouped by schedule
    assert [c["metricKey"] for c in state["compareRunCharts"]] == [key for _, key in ui.CHARTS]
    assert {c["metricSectionId"] for c in state["compareRunCharts"]} == {state["compareRunSections"][0]["uuid"]}
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "lean.schedule"}]
    assert {"reward_mean", "speedup", "mfu", "max_rel_grad_diff"} <= {c["metricKey"] for c in state["compareRunCharts"]}
    time.sleep(0.01)
    assert lean_ui(capsys, "--store", str(db), "--print-url")[0] == 0  # written again, created once
    again = json.loads(tag(db, 2))
    assert again["createdAt"] == envelope["createdAt"] and again["updatedAt"] >= envelope["updatedAt"]


def test_store_and_experiment_defaults(tmp_path, capsys, monkeypatch):
    db = fake_store(tmp_path / "elsewhere.db", {"lean-workbench": 1, "mine": 4})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setenv("LEAN_EXPERIMENT", "mine")
    code, lines, _ = lean_ui(capsys, "--no-serve")
    assert code == 0 and lines[0] == "http://127.0.0.1:5000/#/experiments/4/runs?workflowType=machine_learning"
    monkeypatch.delenv("LEAN_EXPERIMENT")
    monkeypatch.chdir(tmp_path)  # not a git repository: the cwd is the root, and its params.yaml names the experiment
    (tmp_path / "params.yaml").write_text("tracking:\n  experiment: lean-workbench\n")
    assert ui.default_experiment() == "lean-workbench"
    assert ui.store_uri("elsewhere.db") == f"sqlite:///{db}"  # a path is a SQLite file, made absolute
    assert ui.store_uri("sqlite:///elsewhere.db") == f"sqlite:///{db}"


def test_a_fresh_clone_gets_the_experiments_list(tmp_path, capsys, monkeypatch):
    """No store yet (nothing logged): the default store's experiments list on the model-training side, not a refusal."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'absent.db'}")
    code, lines, err = lean_ui(capsys, "--no-serve")
    assert code == 0 and lines == ["http://127.0.0.1:5000/#/experiments?workflowType=machine_learning"]
    assert "make repro" in err and not (tmp_path / "absent.db").exists()


@pytest.mark.parametrize(
    "args, option",
    [
        (["--store", "{tmp}/absent.db"], "--store"),
        (["--store", "{tmp}/m.db", "--experiment", "nope"], "--experiment"),
        (["--store", "{tmp}/m.db", "--experiment", "gone"], "--experiment"),
        (["--store", "{tmp}/not-mlflow.db"], "--store"),
        (["--store", "{tmp}/m.db", "--port", "0"], "--port"),
        (["--store", "{tmp}/m.db", "--port", "70000"], "--port"),
        (["--store", "{tmp}/m.db", "--host", " "], "--host"),
        (["--store", "{tmp}/m.db", "--workers", "0"], "--workers"),
        (["--store", "http://127.0.0.1:1", "--port", "5001"], "--port"),
    ],
)
def test_refusals_name_the_option(tmp_path, capsys, args, option):
    fake_store(tmp_path / "m.db", {"lean-workbench": 1, "gone": 2}, deleted=("gone",))
    with sqlite3.connect(tmp_path / "not-mlflow.db") as con:
        con.execute("CREATE TABLE t (x)")
    con.close()
    code, lines, err = lean_ui(capsys, *[a.format(tmp=tmp_path) for a in args], "--no-serve")
    assert code == 2 and lines == []
    assert err.count("\n") == 1 and err.startswith(f"lean: config error: {option}=")


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path, capsys):
    db = fake_store(tmp_path / "m.db", {"lean-workbench": 1})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, lines, err = lean_ui(capsys, "--store", str(db), "--port", str(port))
    assert code == 2 and lines == [] and err.startswith(f"lean: config error: --port={port}: in use")
    code, lines, err = lean_ui(capsys, "--store", str(db), "--host", "192.0.2.1")  # TEST-NET-1: not this machine's
    assert code == 2 and lines == [] and err.startswith("lean: config error: --host='192.0.2.1': cannot listen")


# A stand-in for mlflow ui: it forks a worker into its process group, and both note the signal that stops them.
FAKE_SERVER = """
import os, signal, sys, time
folder = sys.argv[1]
def stop(signum, _frame, who):
    open(os.path.join(folder, who), "w").write(signal.Signals(signum).name)
    sys.exit(0)
who = "worker" if os.fork() == 0 else "server"
signal.signal(signal.SIGTERM, lambda s, f: stop(s, f, who))
signal.signal(signal.SIGINT, lambda s, f: stop(s, f, who))
open(os.path.join(folder, who + ".up"), "w").close()
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_forwards_the_signal_to_the_server_group(tmp_path, signum):
    driver = (
        "import sys; from lean.tools import ui; "
        f"sys.exit(ui.serve([sys.executable, '-c', {FAKE_SERVER!r}, {str(tmp_path)!r}], grace_s=10))"
    )
    process = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "server.up").exists() and (tmp_path / "worker.up").exists()):
            assert process.poll() is None and time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.1)
        process.send_signal(signum)
        assert process.wait(timeout=30) == 0  # stopped on request
    finally:
        if process.poll() is None:
            process.kill()
    assert (tmp_path / "server").read_text() == signum.name
    assert (tmp_path / "worker").read_text() == signum.name  # the whole group, not only the direct child


@pytest.mark.slow  # MLflow's migrations of a new store: seconds
def test_mlflow_reads_the_saved_view(tmp_path, capsys):
    """A real MLflow store: the tag lean ui writes with sqlite3 is the experiment's tag for MLflow (and the UI)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("lean-workbench")
    code, lines, _ = lean_ui(capsys, "--store", uri, "--no-serve")
    assert code == 0 and f"/#/experiments/{experiment_id}/runs?workflowType=machine_learning" in lines[0]
    value = client.get_experiment(experiment_id).tags[ui.VIEW_TAG + ui.VIEW_KEY]
    assert json.loads(value)["name"] == ui.VIEW_NAME
