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
# # FlashOverlap: communication hidden behind compute
#
# `lean bench overlap` (the `overlap` stage, 2 processes under Accelerate) runs each overlap op with each method:
# `collective` (communicate, then compute), `sliced` (the GEMM split into chunks that overlap the next chunk's
# transfer) and `flash` (tile-wise signalling). Per case: latency, the communication alone and the compute alone;
# `hidden fraction = 1 - (latency - compute) / communication` (1: all hidden). The Gantt charts are the timeline
# model's schedules; the projection applies the model to H100/H200 profiles at Llama-70B-like shapes.

# %% tags=["parameters"]
outputs = "../outputs"  # the DVC pipeline's outputs folder
track = True  # log figures and metrics to MLflow (experiment lean-workbench)
parent_run_id = None  # set by the report stage: this notebook's run is nested under it
summary_path = None  # set by the report stage: where this notebook's metrics go (JSON)

# %%
import json
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Image, display

from lean.bench.overlap_report import flat_metrics
from lean.workbench.notebook import NotebookLog

folder = Path(outputs) / "overlap" / "bench"
summary = json.loads((folder / "overlap.json").read_text())
projection = json.loads((folder / "projection.json").read_text())
log = NotebookLog("overlap", track=track, parent_run_id=parent_run_id)
print(
    f"{summary['world']} x {summary['device_name']} ({summary['backend']}, {summary['dtype']}), "
    f"medians of {summary['repeats']} repeats"
)

# %% [markdown]
# ## Latency and hidden fraction per method, op and shape

# %%
cases = sorted({(r["op"], r["shape"]) for r in summary["results"]})
methods = sorted({r["method"] for r in summary["results"]})
by = {(r["op"], r["shape"], r["method"]): r for r in summary["results"]}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, max(3.0, 0.45 * len(cases) + 1)))
width = 0.8 / max(len(methods), 1)
for k, m in enumerate(methods):
    ys = [i + k * width for i in range(len(cases))]
    ax1.barh(ys, [by[c + (m,)]["latency_ms"] if c + (m,) in by else 0 for c in cases], width, label=m)
    ax2.barh(ys, [by[c + (m,)]["hidden_fraction"] if c + (m,) in by else 0 for c in cases], width, label=m)
labels = [f"{op.split()[0]} / {shape}" for op, shape in cases]
for ax in (ax1, ax2):
    ax.set_yticks([i + 0.4 - width / 2 for i in range(len(cases))], labels, fontsize=7)
ax1.set_xlabel("latency, ms")
ax2.set_xlabel("hidden fraction of the communication")
ax2.axvline(1.0, color="k", lw=0.5)
ax1.legend(fontsize=7)
fig.tight_layout()
log.figure(fig, "overlap_latency_hidden.png")
plt.show()
if summary.get("not_measured"):
    print("not measured:", *summary["not_measured"], sep="\n  ")

# %% [markdown]
# ## Gantt timelines (timeline model; red: exposed communication)

# %%
for png in sorted(folder.glob("gantt*.png")):
    display(Image(filename=str(png)))
    log.run.log_artifact(png, "figures")

# %% [markdown]
# ## GPU projection (timeline model)

# %%
rows = projection["rows"]
groups = defaultdict(dict)
for r in rows:
    groups[(r["op"], r["tokens"], r["profile"])][r["method"]] = r
fig, ax = plt.subplots(figsize=(9, max(3.0, 0.3 * len(groups))))
keys = sorted(groups)
proj_methods = sorted({r["method"] for r in rows})
w = 0.8 / max(len(proj_methods), 1)
for k, m in enumerate(proj_methods):
    ax.barh(
        [i + k * w for i in range(len(keys))], [groups[key].get(m, {}).get("latency_ms", 0) for key in keys], w, label=m
    )
ax.set_yticks(
    [i + 0.4 - w / 2 for i in range(len(keys))],
    [f"{op.split()[0]} {tokens} tok {profile}" for op, tokens, profile in keys],
    fontsize=6,
)
ax.set_xlabel("predicted latency, ms")
ax.set_title(projection["shapes"], fontsize=8)
ax.legend(fontsize=7)
fig.tight_layout()
log.figure(fig, "overlap_projection.png")
plt.show()

# %%
metrics = flat_metrics(summary)
log.log(metrics)
for k, v in metrics.items():
    print(f"{k:40s} {v:.4f}")
log.close(summary_path)
