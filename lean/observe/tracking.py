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
schedule, and the DVC experiment (name, baseline commit, params hash) when there is one (the experiment itself as
model training, ``mlflow.experimentKind``); a stage that runs several schedules opens one child run per schedule
(``Run.child``). A store that cannot be reached never stops a run: the first failure is reported once as a warning,
tracking stays off for the rest of the process, and the local JSON/CSV outputs are written as always.

A run given a ``spool`` file (``lean train`` uses ``<out>/tracking_pending.jsonl``) loses nothing when its store goes
away mid-run: a metrics/params/tags batch or the final status that fails is appended there as one JSON line (warned
once), and the next successful call, :meth:`Run.finish`, or ``lean sync --out <out>`` replays the lines in order,
deleting each once the store has it. A resumed run (:func:`attach` with ``resume=True``) skips metrics at steps the
store already holds, so iterations re-run after the last checkpoint are logged once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EXPERIMENT = "lean-workbench"
# The MLflow UI opens an experiment of this kind on its runs (training curves, images), not on its GenAI views.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
SPOOL = "tracking_pending.jsonl"  # the spool's name inside a run's output folder
RETRY_AFTER_S = 30.0  # after a failed call, spool without asking the store for this long (a hung server costs seconds)
# Errors that say the store answered and refused the call: retrying cannot help, so they are not spooled.
_REJECTED = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST"}
_FRESH = {
    "enabled": None,
    "experiment": None,
    "failed": False,
    "client": None,
    "uri": None,
    "experiment_id": None,
    "spool_warned": False,
}
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


def import_client() -> None:
    """Import MLflow now when tracking is on (seconds), opening nothing: a process that forks its runs pays it once.
    With a database URI its SQL store too (SQLAlchemy and alembic: 0.5-1 CPU s that each forked run paid again)."""
    if enabled():
        from mlflow.store.db.db_types import DATABASE_ENGINES  # imports mlflow
        from mlflow.utils.uri import get_uri_scheme

        if get_uri_scheme(tracking_uri()).split("+")[0] in DATABASE_ENGINES:  # sqlite, postgresql+psycopg2, ...
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


def ready_store() -> None:
    """When tracking is on, create the store's tables and the experiment now: runs that start together would race to
    (MLflow's migration of a new sqlite store fails in all but one of them)."""
    if enabled():
        _client()


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
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=repo_root())
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _fail(err: BaseException) -> None:
    if not _state["failed"]:
        warnings.warn(
            f"lean.observe.tracking: MLflow store {tracking_uri()!r} failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); tracking is off for the rest of this process, "
            "local outputs are unaffected",
            RuntimeWarning,
            stacklevel=3,
        )
    _state["failed"] = True


def _store():
    """The MlflowClient of the current tracking URI, created on first use (this is where mlflow gets imported)."""
    uri = tracking_uri()
    if _state["client"] is None or _state["uri"] != uri:
        # A server that is down must cost seconds, not MLflow's default minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.tracking import MlflowClient

        _state.update(client=MlflowClient(tracking_uri=uri), uri=uri, experiment_id=None)
    return _state["client"]


def _client():
    """The MlflowClient and the experiment id (created in the store if it is new)."""
    client = _store()
    uri = _state["uri"]
    if _state["experiment_id"] is None:
        name = _state["experiment"] or os.environ.get("LEAN_EXPERIMENT", EXPERIMENT)
        found = client.get_experiment_by_name(name)
        if found is not None:
            _state["experiment_id"] = found.experiment_id
            kind = found.tags.get(EXPERIMENT_KIND)
            if kind is None or kind.endswith("inferred_type") or kind.endswith("_inferred"):  # a user's kind stays
                client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        else:
            # Beside a SQLite store (MLflow's own default would be relative to the cwd); a server picks its own.
            db = uri.removeprefix("sqlite:///")
            artifacts = (Path(db).resolve().parent / "mlartifacts").as_uri() if uri.startswith("sqlite:///") else None
            _state["experiment_id"] = client.create_experiment(
                name, artifact_location=artifacts, tags={EXPERIMENT_KIND: MODEL_TRAINING}
            )
    return client, _state["experiment_id"]


