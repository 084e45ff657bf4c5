# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Speedup: Recompute vs Retain vs Reweight
#
# One GRPO iteration of each schedule, timed interleaved from the same weights (`lean bench schedules`, the
# `bench_schedules` stage). Recompute runs the policy twice over every trained step (rollout, then the recomputed
# forward of the update); Retain and Reweight run it once. The **analytic bound** is the speedup if removing the
# recompute forward were free and nothing else changed:
# `(rollout + recompute_forward + backward) / (rollout + backward)`, from Recompute's own phases.
# MFU counts the FLOPs the algorithm needs (no recompute) per second of iteration, against the peak FLOP/s; HFU counts
# every FLOP executed. The plan columns are `lean plan`'s predictions from one probed step.

# %% tags=["parameters"]
outputs = "../outputs"  # the DVC pipeline's outputs folder
track = True  # log figures and metrics to MLflow (experiment lean-workbench)
parent_run_id = None  # set by the report stage: this notebook's run is nested under it
summary_path = None  # set by the report stage: where this notebook's metrics go (JSON)

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt

from lean.schedules import BASELINE, SCHEDULES
from lean.tools.bench.schedules import flat_metrics
from lean.workbench.notebook import NotebookLog

bench = json.loads((Path(outputs) / "bench" / "schedules.json").read_text())
plan = json.loads((Path(outputs) / "bench" / "plan.json").read_text())
schedules = list(SCHEDULES)
log = NotebookLog("speedup", track=track, parent_run_id=parent_run_id)
print(
    {k: bench["config"][k] for k in ("family", "size", "dtype", "num_steps", "samples_per_process")},
    f"peak {bench['peak_flops'] / 1e9:.1f} GFLOP/s ({bench['peak_flops_source']})",
)

# %% [markdown]
# ## Per-phase time of one iteration, and the bound
# Bars: measured medians, stacked by phase. The dashed line on Retain and Reweight is Recompute's time divided by the
# analytic bound; a bar below it beats the bound (Reweight also moves the backward into the rollout).


# %%
def segments(s: str) -> dict[str, float]:
    """Non-overlapping parts of the iteration. Reweight backpropagates inside its rollout, so there the rollout
    phase contains the backward; elsewhere the backward (and Recompute's second forward) is in the update."""
    e = bench[s]
    forward = e["time_rollout_s"] - (e["time_backward_s"] if SCHEDULES[s].backward_in_rollout else 0.0)
    parts = {
        "rollout forward": forward,
        "recompute forward": e["time_recompute_forward_s"],
        "backward": e["time_backward_s"],
    }
    parts["other (reward, optimizer, ...)"] = e["time_iteration_s"] - sum(parts.values())
    return parts


fig, ax = plt.subplots(figsize=(7, 3.5))
for i, s in enumerate(schedules):
    e, bottom = bench[s], 0.0
    for j, (label, seconds) in enumerate(segments(s).items()):
        ax.bar(i, seconds, bottom=bottom, color=f"C{j}", label=label if i == 0 else None)
        bottom += seconds
    ax.plot(i + 0.3, plan["prediction"][s]["time_iteration_s"], "k^", label="plan (predicted)" if i == 0 else None)
    if s != BASELINE:
        bound = bench[BASELINE]["time_iteration_s"] / e["speedup_bound"]
        ax.hlines(bound, i - 0.4, i + 0.4, colors="k", linestyles="--", label="bound" if i == 1 else None)
        ax.text(
            i,
            e["time_iteration_s"] * 1.02,
            f"{e['speedup']:.2f}x (bound {e['speedup_bound']:.2f}x)",
            ha="center",
            va="bottom",
            fontsize=8,
        )
ax.set_xticks(range(3), schedules)
ax.set_ylabel("seconds per iteration")
ax.legend(fontsize=7, ncol=2)
ax.set_title("time per iteration by phase")
log.figure(fig, "speedup_phases.png")
plt.show()

# %% [markdown]
# ## MFU / HFU and peak memory

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
x = range(3)
ax1.bar([i - 0.2 for i in x], [bench[s]["mfu"] * 100 for s in schedules], 0.4, label="MFU (needed FLOPs)")
ax1.bar([i + 0.2 for i in x], [bench[s]["hfu"] * 100 for s in schedules], 0.4, label="HFU (executed FLOPs)")
ax1.set_xticks(list(x), schedules)
ax1.set_ylabel("% of peak FLOP/s")
ax1.legend(fontsize=7)
ax2.bar([i - 0.2 for i in x], [bench[s]["peak_memory_mb"] for s in schedules], 0.4, label="measured peak")
ax2.bar(
    [i + 0.2 for i in x], [plan["prediction"][s]["peak_memory_mb"] for s in schedules], 0.4, label="plan (predicted)"
)
ax2.set_xticks(list(x), schedules)
ax2.set_ylabel("MiB")
ax2.legend(fontsize=7)
fig.tight_layout()
log.figure(fig, "speedup_mfu_memory.png")
plt.show()

# %%
metrics = flat_metrics(bench)  # the same flat keys as the bench_schedules stage
log.log(metrics)
for k, v in metrics.items():
    print(f"{k:28s} {v:10.4f}")
log.close(summary_path)
