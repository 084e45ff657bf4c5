# Two commands on a fresh machine:  `make repro` (main job)  and  `make test` (test suite).
# Each creates ./.venv and installs everything it needs. On a machine without an NVIDIA GPU, torch comes as the
# CPU build (pinned, so pip never pulls a multi-GB CUDA wheel); with `nvidia-smi` present, the normal CUDA build.
# One resolve for everything, by uv where it installs (in parallel: 4 s from its cache), with pip's own package sources
# (.ci/uv_args.py); by pip where uv does not install or resolve. Nothing is byte-compiled at install: compiling every
# installed module took 80 CPU-s (98 s on 2 cores), most of it for modules nothing imports. Instead every recipe runs
# with bytecode writing on (`unexport PYTHONDONTWRITEBYTECODE`, which this machine's environment sets): the first
# process that imports a module caches it in .venv (14 CPU-s for torch, diffusers, transformers, mlflow and lean),
# and every later process reads it.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# pytest-xdist workers (tests/conftest.py: one torch thread each, the long groups first): `make test`'s quick tier
# keeps 2 cores busy with 2 (152 s against 162 s with 3); `make test-full`'s multi-process tests wait on their
# processes, and 3 keep both cores busy meanwhile
TEST_WORKERS ?= 2
FULL_TEST_WORKERS ?= 3
unexport PYTHONDONTWRITEBYTECODE
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: install lint test test-full repro bench ui clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	if $(BIN)/python -m pip install --quiet uv && \
	  $(BIN)/uv pip install --quiet --python $(BIN)/python $$($(BIN)/python .ci/uv_args.py) \
	    "$(TORCH)" -e ".[test,workbench]"; then :; \
	else \
	  $(BIN)/python -m pip install --quiet --no-compile "$(TORCH)" -e ".[test,workbench]"; \
	fi
	# what nearly every process imports, compiled once here rather than by the first few processes at once; in two
	# processes, one a core (11 s instead of 14 on 2 cores)
	$(BIN)/python -c "import torch, diffusers.models.transformers, peft, lean.cli" & first=$$!; \
	  $(BIN)/python -c "import transformers, mlflow, mlflow.store.tracking.sqlalchemy_store, matplotlib.pyplot" \
	  && wait $$first
	touch $@

install: $(BIN)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the quick suite (under 200 s on 2 cores): every unit, every single-process claim and the lighter multi-process
# ones; not the tests marked `slow` (multi-process and end-to-end: the smoke `dvc repro` with its notebooks, gloo ranks
# under FSDP2, HSDP and sequence parallelism, a killed rank) nor the further cases marked `matrix`
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

# every test: `make test`'s, the `slow` ones and every `matrix` case (other world sizes and combinations of a code path
# `make test` already runs); what CI runs (.ci/run)
test-full: lint
	LEAN_TEST_FULL=1 $(BIN)/python -m pytest -q -n $(FULL_TEST_WORKERS) --dist loadgroup

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
