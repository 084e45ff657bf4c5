# Sourced by the GPU scripts: choose the interpreter, refuse a CPU build of torch where a GPU is present, and make
# sure lean is installed (a fresh clone has only its sources). Sets PY and GPUS; exits with a one-line reason.
#   PYTHON   interpreter to use (default: .venv/bin/python, beside a GPU only when its torch can use it; else python3)
#   NEED_GPU 1: exit 2 when no GPU is visible (the script has nothing to measure without one)
HAS_SMI=0; command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && HAS_SMI=1
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  # `make` builds .venv with a CPU torch where nvidia-smi is missing: beside a GPU, take it only if it can use it
  if [ -x .venv/bin/python ] && { [ "$HAS_SMI" = 0 ] || .venv/bin/python -c \
      'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }; then PY=.venv/bin/python; fi
fi
# One interpreter start for every torch figure below (an `import torch` costs seconds on a busy CPU)
TORCH=$("$PY" -c 'import torch; c = torch.cuda.is_available()
print(int(c), torch.cuda.device_count() if c else 0, torch.__version__, torch.version.cuda)' 2>/dev/null || echo none)
read -r TORCH_CUDA TORCH_GPUS TORCH_VERSION TORCH_VERSION_CUDA <<< "$TORCH"
if [ "$TORCH_CUDA" = none ]; then
  echo "$(basename "$0"): $PY has no torch: install a CUDA build first (python3 -m pip install torch)" >&2; exit 2
fi
if [ "$HAS_SMI" = 1 ] && [ "$TORCH_CUDA" = 0 ]; then
  echo "$(basename "$0"): a GPU is present but $PY's torch $TORCH_VERSION" \
       "cannot use it (a CPU build?): install a CUDA build (python3 -m pip install --force-reinstall torch)" >&2
  exit 3
fi
GPUS=${GPUS:-$TORCH_GPUS}
if [ "${NEED_GPU:-0}" = 1 ] && [ "$GPUS" -eq 0 ]; then
  echo "$(basename "$0"): no CUDA GPU visible: nothing to measure here (the CPU benchmarks are" \
       "\`lean bench schedules\` and \`lean bench overlap\`)" >&2
  exit 2
fi
# Installed, not merely importable from the repository root (lean/ would import from here without its dependencies)
if ! "$PY" -c 'import importlib.metadata as m; m.version("lean")' >/dev/null 2>&1; then
  echo "$(basename "$0"): installing lean into $PY (pip install -e .; the CUDA torch stays)"
  "$PY" -m pip install -q -e . || { echo "$(basename "$0"): pip install -e . failed" >&2; exit 2; }
fi
export PYTHONUNBUFFERED=1
if [ "$HAS_SMI" = 1 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
echo "torch $TORCH_VERSION cuda $TORCH_VERSION_CUDA"
