#!/usr/bin/env bash
# LeanGRPO schedules on one CUDA GPU, bfloat16, a FLUX-architecture transformer large enough to be compute-bound:
# 512 px through the 8x VAE -> 64x64 latent -> 1024 image tokens (FLUX's 512x512 token count), random weights.
# Runs `lean bench schedules` (Recompute / Retain / Reweight interleaved, medians; every measured iteration is
# appended to OUT/measured.jsonl as it ends, so a timeout keeps them), `lean plan`, and the float64 and bfloat16
# certificates (`lean equivalence`, tiny FLUX), and prints their tables. < 5 minutes.
# Usage: bash benchmarks/gpu_schedules.sh [OUT_DIR] [extra --set overrides...]   (refuses without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_schedules}; shift || true
NEED_GPU=1 source benchmarks/gpu_env.sh
MEDIUM=(--set model.family=flux --set model.size=medium --set model.resolution=512 --set model.dtype=bfloat16
        --set train.prompts_per_iteration=2 --set train.group_size=4 --set model.lora_rank=32 --set model.lora_alpha=64)
timeout 240 "$PY" -m lean.cli bench schedules --out "$OUT" --repeats 3 --warmup 1 --threads 0 "${MEDIUM[@]}" \
  --set sample.num_steps=10 --set sample.timestep_fraction=0.99 --set sample.cfg=true \
  --set train.rollout_batch_size=8 --set train.train_batch_size=8 "$@"
timeout 60 "$PY" -m lean.cli plan --out "$OUT" "${MEDIUM[@]}" "$@"
for dtype in float64 bfloat16; do  # the bf16 certificate reports how far rounding moves Recompute (issue 17)
  timeout 60 "$PY" -m lean.cli equivalence --out "$OUT/equivalence-$dtype" --set model.dtype=$dtype || true
done
