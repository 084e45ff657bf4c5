# Two commands on a fresh machine:  `make repro` (main job)  and  `make test` (test suite).
# Each creates ./.venv and installs everything it needs. On a machine without an NVIDIA GPU, torch comes as the
# CPU build (pinned, so pip never pulls a multi-GB CUDA wheel); with `nvidia-smi` present, the normal CUDA build.
# One resolve for everything, by uv where it installs (in parallel, byte-compiling on every core: 41 s against pip's
# 128 s on 2 cores), with pip's own package sources (.ci/uv_args.py); by pip where uv does not install or resolve.
# Every installed module is byte-compiled: where PYTHONDONTWRITEBYTECODE is set (this machine's environment) Python
# would otherwise recompile every module in every process. compileall exits 1 on the few files that are not Python 3
# source (templates, test data of some packages), which nothing imports.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# pytest-xdist workers for `make test` (tests/conftest.py: one torch thread each, the long groups first; 3 on 2 cores
# keep both busy while a test waits on its processes)
TEST_WORKERS ?= 3
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: install lint test repro bench ui clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	if $(BIN)/python -m pip install --quiet uv && \
	  $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode $$($(BIN)/python .ci/uv_args.py) \
	    "$(TORCH)" -e ".[test,workbench]"; then :; \
	else \
	  $(BIN)/python -m pip install --quiet --no-compile "$(TORCH)" -e ".[test,workbench]" && \
	  { $(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true; }; \
	fi
	$(BIN)/python -m compileall -q -j 0 lean pipelines > /dev/null
	touch $@

install: $(BIN)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The workbench (dvc.yaml): prepare -> rollout -> advantage -> update x3 -> equivalence, train x3, bench, overlap,
# report; the stages call `python`, so the venv goes first on PATH. A second `make repro` reruns nothing.
repro: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

# Re-measures the benchmarks on this machine (the bench_schedules, overlap and bench_presets stages, forced, the last
# about 40 min on one core; their figures then carry this machine's `measured_on`), then the reproduction check
# alone: outputs/report/reproduction.json and its verdict.
bench: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro -f -s bench_schedules overlap bench_presets
	$(BIN)/python -m pipelines.report --check

# MLflow's UI on the workbench's store (./mlflow.db, or $MLFLOW_TRACKING_URI): prints the URL of the experiment's
# runs (MLflow 3.17 opens its GenAI overview otherwise) and of the saved view comparing the schedules; options after
# UI=, e.g. `make ui UI="--port 5001"`.
ui: install
	$(BIN)/lean ui $(UI)

clean:
	rm -rf $(VENV) outputs
