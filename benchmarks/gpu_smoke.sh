#!/usr/bin/env bash
# The first minutes on a GPU, end to end, in under 4 minutes on one GPU: one iteration of each schedule (FLUX medium,
# bf16, through `lean bench schedules` with one timed round), the float64 and bfloat16 certificates (`lean
# equivalence`, tiny FLUX), the overlap ops on one rank, then a summary. Every step writes its files under OUT as it
# ends (and the bench appends each measured iteration to OUT/schedules/measured.jsonl), and a failing step does not
# stop the others: the summary says which passed.
#   bash benchmarks/gpu_smoke.sh [OUT]      (default OUT=outputs/gpu_smoke; refuses without a GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_smoke}
NEED_GPU=1 source benchmarks/gpu_env.sh || exit $?
mkdir -p "$OUT"
status=()
step() {  # step NAME SECONDS command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  status+=("$name rc=$rc $((SECONDS - start))s")
}
step schedules 120 "$PY" -m lean.cli bench schedules --out "$OUT/schedules" --repeats 1 --warmup 0 --threads 0 \
  --set model.family=flux --set model.size=medium --set model.resolution=512 --set model.dtype=bfloat16 \
  --set train.prompts_per_iteration=2 --set train.group_size=4 --set train.rollout_batch_size=8 \
  --set train.train_batch_size=8 --set model.lora_rank=32 --set model.lora_alpha=64
step equivalence-float64 40 "$PY" -m lean.cli equivalence --out "$OUT/equivalence-float64" --set model.dtype=float64
step equivalence-bfloat16 40 "$PY" -m lean.cli equivalence --out "$OUT/equivalence-bfloat16" \
  --set model.dtype=bfloat16
step overlap 60 "$PY" -m lean.cli bench overlap --nproc 1 --quick --out "$OUT/overlap"
echo "=== summary"
printf '%s\n' "${status[@]}" | tee "$OUT/summary.txt"
"$PY" - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
from lean.schedules import LEAN_SCHEDULES, SCHEDULES
out = Path(sys.argv[1])
def load(path):
    p = out / path
    return json.loads(p.read_text()) if p.exists() else None
bench = load("schedules/schedules.json")
if bench:
    for s in SCHEDULES:
        e = bench[s]
        print(f"{s:10} iter {e['time_iteration_s']:.3f} s  peak {e['peak_memory_mb']:.0f} MiB  MFU {e['mfu']:.3f}"
              + (f"  speedup {e['speedup']:.3f} (bound {e['speedup_bound']:.3f})" if "speedup" in e else ""))
for dtype in ("float64", "bfloat16"):
    cert = load(f"equivalence-{dtype}/equivalence.json")
    if cert:
        print(f"certificate {dtype}: {'PASS' if cert['passes'] else 'FAIL'} "
              + ", ".join(f"{s} rel {cert[s]['max_rel_grad_diff']:.2e}" for s in LEAN_SCHEDULES))
ov = load("overlap/overlap.json")
if ov:
    rows = ov["compute_only"]
    print(f"overlap, 1 rank: {len(rows)} GEMM cases, median MFU {sorted(r['mfu'] for r in rows)[len(rows) // 2]:.2f}")
PY
