"""Test set-up: few threads, and nothing written to the user's outputs or MLflow store (shared helpers:
``tests/helpers.py``)."""

import os

import pytest
import torch

# The tests' `mlflow server`s skip MLflow 3's job runner: seven background processes for GenAI features, seconds of
# CPU each at every start on 2 cores.
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")

# `make test-full` runs three pytest-xdist workers on 2 cores (-n 3 --dist loadgroup), each with one torch thread: a
# test waiting on its processes, a server or a timeout leaves its core to the others (2 workers kept the cores 60%
# busy: 723 s; 3 workers 495 s; 4 oversubscribe: 558 s); `make test`, whose tests seldom wait, runs two; a plain
# `pytest` keeps up to two threads.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else max(1, min(2, os.cpu_count() or 1)))
if WORKER:  # and so does every process a test starts (lean train, lean launch's ranks, the smoke's stages)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Modules whose tests share a module-scoped fixture (a trained run, a server, a reference process): one worker runs
# each whole, so the fixture is built once.
SHARED_FIXTURE_MODULES = {
    "test_export",
    "test_flux2",
    "test_hunyuan_video15",
    "test_mlflow_server",
    "test_qwen_image",
    "test_qwen_image_edit",
    "test_reliability",
    "test_reward_server",
    "test_sequence_parallel",
    "test_tracking",
    "test_wan22",
    "test_wan22_ti2v",
    "test_train",
    "test_vlm_judge",
}
# Run first, so that the workers end together: the smoke pipeline's group (minutes on one worker), then the
# modules of long multi-process and meta-device tests, then the other groups; the single tests last, the small units
# that fill whichever worker is free.
LONG_FIRST = ("smoke", "test_layout", "test_certificate", "test_sharding", "test_sequence_parallel", "test_distributed")


# Two tiers. `make test-full` (CI) checks every claim: every test, every case. `make test` is the quick tier: the tests
# marked `slow` (multi-process and end-to-end) left out (-m "not slow"), and a claim's further cases (the same code
# path at another world size, or in another combination its first case already crosses) carry the `matrix` mark and
# are left to `make test-full` (LEAN_TEST_FULL=1). A test of which only `matrix` cases were collected runs them:
# nothing selected is dropped.
FULL = os.environ.get("LEAN_TEST_FULL", "0") not in ("", "0")


def _group(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return (marker.kwargs.get("name") or marker.args[0]) if marker else None


def pytest_configure(config):
    # lean plan's meta counts (lean.plan.count_cache): one folder for the session, which the workers (started after
    # this, in the controller) and the processes the tests start share, and not the user's ~/.cache
    if WORKER is None and "LEAN_PLAN_CACHE" not in os.environ:
        import tempfile

        os.environ["LEAN_PLAN_CACHE"] = tempfile.mkdtemp(prefix="lean-plan-counts-")
    if WORKER is None and getattr(config.option, "numprocesses", None) and os.environ.get("LEAN_TEST_WARM", "1") != "0":
        _start_shared_warm_python(config)
    # pytest-xdist hands out the groups with the most tests first (--loadscope-reorder, its default): the smoke
    # group's 8 tests then waited behind a dozen module groups (minutes) and ended the run alone. Keep the order below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _start_shared_warm_python(config) -> None:
    """One warm Python server (``tests/warm_python.py``) for every xdist worker, started by the controller before
    them: each worker importing its own cost ~7 CPU-s apiece. The workers find it through LEAN_TEST_WARM_DIR."""
    import tempfile
    from pathlib import Path

    from warm_python import start

    os.environ["OMP_NUM_THREADS"] = "1"  # the server's torch, read at its import: one thread, as every worker's
    folder = Path(tempfile.mkdtemp(prefix="lean-warm-python-"))
    config._lean_warm_server = start(folder, wait=False)
    os.environ["LEAN_TEST_WARM_DIR"] = str(folder)


def pytest_unconfigure(config):
    server = getattr(config, "_lean_warm_server", None)
    if server is not None:
        server.kill()
        server.wait(timeout=30)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in SHARED_FIXTURE_MODULES and _group(item) is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))

    def rank(item) -> int:
        for i, name in enumerate(LONG_FIRST):
            if _group(item) == name or item.module.__name__ == name:
                return i
        return len(LONG_FIRST) + (_group(item) is None)

    items.sort(key=rank)  # stable: the order within a rank is pytest's
    if not FULL:
        _deselect_matrix(config, items)


def _deselect_matrix(config, items) -> None:
    """Leaves the `matrix` cases to `make test-full`, unless no other case of their test was collected."""
    kept = {(item.module.__name__, item.originalname) for item in items if not item.get_closest_marker("matrix")}
    matrix = [i for i in items if i.get_closest_marker("matrix") and (i.module.__name__, i.originalname) in kept]
    if matrix:
        config.hook.pytest_deselected(items=matrix)
        left = set(map(id, matrix))
        items[:] = [item for item in items if id(item) not in left]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)  # relative outputs/ land in the test's own folder
    threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    # what a test changed of the worker stays with the test: a worker left on one core (a benchmark's affinity) ran
    # every later test, and every process they started, on that core, some 10-40x slower beside the other workers
    torch.set_num_threads(threads)
    if os.sched_getaffinity(0) != cpus:
        from lean.parallel.distributed import set_affinity

        set_affinity(cpus)


@pytest.fixture(scope="session")
def clip_folder(tmp_path_factory):
    """A tiny random CLIP folder the model rewards load (``helpers.save_tiny_clip``), built once per session."""
    from helpers import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session", autouse=True)
def _warm_python(tmp_path_factory):
    """The processes the tests start fork from a server with torch, diffusers and mlflow imported
    (``tests/warm_python.py``): its shims go first on PATH, and ``helpers.python()`` names its `python`.
    LEAN_TEST_WARM=0 starts every process afresh."""
    if os.environ.get("LEAN_TEST_WARM", "1") == "0":
        yield None
        return
    import sys
    from pathlib import Path

    from warm_python import start

    shared = os.environ.get("LEAN_TEST_WARM_DIR")  # the controller's, for every worker (pytest_configure)
    folder = Path(shared) if shared else tmp_path_factory.mktemp("warm")
    server = None if shared else start(folder, wait=False)  # its imports run in the background; until then the
    venv = os.path.dirname(sys.executable)  # shims start cold
    os.environ["PATH"] = os.pathsep.join([str(folder), venv, os.environ["PATH"]])
    os.environ["LEAN_TEST_PYTHON"] = str(folder / "python")
    yield folder
    if server is not None:
        server.kill()
        server.wait(timeout=30)
