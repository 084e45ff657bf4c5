# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
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
# transfer) and `flash` (tile-wise signalling), and PyTorch's fused ops (`symm_mem`) where they can run. Per case:
# latency, the communication alone and the compute alone; `exposed = latency - compute-only` (ms), what the op costs
# beyond the GEMMs of the same shapes: 0 when the communication is all hidden, comparable across methods. The Gantt
# charts are the timeline model's schedules; the projection applies the model to H100/H200 profiles at
# Llama-70B-like shapes, per op and per block (the whole MLP, Ulysses attention, the data-parallel rows), and checks
# it against published H100/H800 figures. Last, the same methods inside training: one GRPO iteration of every
# schedule under sequence parallelism (Ulysses attention with fused projections, `parallel.sequence_parallel`), with
# its exposed communication in ms against the same iteration with every transfer replaced by a local copy.

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

from lean.schedules import SCHEDULES
from lean.tools.bench.overlap_report import flat_metrics, print_video_ulysses
from lean.tools.bench.sequence_parallel import COMPUTE_ONLY, format_table
from lean.tools.bench.sequence_parallel import flat_metrics as sequence_parallel_metrics
from lean.workbench.notebook import NotebookLog

folder = Path(outputs) / "overlap" / "bench"
summary = json.loads((folder / "overlap.json").read_text())
projection = json.loads((folder / "projection.json").read_text())
log = NotebookLog("overlap", track=track, parent_run_id=parent_run_id)
print(
    f"{summary['world']} x {summary['device_name']} ({summary['backend']}, {summary['dtype']}), "
    f"medians of {summary['repeats']} repeats"
)


# %%
def bars(ax, groups, series, value, width_total=0.8):
    """Horizontal bars: one group per key of ``groups`` (its label), one bar per series, ``value(group, series)``."""
    width = width_total / max(len(series), 1)
    for k, s in enumerate(series):
        ax.barh([i + k * width for i in range(len(groups))], [value(g, s) for g in groups], width, label=s)
    ax.set_yticks([i + width_total / 2 - width / 2 for i in range(len(groups))], list(groups.values()), fontsize=7)


# %% [markdown]
# ## Latency and exposed communication per method, op and shape

# %%
cases = sorted({(r["op"], r["shape"]) for r in summary["results"]})
methods = sorted({r["method"] for r in summary["results"]})
by = {(r["op"], r["shape"], r["method"]): r for r in summary["results"]}
groups = {c: f"{c[0].split()[0]} / {c[1]}" for c in cases}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, max(3.0, 0.45 * len(cases) + 1)))
bars(ax1, groups, methods, lambda c, m: by[c + (m,)]["latency_ms"] if c + (m,) in by else 0)
bars(ax2, groups, methods, lambda c, m: by[c + (m,)]["exposed_ms"] if c + (m,) in by else 0)
ax1.set_xlabel("latency, ms")
ax2.set_xlabel("exposed communication (latency - compute-only), ms")
ax2.axvline(0.0, color="k", lw=0.5)
ax1.legend(fontsize=7)
fig.tight_layout()
log.figure(fig, "overlap_latency_exposed.png")
plt.show()
if summary.get("not_measured"):
    print("not measured:", *summary["not_measured"], sep="\n  ")
for row in summary.get("skipped", []):
    print(f"skipped: {row['method']} for {row['op']} ({row['shape']}): {row['reason']}")

# %% [markdown]
# ## Gantt timelines (timeline model; red: communication while compute idles)

# %%
for png in sorted(folder.glob("gantt*.png")):
    display(Image(filename=str(png)))
    log.run.log_artifact(png, "figures")

# %% [markdown]
# ## GPU projection (timeline model): exposed communication per op and per block

# %%
proj_methods = sorted({r["method"] for r in projection["rows"]})
fig, axes = plt.subplots(1, 2, figsize=(13, max(3.0, 0.3 * len(projection["rows"]) / len(proj_methods))))
for ax, key, rows in zip(axes, ("op", "block"), (projection["rows"], projection["blocks"])):
    cells = defaultdict(dict)
    for r in rows:
        cells[(r[key], r["tokens"], r["profile"])][r["method"]] = r
    groups = {g: f"{g[0].split()[0]} {g[1]} tok {g[2]}" for g in sorted(cells)}
    bars(ax, groups, proj_methods, lambda g, m, cells=cells: cells[g].get(m, {}).get("exposed_ms", 0))
    ax.set_xlabel(f"predicted exposed communication per {key}, ms")
axes[0].legend(fontsize=7)
fig.suptitle(projection["shapes"], fontsize=8)
fig.tight_layout()
log.figure(fig, "overlap_projection.png")
plt.show()
print_video_ulysses(projection.get("video_ulysses", []))  # sequence parallelism's Ulysses block at Wan's shapes

# %% [markdown]
# ## The model against published figures
#
# `projected`: the wave model with the 128x256 tile (pessimistic for small chunk GEMMs); `best tiles`: the best of
# several tiles at the same per-SM rate (optimistic). Non-overlapped figures are compared with `collective`,
# overlapped ones (Flux's fused kernel, async TP) with `flash`.

# %%
for r in projection["published"]:
    print(
        f"{r['case']:22s} {r['quantity']:38s} published {r['published']:7.3f} {r['unit']:2s} "
        f"projected {r['projected']:7.3f} ({r['error']:+4.0%}), best tiles {r['projected_best_tiles']:7.3f} "
        f"({r['error_best_tiles']:+4.0%})"
    )
print("\nsources:", *dict.fromkeys(r["source"] for r in projection["published"]), sep="\n  ")
print("assumptions:", *projection["assumptions"], sep="\n  - ")

# %% [markdown]
# ## Inside training: a GRPO iteration under sequence parallelism
#
# `lean bench schedules --set parallel.sequence_parallel=2` under `lean launch -n 2` (the stage's second part): every
# schedule with each method and once compute-only (every transfer a local copy of the same bytes), interleaved in one
# run. Exposed ms = median iteration time - the compute-only median: the communication's cost per iteration.

# %%
iterations = json.loads((Path(outputs) / "overlap" / "sequence_parallel" / "sequence_parallel.json").read_text())
c = iterations["config"]
print(
    f"{c['family']}/{c['size']} {c['resolution']} px, {c['tokens']} tokens over {c['sequence_parallel']} processes, "
    f"{c['samples_per_group']} samples, {c['num_steps']} steps, median of {c['repeats']}"
)
schedules = [s for s in SCHEDULES if s in iterations]
sp_methods = [m for m in iterations["methods"] if m != COMPUTE_ONLY]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3))
bars(ax1, {s: s for s in schedules}, iterations["methods"], lambda s, m: iterations[s][m]["time_iteration_s"])
bars(ax2, {s: s for s in schedules}, sp_methods, lambda s, m: iterations[s][m]["exposed_ms"])
ax1.set_xlabel("iteration time, s")
ax2.set_xlabel("exposed communication per iteration, ms")
ax2.axvline(0.0, color="k", lw=0.5)
ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
log.figure(fig, "sequence_parallel_iteration.png")
plt.show()
print(format_table(iterations))

# %%
metrics = flat_metrics(summary) | sequence_parallel_metrics(iterations)
log.log(metrics)
for k, v in metrics.items():
    print(f"{k:40s} {v:.4f}")
log.close(summary_path)
