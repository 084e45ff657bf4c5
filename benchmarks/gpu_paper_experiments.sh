#!/usr/bin/env bash
# LeanGRPO's experiments (arXiv 2609.03528) on the GPUs of one node, as lean commands (docs/results.md, "The paper's
# ablation" and the sections after it), each writing the tables lean's CPU figures come in:
#   1. Table 1's ablation, LoRA and full fine-tune: `lean launch -n GPUS -- bench ablation` (native, + shared layout,
#      + coalesced sync, Retain, Reweight)                                        -> OUT/ablation/{lora,full_finetune}/
#   2. the speedup against the timestep fraction (Fig. 3): `lean bench schedules --sweep` -> OUT/sweep/sweep.{json,png}
#   3. memory per selected step (Fig. 6): every sweep point's schedules.json carries each schedule's `memory_curve`
#      (resident memory after each SDE step, the update's and the optimizer stage's peaks) beside the plan's terms;
#      OUT/memory.md tabulates them at the largest fraction
#   4. the alignment protocol (App. E, Tables 2-4): `lean equivalence --deterministic` in bfloat16 -> OUT/alignment/
# DanceGRPO's FLUX recipe (--preset dancegrpo-flux) in the paper's on-policy form (train.on_policy=true), random weights
# at SIZE: `medium` by default (FLUX.1-dev's blocks at half width, 512 px: minutes), `full` for the published 12B at
# 720 px (hours: Table 1's iterations take ~1000-1900 s each on 8 A6000).
# Usage: bash benchmarks/gpu_paper_experiments.sh [OUT_DIR]   (refuses without a GPU)
#   env: SIZE=medium|full  FRACTIONS=0.25,0.5,0.75,1.0  REPEATS=3  WARMUP=1  GPUS=<visible GPUs>
#   DRY_RUN=1: the same commands on this machine's CPU, 2 gloo processes, a tiny FLUX (seconds each), one ablation
#   and two fractions: what tests/test_gpu_scripts.py runs
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_paper_experiments}
if [ "${DRY_RUN:-0}" = 1 ]; then
  source benchmarks/gpu_env.sh
  GPUS=2; SIZE=tiny; FRACTIONS=${FRACTIONS:-0.5,1.0}; REPEATS=1; WARMUP=0; KINDS=(lora)
  SIZE_SETS=(--set model.size=tiny --set model.resolution=32 --set model.text_max_length=8 --set sample.num_steps=4
             --set train.prompts_per_iteration=2 --set train.group_size=2 --set train.rollout_batch_size=2
             --set train.train_batch_size=2)
else
  NEED_GPU=1 source benchmarks/gpu_env.sh
  FRACTIONS=${FRACTIONS:-0.25,0.5,0.75,1.0}; REPEATS=${REPEATS:-3}; WARMUP=${WARMUP:-1}; KINDS=(lora full_finetune)
  case "${SIZE:-medium}" in
    full) SIZE_SETS=(--set model.size=full) ;;
    medium) SIZE_SETS=(--set model.size=medium --set model.resolution=512) ;;
    *) echo "$(basename "$0"): SIZE must be medium or full, not ${SIZE}" >&2; exit 2 ;;
  esac
fi
mkdir -p "$OUT"
PAPER=(--preset dancegrpo-flux --set train.on_policy=true "${SIZE_SETS[@]}")
TIMED=(--repeats "$REPEATS" --warmup "$WARMUP")
{
  echo "# LeanGRPO's experiments: $(date -u +%FT%TZ), $GPUS process(es), size ${SIZE:-medium}${DRY_RUN:+ (dry run: the CPU)}"
  for kind in "${KINDS[@]}"; do  # 1. Table 1
    sets=(--set sample.timestep_fraction=1.0)
    [ "$kind" = full_finetune ] && sets+=(--set model.full_finetune=true --set parallel.shard=fsdp)
    echo; echo "## Table 1: the ablation, $kind"
    "$PY" -m lean.cli launch -n "$GPUS" -- bench ablation "${PAPER[@]}" "${sets[@]}" "${TIMED[@]}" \
      --out "$OUT/ablation/$kind"
  done
  echo; echo "## Fig. 3: the speedup against the timestep fraction"  # 2.
  "$PY" -m lean.cli bench schedules "${PAPER[@]}" --sweep "sample.timestep_fraction=$FRACTIONS" "${TIMED[@]}" \
    --out "$OUT/sweep"
  echo; echo "## Fig. 6: memory per selected step"  # 3. from the largest fraction's run
  "$PY" -m lean.tools.bench.memory_curves "$OUT/sweep/sample.timestep_fraction=${FRACTIONS##*,}/schedules.json" \
    --out "$OUT/memory.md"
  echo; echo "## App. E: the alignment protocol, bfloat16"  # 4.
  "$PY" -m lean.cli equivalence "${PAPER[@]}" --set model.dtype=bfloat16 --deterministic --out "$OUT/alignment"
} 2>&1 | tee "$OUT/summary.md"
