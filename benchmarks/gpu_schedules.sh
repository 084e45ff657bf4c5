#!/usr/bin/env bash
# LeanGRPO schedules on one CUDA GPU, bfloat16, a FLUX-architecture transformer large enough to be compute-bound:
# 512 px through the 8x VAE -> 64x64 latent -> 1024 image tokens (FLUX's 512x512 token count), random weights.
# Runs `lean bench schedules` (Recompute / Retain / Reweight interleaved, medians) and prints its table. < 5 minutes.
# Usage: bash benchmarks/gpu_schedules.sh [OUT_DIR] [extra --set overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_schedules}; shift || true
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PY=${PYTHON:-python3}
if ! $PY -c "import lean" 2>/dev/null; then $PY -m pip install -q -e . ; fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
export PYTHONUNBUFFERED=1
$PY -m lean.cli bench schedules --out "$OUT" --repeats 3 --warmup 1 --threads 0 \
  --set model.family=flux --set model.size=medium --set model.resolution=512 --set model.dtype=bfloat16 \
  --set sample.num_steps=10 --set sample.timestep_fraction=0.99 --set sample.cfg=true \
  --set train.prompts_per_iteration=2 --set train.group_size=4 \
  --set train.rollout_batch_size=8 --set train.train_batch_size=8 \
  --set model.lora_rank=32 --set model.lora_alpha=64 "$@"
$PY -m lean.cli plan --out "$OUT" \
  --set model.family=flux --set model.size=medium --set model.resolution=512 --set model.dtype=bfloat16 \
  --set train.prompts_per_iteration=2 --set train.group_size=4 --set model.lora_rank=32 --set model.lora_alpha=64 "$@"