def _apply(entry: Mapping[str, Any]) -> None:
    """Send one call: ``{"run_id", "status"}`` terminates the run, else a batch of ``metrics`` ([key, value,
    timestamp_ms, step] rows), ``params`` and ``tags`` ([key, value] rows)."""
    client = _store()
    if "status" in entry:
        client.set_terminated(entry["run_id"], status=entry["status"])
        return
    from mlflow.entities import Metric, Param, RunTag

    client.log_batch(
        entry["run_id"],
        metrics=[Metric(*m) for m in entry.get("metrics", [])],
        params=[Param(*p) for p in entry.get("params", [])],
        tags=[RunTag(*t) for t in entry.get("tags", [])],
    )


def _rejected(err: BaseException) -> bool:
    return getattr(err, "error_code", None) in _REJECTED


def _read_spool(spool: Path) -> list[dict]:
    if not spool.exists():
        return []
    return [json.loads(line) for line in spool.read_text().splitlines() if line.strip()]


def _write_spool(spool: Path, entries: list[dict]) -> None:
    """Atomically replace the spool by ``entries`` (none: remove it)."""
    if not entries:
        spool.unlink(missing_ok=True)
        return
    tmp = spool.with_name(spool.name + ".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
    os.replace(tmp, spool)


def _append_spool(spool: Path, entry: Mapping[str, Any], err: BaseException) -> None:
    spool.parent.mkdir(parents=True, exist_ok=True)
    with open(spool, "a") as f:
        f.write(json.dumps(entry) + "\n")
    if not _state["spool_warned"]:
        warnings.warn(
            f"lean.observe.tracking: MLflow store {tracking_uri()!r} failed ({type(err).__name__}); pending calls "
            f"are kept in {spool} and sent on the next successful call (or: lean sync --out "
            f"{spool.parent})",
            RuntimeWarning,
            stacklevel=4,
        )
    _state["spool_warned"] = True


def replay(spool: str | os.PathLike) -> None:
    """Send the spooled calls in order, deleting each once the store has it (one the store rejects is dropped with a
    warning). Raises at the first call that fails for any other reason; it and the ones after it stay spooled."""
    spool = Path(spool)
    pending = _read_spool(spool)
    while pending:
        try:
            _apply(pending[0])
        except Exception as err:  # noqa: BLE001 - sorted below: rejected calls go, the rest wait
            if not _rejected(err):
                raise
            warnings.warn(
                f"lean.observe.tracking: dropping a spooled call the store rejects: {err}", RuntimeWarning, stacklevel=2
            )
        pending.pop(0)
        _write_spool(spool, pending)


def sync(spool: str | os.PathLike) -> int:
    """``lean sync``: replay ``spool`` into the current store now (tracking forced on); the calls still pending."""
    configure(enabled=True)
    try:
        replay(spool)
    except Exception as err:  # noqa: BLE001
        warnings.warn(
            f"lean.observe.tracking: MLflow store {tracking_uri()!r} failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})",
            RuntimeWarning,
            stacklevel=2,
        )
    return len(_read_spool(Path(spool)))


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

    def __init__(self, run_id: str | None = None, spool: str | os.PathLike | None = None):
        self.run_id = run_id
        self.spool = Path(spool) if spool is not None else None
        self.logged_steps: dict[str, int] = {}  # metric -> highest step the store already has (a resumed run)
        self._retry_at = 0.0  # monotonic time before which a run with a spool spools without trying the store

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

    def _submit(self, entry: dict, force: bool = False) -> None:
        """Send one call (see :func:`_apply`) after any spooled ones; with a spool, a failure keeps it there."""
        if not self.active:
            return
        entry = {"run_id": self.run_id, **entry}
        if self.spool is not None and not force and time.monotonic() < self._retry_at:
            _append_spool(self.spool, entry, ConnectionError("retry pending"))
            return
        try:
            if self.spool is not None:
                replay(self.spool)
            _apply(entry)
        except Exception as err:  # noqa: BLE001 - a store failure never stops the run
            if self.spool is None or _rejected(err):
                _fail(err)
                return
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            _append_spool(self.spool, entry, err)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Every finite number of ``metrics`` (bools and strings are skipped), at ``step`` (0 when None); a metric
        whose ``step`` the store already has (:attr:`logged_steps`, a resumed run) is skipped."""
        if not self.active:
            return
        now = int(time.time() * 1000)
        rows = [
            [k, float(v), now, step or 0]
            for k, v in metrics.items()
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and (step is None or step > self.logged_steps.get(k, -1))
        ]
        for i in range(0, len(rows), 1000):
            self._submit({"metrics": rows[i : i + 1000]})

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Flattened to dotted keys; values as strings cut at MLflow's 6000 characters."""
        if not self.active:
            return
        rows = [[k, str(v)[:6000]] for k, v in flatten(params).items()]
        for i in range(0, len(rows), 100):
            self._submit({"params": rows[i : i + 100]})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._submit({"tags": [[k, str(v)] for k, v in tags.items() if v is not None]})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A file, or a folder's files, under ``artifact_path``."""
        path = Path(path)
        if path.is_dir():
            self._call("log_artifacts", str(path), artifact_path)
        elif path.exists():
            self._call("log_artifact", str(path), artifact_path)

    def log_image(self, path: str | os.PathLike, key: str, step: int) -> None:
        """An image file as MLflow's stepped image ``key`` at ``step``: the run page's images view shows how it
        changes over the steps."""
        if not self.active:
            return
        from PIL import Image  # local: only runs that log images read them

        with Image.open(path) as image:
            self._call("log_image", image.convert("RGB"), key=key, step=step, synchronous=True)

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
        """Replay the spool (if any) and close the run; if the store is still down, the status waits in the spool."""
        self._submit({"status": status}, force=True)
        self.run_id = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.finish("FAILED" if exc_type is not None else "FINISHED")
        return False


def params_hash(path: str | os.PathLike = "params.yaml") -> str | None:
    """The first 12 hex digits of the SHA-256 of a params file (None when there is none): runs of the same
    configuration share it, whichever experiment made them."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    except OSError:
        return None


def dvc_tags() -> dict[str, str | None]:
    """What DVC says of the stage this process runs (its environment): the stage, and under ``dvc exp run`` the
    experiment's name and baseline commit, plus the hash of the ``params.yaml`` the stage reads (DVC runs stages at
    the repository root, or its temporary copy's), so that an MLflow run is found from ``dvc exp show`` and back."""
    stage = os.environ.get("DVC_STAGE")
    return {
        "dvc.stage": stage,
        "dvc.exp_name": os.environ.get("DVC_EXP_NAME"),
        "dvc.exp_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV"),
        "dvc.params_hash": params_hash() if stage else None,
    }


