#!/usr/bin/env bash
# FlashOverlap on GPUs in under 5 minutes: `lean bench overlap` with NCCL, one rank per visible GPU. Each measured
# case (and each variant skipped, with the reason) is appended to OUT/measured.jsonl as soon as it is measured, so a
# run stopped by the time limit keeps what it measured.
#
#   benchmarks/gpu_overlap.sh [OUT]          (default OUT=outputs/overlap-gpu)
#
# >= 2 GPUs  every op x method x shape (CommFuse MLP, Llama-70B-like layer), bf16, NCCL: latency and exposed
#            communication (latency - compute-only, ms) of collective, sliced, flash, flash-bidir, and PyTorch's
#            fused ops (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter on mlp.fc1 / fc2)
#            where this torch has them (overlap.json's `skipped` says why not otherwise); the calibrated contention
#            and the model's error on them.
#            Then the SP GRPO iteration (>= 2 GPUs): `lean bench schedules` on Wan (small, 480x832-like token count
#            scaled down: 256 px x 17 frames = 1280 video tokens) under `parallel.sequence_parallel=2` on 2 GPUs, every
#            schedule x (collective, sliced, flash, compute-only): iteration time and exposed ms per method
#            (OUT/sequence_parallel/sequence_parallel.json, measured.jsonl as each iteration ends).
#    1 GPU   what needs no peer: compute-only GEMMs and MFU, memory bandwidth, a copy on a side stream overlapping a
#            GEMM (loopback), the H100/H200 projection and its check against published figures; overlap.json's
#            `not_measured` lists the rest.
#    0 GPUs  says so and runs the quick CPU benchmark (2 gloo processes) instead.
# Environment: PYTHON (interpreter, see gpu_env.sh), GPUS (override the detected count), DRY_RUN=1 (print the
# command, run nothing). A CPU build of torch beside a GPU is refused (exit 3), never benchmarked quietly.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/overlap-gpu}
source benchmarks/gpu_env.sh

if [ "$GPUS" -ge 2 ]; then
  cmd=("$PY" -m lean.cli bench overlap --nproc "$GPUS" --out "$OUT" --repeats 10 --warmup 3 --timeout 120)
elif [ "$GPUS" -eq 1 ]; then
  echo "gpu_overlap: 1 GPU: measuring GEMMs, memory and side-stream loopback only;" \
       "per-method latency, exposed communication, transfers between GPUs and PyTorch's fused ops need >= 2 GPUs"
  cmd=("$PY" -m lean.cli bench overlap --nproc 1 --out "$OUT" --repeats 10 --warmup 3)
else
  echo "gpu_overlap: no GPU visible: running the quick CPU benchmark (2 gloo processes) instead"
  cmd=("$PY" -m lean.cli bench overlap --nproc 2 --quick --out "$OUT")
fi
sp=()
if [ "$GPUS" -ge 2 ]; then
  sp=("$PY" -m lean.cli launch -n 2 -- bench schedules --params none --out "$OUT/sequence_parallel"
      --repeats 3 --warmup 1 --threads 0 --set model.family=wan --set model.size=small --set model.resolution=256
      --set model.num_frames=17 --set model.dtype=bfloat16 --set parallel.sequence_parallel=2)
fi
echo "+ ${cmd[*]}"
if [ ${#sp[@]} -gt 0 ]; then echo "+ ${sp[*]}"; fi
if [ "${DRY_RUN:-0}" = 1 ]; then exit 0; fi
if [ ${#sp[@]} -eq 0 ]; then exec timeout 290 "${cmd[@]}"; fi
status=0
timeout 170 "${cmd[@]}" || status=$?   # what it measured is in OUT/measured.jsonl either way
timeout 120 "${sp[@]}" || status=$?
exit $status
