"""lean against a real ``mlflow server`` (HTTP store), checked through MLflow's REST API: a ``lean train`` run lands
with one point per iteration, and a server stopped mid-run loses nothing once ``lean sync`` replays the spool."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from lean.observe import tracking

ROOT = Path(__file__).resolve().parent.parent


class Server:
    """``mlflow server`` on a SQLite store and a free local port, in its own process group (it forks workers)."""

    def __init__(self, db: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.db, self.log, self.process = db, db.with_suffix(".log"), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> None:
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.db}",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mlflow server exited: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"mlflow server not up after {timeout_s} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def get(self, path: str, **query) -> dict:
        with urllib.request.urlopen(
            f"{self.uri}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}", timeout=30
        ) as answer:
            return json.load(answer)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.uri}/api/2.0/mlflow/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.load(answer)

    def runs(self, experiment: str) -> list[dict]:
        experiment_id = self.get("experiments/get-by-name", experiment_name=experiment)["experiment"]["experiment_id"]
        return self.post("runs/search", {"experiment_ids": [experiment_id]}).get("runs", [])

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        metrics = self.get("metrics/get-history", run_id=run_id, metric_key=key).get("metrics", [])
        return sorted((int(m.get("step", 0)), m["value"]) for m in metrics)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (starting one takes tens of seconds); a test may stop and restart it."""
    server = Server(tmp_path_factory.mktemp("mlflow-server") / "m.db")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _fresh_tracking(monkeypatch):
    monkeypatch.delenv("LEAN_TRACKING", raising=False)
    tracking.reset()
    yield
    tracking.reset()


@pytest.mark.timeout(300)
def test_lean_train_logs_to_a_server(server, tmp_path, monkeypatch):
    """``lean train`` with ``LEAN_TRACKING=1`` and the server's URI in the environment (run in this process: a
    process of its own spends seconds on imports this one has done): one FINISHED run in the named experiment, one
    reward point per iteration, nothing left in the spool."""
    from lean.cli import main

    monkeypatch.setenv("LEAN_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("LEAN_EXPERIMENT", "lean-test-server")
    sets = ["train.iterations=2", "train.prompts_per_iteration=2", "train.group_size=2", "sample.num_steps=3"]
    assert main(["train", "--out", str(tmp_path / "out"), *[arg for s in sets for arg in ("--set", s)]]) == 0
    (run,) = server.runs("lean-test-server")
    assert run["info"]["status"] == "FINISHED"
    assert [step for step, _ in server.history(run["info"]["run_id"], "reward_mean")] == [0, 1]
    assert not (tmp_path / "out" / tracking.SPOOL).exists()


@pytest.mark.timeout(300)
def test_server_stopped_mid_run_then_lean_sync(server, tmp_path, monkeypatch):
    from lean.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    tracking.configure(enabled=True, experiment="lean-test-server-spool")
    spool = tmp_path / "out" / tracking.SPOOL
    run = tracking.start_run("stopped", spool=spool)
    run_id = run.run_id
    try:
        for step in (0, 1):
            run.log_metrics({"reward_mean": float(step)}, step=step)
        server.stop()
        with pytest.warns(RuntimeWarning, match="lean.observe.tracking"):
            for step in (2, 3):
                run.log_metrics({"reward_mean": float(step)}, step=step)
            run.finish()
        assert len(tracking._read_spool(spool)) == 3  # two batches of metrics, then the final status
    finally:
        server.start()  # the next test (or the fixture's stop) expects a running server
    assert main(["sync", "--out", str(tmp_path / "out")]) == 0
    assert not spool.exists()
    assert server.history(run_id, "reward_mean") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert server.get("runs/get", run_id=run_id)["run"]["info"]["status"] == "FINISHED"