def start_run(
    name: str,
    *,
    stage: str | None = None,
    schedule: str | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
    parent: Run | None = None,
    spool: str | os.PathLike | None = None,
) -> Run:
    """Open a run named ``name`` in the workbench experiment (a no-op :class:`Run` when tracking is off).

    Tags: ``lean.stage`` (``stage``, else ``$DVC_STAGE``, else ``name``), ``lean.schedule``, ``lean.git_commit`` (also
    as MLflow's own source-commit tag), the DVC experiment (:func:`dvc_tags`) when DVC runs the stage, plus ``tags``.
    ``params`` (a nested mapping, e.g. ``RunConfig.to_dict()``) are logged flattened. ``spool``: where calls that
    fail wait for the store (see the module docstring); without one a failure turns tracking off.
    """
    if not enabled():
        return Run()
    try:
        client, experiment_id = _client()
        commit = git_commit()
        all_tags = {
            "mlflow.runName": name,
            "lean.stage": stage or os.environ.get("DVC_STAGE") or name,
            "lean.schedule": schedule,
            "lean.git_commit": commit,
            "mlflow.source.git.commit": commit,
            **dvc_tags(),
            "mlflow.parentRunId": parent.run_id if parent is not None else None,
            **(tags or {}),
        }
        run = Run(
            client.create_run(
                experiment_id, run_name=name, tags={k: str(v) for k, v in all_tags.items() if v is not None}
            ).info.run_id,
            spool,
        )
    except Exception as err:  # noqa: BLE001
        _fail(err)
        return Run()
    if params:
        run.log_params(params)
    return run


def attach(run_id: str | None, *, spool: str | os.PathLike | None = None, resume: bool = False) -> Run:
    """A handle on an existing run (e.g. the report stage adding an executed notebook to the notebook's own run).

    ``resume``: this process continues the run (``lean train --resume``): the spool is replayed, the run is RUNNING
    again, and :attr:`Run.logged_steps` is read from the store (one history query per metric), so that metrics of the
    iterations re-run after the last checkpoint, already logged before the interruption, are not logged twice.
    """
    if not (run_id and enabled()):
        return Run()
    run = Run(run_id, spool)
    if resume:
        try:
            if spool is not None:
                replay(spool)
            client = _store()
            client.update_run(run_id, status="RUNNING")
            for key in client.get_run(run_id).data.metrics:
                run.logged_steps[key] = max(m.step for m in client.get_metric_history(run_id, key))
        except Exception as err:  # noqa: BLE001 - without the logged steps, re-logging would duplicate: stop tracking
            _fail(err)
            return Run()
    return run
