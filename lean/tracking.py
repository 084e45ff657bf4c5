"""MLflow tracking: the only module that imports mlflow, and only once a run is actually started.

Off by default (``import mlflow`` takes seconds, and a library call should not write a database); on with
``LEAN_TRACKING=1`` in the environment or :func:`configure` ``(enabled=True)``, which the DVC stages call from the
``tracking`` section of ``params.yaml``.

Where runs go: ``MLFLOW_TRACKING_URI`` when set (e.g. an ``mlflow server``); otherwise a SQLite store at the repository
root, ``sqlite:///<root>/mlflow.db`` (MLflow 3 refuses a plain ``./mlruns`` file store), with artifacts in
``mlartifacts/`` beside it. The root is ``$DVC_ROOT`` (DVC sets it for every stage, and points it at the parent
repository when ``dvc exp run --temp/--queue`` runs the stage in a temporary copy), else the git top level, else the
cwd.

Every run of the workbench's one experiment is tagged with the git commit, the stage (``$DVC_STAGE`` under DVC), the
schedule, and the DVC experiment name when there is one; a stage that runs several schedules opens one child run per
schedule (``Run.child``). A store that cannot be reached never stops a run: the first failure is reported once as a
warning, tracking stays off for the rest of the process, and the local JSON/CSV outputs are written as always.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EXPERIMENT = "lean-workbench"
_FRESH = {"enabled": None, "experiment": None, "failed": False, "client": None, "uri": None, "experiment_id": None}
_state: dict[str, Any] = dict(_FRESH)


def configure(enabled: bool | None = None, experiment: str | None = None) -> None:
    """Switch tracking on or off for this process (``None`` leaves a setting as it is) and name the experiment."""
    if enabled is not None:
        _state["enabled"] = enabled
    if experiment is not None and experiment != _state["experiment"]:
        _state["experiment"], _state["experiment_id"] = experiment, None


def reset() -> None:
    """Forget the configuration, the client and a past failure (a new store, or a test)."""
    _state.clear()
    _state.update(_FRESH)


def enabled() -> bool:
    """Tracking is on (configured, or ``LEAN_TRACKING`` is 1/true/yes) and the store has not failed."""
    if _state["failed"]:
        return False
    if _state["enabled"] is not None:
        return _state["enabled"]
    return os.environ.get("LEAN_TRACKING", "").lower() in ("1", "true", "yes", "on")


def repo_root() -> Path:
    """``$DVC_ROOT``, else the git top level of the cwd, else the cwd."""
    if os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"])
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10)
        if top.returncode == 0 and top.stdout.strip():
            return Path(top.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return Path.cwd()


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=repo_root())
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _fail(err: BaseException) -> None:
    if not _state["failed"]:
        warnings.warn(f"lean.tracking: MLflow store {tracking_uri()!r} failed ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); tracking is off for the rest of this process, "
                      "local outputs are unaffected", RuntimeWarning, stacklevel=3)
    _state["failed"] = True


def _client():
    """The MlflowClient and the experiment id, created on first use (this is where mlflow gets imported)."""
    uri = tracking_uri()
    if _state["client"] is None or _state["uri"] != uri:
        # A server that is down must cost seconds, not MLflow's default minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.tracking import MlflowClient

        _state.update(client=MlflowClient(tracking_uri=uri), uri=uri, experiment_id=None)
    client = _state["client"]
    if _state["experiment_id"] is None:
        name = _state["experiment"] or os.environ.get("LEAN_EXPERIMENT", EXPERIMENT)
        found = client.get_experiment_by_name(name)
        if found is not None:
            _state["experiment_id"] = found.experiment_id
        else:
            # Beside a SQLite store (MLflow's own default would be relative to the cwd); a server picks its own.
            db = uri.removeprefix("sqlite:///")
            artifacts = (Path(db).resolve().parent / "mlartifacts").as_uri() if uri.startswith("sqlite:///") else None
            _state["experiment_id"] = client.create_experiment(name, artifact_location=artifacts)
    return client, _state["experiment_id"]


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"family": "flux"}} -> {"model.family": "flux"}``."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class Run:
    """One MLflow run, or nothing at all: when tracking is off every method returns at once.

    Use as a context manager (``with start_run(...) as run``: FAILED if the block raises) or call :meth:`finish`; a
    run its process never finished (a crash) stays RUNNING in the store.
    """

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id

    @property
    def active(self) -> bool:
        return self.run_id is not None and enabled()

    def _call(self, method: str, *args, **kwargs) -> Any:
        if not self.active:
            return None
        try:
            client, _ = _client()
            return getattr(client, method)(self.run_id, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any store failure turns tracking off, never the run
            _fail(err)
            return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Every finite number of ``metrics`` (bools and strings are skipped), at ``step``."""
        if not self.active:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        for i in range(0, len(rows), 1000):
            self._call("log_batch", metrics=rows[i:i + 1000])

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Flattened to dotted keys; values as strings cut at MLflow's 6000 characters."""
        if not self.active:
            return
        from mlflow.entities import Param

        rows = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(rows), 100):
            self._call("log_batch", params=rows[i:i + 100])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.active:
            return
        from mlflow.entities import RunTag

        self._call("log_batch", tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A file, or a folder's files, under ``artifact_path``."""
        path = Path(path)
        if path.is_dir():
            self._call("log_artifacts", str(path), artifact_path)
        elif path.exists():
            self._call("log_artifact", str(path), artifact_path)

    def log_figure(self, figure, name: str) -> None:
        """A matplotlib figure as ``figures/<name>`` (PNG)."""
        if not self.active:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            figure.savefig(path, dpi=110, bbox_inches="tight")
            self.log_artifact(path, "figures")

    def child(self, name: str, *, schedule: str | None = None, tags: Mapping[str, Any] | None = None) -> Run:
        """A nested run (shown under this one in the MLflow UI) with this run's stage and the given schedule."""
        if not self.active:
            return Run()
        stage = self._call("get_run")
        stage_tag = stage.data.tags.get("lean.stage") if stage is not None else None
        return start_run(name, stage=stage_tag, schedule=schedule, tags=tags, parent=self)

    def finish(self, status: str = "FINISHED") -> None:
        self._call("set_terminated", status=status)
        self.run_id = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.finish("FAILED" if exc_type is not None else "FINISHED")
        return False


def start_run(name: str, *, stage: str | None = None, schedule: str | None = None,
              params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None,
              parent: Run | None = None) -> Run:
    """Open a run named ``name`` in the workbench experiment (a no-op :class:`Run` when tracking is off).

    Tags: ``lean.stage`` (``stage``, else ``$DVC_STAGE``, else ``name``), ``lean.schedule``, ``lean.git_commit`` (also
    as MLflow's own source-commit tag), ``dvc.stage`` and ``dvc.exp_name`` when DVC runs the stage, plus ``tags``.
    ``params`` (a nested mapping, e.g. ``RunConfig.to_dict()``) are logged flattened.
    """
    if not enabled():
        return Run()
    try:
        client, experiment_id = _client()
        commit = git_commit()
        all_tags = {"mlflow.runName": name, "lean.stage": stage or os.environ.get("DVC_STAGE") or name,
                    "lean.schedule": schedule, "lean.git_commit": commit, "mlflow.source.git.commit": commit,
                    "dvc.stage": os.environ.get("DVC_STAGE"), "dvc.exp_name": os.environ.get("DVC_EXP_NAME"),
                    "mlflow.parentRunId": parent.run_id if parent is not None else None, **(tags or {})}
        run = Run(client.create_run(experiment_id, run_name=name,
                                    tags={k: str(v) for k, v in all_tags.items() if v is not None}).info.run_id)
    except Exception as err:  # noqa: BLE001
        _fail(err)
        return Run()
    if params:
        run.log_params(params)
    return run


def attach(run_id: str | None) -> Run:
    """A handle on an existing run (e.g. the report stage adding an executed notebook to the notebook's own run)."""
    return Run(run_id) if run_id and enabled() else Run()
