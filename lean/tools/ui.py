"""``lean ui``: MLflow's UI on the workbench's store, opened on the runs of its experiment.

MLflow 3.17 opens an experiment on its GenAI overview: the UI keeps a ``workflowType`` in the browser (default
``genai``) and the experiment tag ``mlflow.experimentKind`` does not choose the view. The URL does: the query of the
hash route, ``#/experiments/<id>/runs?workflowType=machine_learning``, opens the runs table on the model-training side
(a query before the ``#`` is not read).

A saved view is the one part of the UI's state MLflow keeps in the store: an experiment tag
``mlflow.sharedViewState.<key>`` holding ``{"name", "createdAt", "updatedAt", "state"}``, ``state`` being the JSON of
the runs page (columns, chart cards, grouping), listed under the page's *Views* menu and opened by
``?viewStateShareKey=<key>``. :func:`save_view` writes one, ``lean: schedules compared``: the runs grouped by their
``lean.schedule`` tag, and charts of the reward curves (``reward_mean``, ``eval_reward_mean``), the speedup (and
against its bound), MFU and the certificate (``max_rel_grad_diff``) per schedule. Everything else (the default
columns, the chart layout of the plain runs view) lives in the browser's local storage and cannot be set from Python.

The store is ``$MLFLOW_TRACKING_URI``, else ``<repository root>/mlflow.db``
(:func:`lean.observe.tracking.tracking_uri`), or ``--store``. A SQLite store is read (and the view written) with
:mod:`sqlite3`, no ``import mlflow``; any other store through ``MlflowClient``. An HTTP store is a server already:
``lean ui`` prints its URLs and starts nothing.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from urllib.parse import urlencode

from lean.config import ConfigError
from lean.observe import tracking

HOST, PORT = "127.0.0.1", 5000
RUNS_VIEW = {"workflowType": "machine_learning"}  # the query that opens the model-training side (MLflow 3.17)
VIEW_TAG = "mlflow.sharedViewState."  # + key: a saved view of the runs page (MLflow's own prefix)
VIEW_KEY, VIEW_NAME = "lean-schedules", "lean: schedules compared"
SECTION = "lean-schedules-compared"
# (chart type, metric): the metrics that compare the schedules, in the order the view shows them.
CHARTS = [
    ("LINE", "reward_mean"),  # train[<schedule>]: one point per iteration
    ("LINE", "eval_reward_mean"),  # train[<schedule>]: one point per evaluation
    ("BAR", "speedup"),  # bench[<schedule>]: against Recompute
    ("BAR", "speedup_vs_bound"),  # bench[<schedule>]: the speedup over its analytic bound
    ("BAR", "mfu"),  # bench[<schedule>]
    ("BAR", "max_rel_grad_diff"),  # equivalence[<schedule>]: the certificate against Recompute's gradient
]
COLUMNS = ["tags.`lean.schedule`", "tags.`lean.stage`"] + [f"metrics.`{key}`" for _, key in CHARTS]


def store_uri(store: str | None = None) -> str:
    """``store`` (a URI, or a SQLite file's path), else the workbench's (:func:`lean.observe.tracking.tracking_uri`)."""
    uri = store or tracking.tracking_uri()
    if "://" not in uri:  # a path
        return f"sqlite:///{Path(uri).expanduser().resolve()}"
    db = sqlite_file(uri)  # a relative SQLite path is the cwd's: made absolute, as mlflow ui runs beside the file
    return uri if db is None or db.is_absolute() else f"sqlite:///{db.resolve()}"


def default_experiment() -> str:
    """``$LEAN_EXPERIMENT``, else ``tracking.experiment`` of the repository's ``params.yaml``, else the default."""
    if os.environ.get("LEAN_EXPERIMENT"):
        return os.environ["LEAN_EXPERIMENT"]
    try:
        import yaml

        section = (yaml.safe_load((tracking.repo_root() / "params.yaml").read_text()) or {}).get("tracking") or {}
        return str(section.get("experiment") or tracking.EXPERIMENT)
    except (OSError, ValueError, AttributeError, ImportError):  # no params.yaml, or not a mapping
        return tracking.EXPERIMENT


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def runs_url(base: str, experiment_id: str, **query: str) -> str:
    """The runs page of ``experiment_id`` on the model-training side: the query goes after the hash (the UI's
    router reads it there)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{urlencode({**RUNS_VIEW, **query})}"


def experiments_url(base: str) -> str:
    """The experiments list on the model-training side: what a store without the experiment yet opens on."""
    return f"{base.rstrip('/')}/#/experiments?{urlencode(RUNS_VIEW)}"


def view_url(base: str, experiment_id: str) -> str:
    """The saved view of :func:`save_view`, in chart mode."""
    return runs_url(base, experiment_id, compareRunsMode="CHART", viewStateShareKey=VIEW_KEY)


def server_base(host: str, port: int) -> str:
    """The address a browser on this machine opens for a server listening on ``host:port``."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ---------------------------------------------------------------- the saved view


def _chart(kind: str, key: str) -> dict:
    """A chart card of the runs page as the UI serialises it (MLflow 3.17's ``RunsChartsCardConfig``)."""
    card = {
        "uuid": f"lean-{key}",
        "type": kind,
        "runsCountToCompare": 10,
        "metricSectionId": SECTION,
        "deleted": False,
        "isGenerated": False,
        "displayName": key,
        "metricKey": key,
        "selectedMetricKeys": [key],
    }
    if kind == "LINE":
        card.update(
            lineSmoothness=0,
            xAxisScaleType="linear",
            scaleType="linear",
            range={},
            xAxisKey="step",
            selectedXAxisMetricKey="",
            yAxisKey="metric",
            yAxisExpressions=[],
            ignoreOutliers=False,
            useGlobalXaxisKey=True,
            useGlobalLineSmoothing=True,
        )
    return card


def view_state() -> dict:
    """The runs page's state of the saved view: every run, grouped by schedule, the schedule charts first."""
    return {
        "searchFilter": "",
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        "selectedColumns": COLUMNS,
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": [_chart(kind, key) for kind, key in CHARTS],
        "compareRunSections": [
            {
                "uuid": SECTION,
                "name": "Schedules compared",
                "display": True,
                "isReordered": False,
                "deleted": False,
                "isGenerated": False,
            }
        ],
        "isAccordionReordered": True,
        "groupBy": {"groupByKeys": [{"mode": "tag", "groupByData": "lean.schedule"}], "aggregateFunction": "average"},
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def view_tag_value(created_ms: int | None = None, now_ms: int | None = None) -> str:
    """The tag's value: MLflow's saved-view envelope around :func:`view_state` (its ``state`` a JSON string)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    created_ms = now_ms if created_ms is None else created_ms
    state = json.dumps(view_state(), separators=(",", ":"))
    return json.dumps({"name": VIEW_NAME, "createdAt": created_ms, "updatedAt": now_ms, "state": state})


def _created(previous: str | None) -> int | None:
    try:
        return int(json.loads(previous)["createdAt"]) if previous else None
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- the store


def _connect(db: Path, write: bool = False) -> closing[sqlite3.Connection]:
    """A connection that closes (``with``); each statement outside a transaction commits at once."""
    mode = "" if write else "?mode=ro"
    return closing(sqlite3.connect(db.resolve().as_uri() + mode, uri=True, timeout=10, isolation_level=None))


def find_experiment(uri: str, name: str) -> str:
    """The id of the experiment ``name`` in the store ``uri``; a store or experiment that is not there is a
    :class:`~lean.config.ConfigError` naming ``--store`` or ``--experiment``."""
    db = sqlite_file(uri)
    if db is None:
        return _find_with_client(uri, name)
    if not db.is_file():
        raise ConfigError(
            "--store",
            uri,
            "no MLflow store there: run the workbench with tracking on (make repro), or lean train with "
            "LEAN_TRACKING=1, or name a store with --store / MLFLOW_TRACKING_URI",
        )
    try:
        with _connect(db) as con:
            columns = {row[1] for row in con.execute("PRAGMA table_info(experiments)")}
            if not {"experiment_id", "name"} <= columns:
                raise ConfigError("--store", uri, "is not an MLflow store (no experiments table)")
            order = "workspace = 'default' DESC" if "workspace" in columns else "experiment_id"
            found = con.execute(
                f"SELECT experiment_id, lifecycle_stage FROM experiments WHERE name = ? ORDER BY {order}", (name,)
            ).fetchone()
            known = [row[0] for row in con.execute("SELECT name FROM experiments ORDER BY experiment_id LIMIT 20")]
    except sqlite3.DatabaseError as err:
        raise ConfigError("--store", uri, f"cannot be read as an MLflow store ({err})") from None
    return _checked(found, name, known)


def _checked(found: tuple | None, name: str, known: list[str]) -> str:
    if found is None:
        raise ConfigError("--experiment", name, f"no such experiment in the store; it has: {', '.join(known) or '-'}")
    experiment_id, stage = found
    if stage == "deleted":
        raise ConfigError(
            "--experiment",
            name,
            f"is deleted in the store (mlflow experiments restore --experiment-id {experiment_id})",
        )
    return str(experiment_id)


def _client(uri: str):
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError("--store", uri, "needs mlflow: pip install -e '.[workbench]'")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a server that is down costs seconds
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _find_with_client(uri: str, name: str) -> str:
    try:
        client = _client(uri)
        found = client.get_experiment_by_name(name)
        if found is None:
            known = [e.name for e in client.search_experiments(max_results=20)]
            return _checked(None, name, known)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the store says, in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("--store", uri, f"cannot be read ({first})") from None
    return _checked((found.experiment_id, found.lifecycle_stage), name, [])


def save_view(uri: str, experiment_id: str) -> bool:
    """Write the saved view (:func:`view_state`) as the experiment's tag ``mlflow.sharedViewState.lean-schedules``,
    keeping the creation time of an earlier one. False (with a warning) when the store refuses."""
    key = VIEW_TAG + VIEW_KEY
    try:
        db = sqlite_file(uri)
        if db is not None:
            with _connect(db, write=True) as con:
                row = con.execute(
                    "SELECT value FROM experiment_tags WHERE key = ? AND experiment_id = ?", (key, int(experiment_id))
                ).fetchone()
                con.execute(
                    "INSERT OR REPLACE INTO experiment_tags (key, value, experiment_id) VALUES (?, ?, ?)",
                    (key, view_tag_value(_created(row[0] if row else None)), int(experiment_id)),
                )
        else:
            client = _client(uri)
            previous = client.get_experiment(experiment_id).tags.get(key)
            client.set_experiment_tag(experiment_id, key, view_tag_value(_created(previous)))
    except Exception as err:  # noqa: BLE001 - the runs view works without it
        print(f"lean ui: the saved view was not written ({type(err).__name__}: {err})", file=sys.stderr)
        return False
    return True


# ---------------------------------------------------------------- the server


def _listen_problem(host: str, port: int) -> ConfigError | None:
    """Why mlflow ui could not listen on ``host:port`` (None: it can). A port a stopped server left in TIME_WAIT is
    free (SO_REUSEADDR, as uvicorn binds)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        return ConfigError("--host", host, f"not an address of this machine ({err.strerror})")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return ConfigError("--port", port, f"in use on {host} (an mlflow ui already? --no-serve prints URLs)")
            return ConfigError("--host", host, f"cannot listen there ({err.strerror})")
    return None


def server_command(uri: str, host: str, port: int, workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]


def serve(command: list[str], cwd: Path | None = None, grace_s: float = 20.0) -> int:
    """Run ``command`` (``mlflow ui``) in the foreground, in its own process group (it forks uvicorn, its workers
    and job runners); SIGINT and SIGTERM are forwarded to the whole group, which gets ``grace_s`` to stop before
    SIGKILL. 0 when it stopped on a forwarded signal, else its exit status."""
    env = dict(os.environ)
    # MLflow's job runner (huey consumers for GenAI judges and trace jobs) is half a dozen processes the runs view
    # does not use; MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true in the environment keeps it.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    stopped: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum, _frame):  # installed before the start: a Ctrl+C at any time reaches the server
        stopped.append(signum)
        for process in started:
            try:
                os.killpg(process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        process = subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True)
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise
    started.append(process)
    if stopped:  # a signal came while it started
        os.killpg(process.pid, stopped[0])
    deadline = None
    try:
        while (code := process.poll()) is None:
            if stopped and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:  # it did not stop within the grace period
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
                break
            try:
                process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:  # uvicorn's workers and the job runner may outlive their parent
            os.killpg(process.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    return 0 if stopped else (128 - code if code < 0 else code)


def main(
    store: str | None = None,
    experiment: str | None = None,
    host: str | None = None,
    port: int | None = None,
    workers: int = 1,
    serve_ui: bool = True,
) -> int:
    """``lean ui``: check the store and the experiment, write the saved view, print the runs view's URL and the saved
    view's (stdout, one per line), then run ``mlflow ui`` on the store unless ``serve_ui`` is False."""
    uri = store_uri(store)
    name = experiment or default_experiment()
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError("--port", port, "must be in 1..65535")
    if host is not None and not host.strip():
        raise ConfigError("--host", host, "must name an address to listen on, e.g. 127.0.0.1")
    if workers < 1:
        raise ConfigError("--workers", workers, "must be >= 1")
    if is_server(uri):
        if host is not None or port is not None:
            option = "--host" if host is not None else "--port"
            raise ConfigError(
                option, host if host is not None else port, f"the store {uri} is a server already: nothing to start"
            )
        base, serve_ui = uri, False
    else:
        host, port = host or HOST, port or PORT
        base = server_base(host, port)
    db = sqlite_file(uri)
    if store is None and db is not None and not db.is_file():  # a fresh clone: the workbench has logged nothing yet
        return _serve_empty(uri, base, host, port, workers, serve_ui)
    experiment_id = find_experiment(uri, name)
    if serve_ui:
        if importlib.util.find_spec("mlflow") is None:
            raise ConfigError("--store", uri, "serving it needs mlflow: pip install -e '.[workbench]'")
        if (problem := _listen_problem(host, port)) is not None:
            raise problem
    saved = save_view(uri, experiment_id)
    print(f"lean ui: experiment {name!r} (id {experiment_id}) in {uri}", file=sys.stderr)
    print(runs_url(base, experiment_id), flush=True)
    if saved:
        print(view_url(base, experiment_id), flush=True)
        print(
            f"lean ui: the second URL opens the saved view {VIEW_NAME!r} (Views menu): runs grouped by schedule; "
            f"charts of {', '.join(key for _, key in CHARTS)}",
            file=sys.stderr,
        )
    if not serve_ui:
        if is_server(uri):
            print(f"lean ui: {uri} is a server already; nothing started", file=sys.stderr)
        return 0
    command = server_command(uri, host, port, workers)
    cwd = db.parent if db is not None else None  # MLflow's default ./mlartifacts beside a SQLite store
    print(f"lean ui: {' '.join(command[2:])} (Ctrl+C stops it; the UI answers after some seconds)", file=sys.stderr)
    sys.stderr.flush()
    return serve(command, cwd=cwd)


def _serve_empty(uri: str, base: str, host: str, port: int, workers: int, serve_ui: bool) -> int:
    """The default store does not exist yet: print the experiments list's URL (model-training side) and serve the
    store that ``mlflow ui`` creates, where ``make repro`` (or ``lean train`` with ``LEAN_TRACKING=1``) logs next."""
    print(experiments_url(base), flush=True)
    print(f"lean ui: no runs in {uri} yet: `make repro` logs the workbench's there (reload the page)", file=sys.stderr)
    if not serve_ui:
        return 0
    if (problem := _listen_problem(host, port)) is not None:
        raise problem
    db = sqlite_file(uri)
    return serve(server_command(uri, host, port, workers), cwd=db.parent if db is not None else None)
