# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The paper's experiments
#
# LeanGRPO ([arXiv 2609.03528](https://arxiv.org/abs/2609.03528)) measures its schedules with four experiments; each is
# a lean command (docs/results.md), and `benchmarks/gpu_paper_experiments.sh` runs all four on a GPU node:
#
# - **Table 1, the ablation** (Native, + shared layout, + coalesced sync, Retain, Reweight):
#   `lean launch -n 2 -- bench ablation`; here its committed runs, `benchmarks/results/ablation/` (minutes each)
# - **Fig. 3, the speedup against the timestep fraction**: `lean bench schedules --sweep
#   sample.timestep_fraction=...`; here its committed run, `benchmarks/results/sweep/`
# - **Fig. 6, memory per selected step**: every `lean bench schedules` result (`memory_curve`); here this pipeline's
#   `bench_schedules` stage
# - **App. E, Tables 2-4, the alignment**: `lean equivalence --deterministic`; here its committed runs,
#   `benchmarks/results/alignment/`
#
# lean's figures are ratios measured on 2 CPU cores at the `small` size (FLUX blocks 2 + 4, width 128, float32); the
# paper's are seconds on 8 RTX A6000 at FLUX.1-dev's 12B in bfloat16. What is compared is each ratio against the
# paper's, and why it differs.

# %% tags=["parameters"]
outputs = "../outputs"  # the DVC pipeline's outputs folder
results = "../benchmarks/results"  # the committed benchmark runs
track = True  # log figures and metrics to MLflow (experiment lean-workbench)
parent_run_id = None  # set by the report stage: this notebook's run is nested under it
summary_path = None  # set by the report stage: where this notebook's metrics go (JSON)

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt

from lean.schedules import BASELINE, LEAN_SCHEDULES, RETAIN, REWEIGHT
from lean.tools.alignment import PAPER_REWEIGHT, QUANTITIES
from lean.tools.bench.ablation import PAPER
from lean.tools.bench.memory_curves import curve_rows, format_curves
from lean.tools.bench.sweep import PAPER_FIG3
from lean.workbench.notebook import NotebookLog


def read(path: Path) -> dict:
    return json.loads(path.read_text())


log = NotebookLog("paper", track=track, parent_run_id=parent_run_id)
ablations = {p.stem: read(p) for p in sorted((Path(results) / "ablation").glob("*.json"))}
sweep = read(Path(results) / "sweep" / "sweep.json")
bench = read(Path(outputs) / "bench" / "schedules.json")
alignments = {p.stem: read(p) for p in sorted((Path(results) / "alignment").glob("*.json"))}

# %% [markdown]
# ## Table 1: the ablation
# Each row's speedup over Native (Recompute, whole groups per rank, a gradient sync after every backward), lean's
# beside the paper's. On 2 gloo processes the sync is a small share of the iteration, so the shared layout and the
# coalesced sync change little (the paper's full fine-tune gains 1.33x from coalescing FSDP's reduce-scatters over
# PCIe); the removed recompute is what both measure alike.

# %%
fig, axes = plt.subplots(1, len(ablations), figsize=(4.2 * len(ablations), 3.4), squeeze=False)
metrics = {}
for ax, (name, report) in zip(axes[0], ablations.items()):
    rows = report["rows"]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], 0.4, label="lean (2 CPU processes)")
    ax.bar([i + 0.2 for i in x], [r["paper_speedup"] for r in rows], 0.4, label="paper (8 x A6000)")
    ax.set_xticks(list(x), [r["row"] for r in rows], rotation=30, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title(name, fontsize=9)
    for r in rows:
        metrics[f"ablation_speedup_{name}_{r['row']}"] = r["speedup"]
        metrics[f"ablation_vs_paper_{name}_{r['row']}"] = r["speedup"] / r["paper_speedup"]
    print(f"{name}: " + ", ".join(f"{r['row']} {r['speedup']:.2f}x (paper {r['paper_speedup']:.2f}x)" for r in rows))
axes[0][0].set_ylabel("speedup over native")
axes[0][0].legend(fontsize=7)
fig.tight_layout()
log.figure(fig, "paper_table1_ablation.png")
plt.show()
print("the paper's seconds per iteration:", PAPER)

# %% [markdown]
# ## Fig. 3: the speedup against the timestep fraction
# The share of steps trained rises with the fraction, and with it the recompute the Lean schedules remove: the bound
# (dashed) rises, and each measured speedup (solid) follows it. The shaded bands are the paper's ranges over the same
# fractions for DanceGRPO's FLUX LoRA run.

# %%
points = sweep["points"]
x = [float(p["value"]) for p in points]
fig, ax = plt.subplots(figsize=(5.5, 3.6))
paper_lora = PAPER_FIG3["DanceGRPO FLUX LoRA (bf16)"]
for s in LEAN_SCHEDULES:
    line = ax.plot(x, [p[s]["speedup"] for p in points], marker="o", label=f"{s}")[0]
    ax.plot(x, [p[s]["speedup_bound"] for p in points], ls="--", color=line.get_color(), label=f"{s} bound")
    ax.axhspan(*paper_lora[s], color=line.get_color(), alpha=0.12, label=f"paper {s} (LoRA)")
    for p in points:
        metrics[f"sweep_speedup_{s}_{p['value']}"] = p[s]["speedup"]
        metrics[f"sweep_of_bound_{s}_{p['value']}"] = p[s]["speedup_vs_bound"]
ax.axhline(1.0, color="grey", lw=0.8)
ax.set_xlabel(sweep["key"])
ax.set_ylabel("speedup over Recompute")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
log.figure(fig, "paper_fig3_sweep.png")
plt.show()
for setting, ranges in PAPER_FIG3.items():
    print(f"paper, {setting}: " + ", ".join(f"{s} {lo:.2f}-{hi:.2f}x" for s, (lo, hi) in ranges.items()))

# %% [markdown]
# ## Fig. 6: memory per selected step
# Resident memory after each SDE step of the rollout (this pipeline's benchmark: live bytes on the CPU), then the peaks
# of the update and of the optimizer stage. Retain climbs by one kept graph per tracked step (the plan's per-step
# term, dotted); Recompute stays flat until its update; Reweight stays flat beside its gradient buffers.

# %%
rows = curve_rows(bench)
fig, ax = plt.subplots(figsize=(7.5, 3.8))
for r in rows:
    steps = list(range(len(r["steps_mb"])))
    phases = [r.get(f"{p}_peak_mb", float("nan")) - r["start_mb"] for p in ("rollout", "update", "optimizer")]
    line = ax.plot(steps, r["steps_mb"], marker="o", label=r["schedule"])[0]
    ax.plot([len(steps) + i for i in range(3)], phases, marker="s", ls=":", color=line.get_color())
retain = next(r for r in rows if r["schedule"] == RETAIN)
tracked = [i for i, t in enumerate(retain["tracked"]) if t]
first, last = tracked[0], tracked[-1]
climb = retain["steps_mb"][first] + retain["plan_slope_mb"] * (last - first)
ax.plot([first, last], [retain["steps_mb"][first], climb], "k:", label="plan: one kept graph per step")
n = len(rows[0]["steps_mb"])
ax.set_xticks([*range(n), n, n + 1, n + 2], [*map(str, range(n)), "rollout\npeak", "update\npeak", "optim.\npeak"])
ax.tick_params(axis="x", labelsize=7)
ax.set_xlabel("SDE step")
ax.set_ylabel("MiB above the iteration's start")
ax.legend(fontsize=7)
fig.tight_layout()
log.figure(fig, "paper_fig6_memory.png")
plt.show()
print(format_curves(bench))
metrics["memory_slope_vs_plan_retain"] = retain["slope_mb"] / retain["plan_slope_mb"]
for r in rows:
    if r["plan_optimizer_peak_mb"]:
        metrics[f"optimizer_peak_vs_plan_{r['schedule']}"] = r["optimizer_peak_mb"] / r["plan_optimizer_peak_mb"]

# %% [markdown]
# ## App. E: numerical alignment
# Fixed trajectories, deterministic kernels, Recompute at the rollout's micro-batches and Retain's graphs backpropagated
# one by one in Recompute's order: Retain's gradient, update and AdamW moments are bitwise Recompute's (the paper's
# Table 2); Reweight's are close, not equal (it scales a formed gradient by the advantage, Recompute the loss).

# %%
print(f"{'run':18} {'schedule':9} {'quantity':11} {'cosine':>9} {'RelL2':>10}  bitwise  paper (cos, RelL2)")
for run, report in alignments.items():
    for s in (RETAIN, REWEIGHT):
        for q in QUANTITIES:
            m = report["alignment"][s][q]
            paper = PAPER_REWEIGHT.get(q) if s == REWEIGHT else None
            cited = f"{paper[0]:.6f}, {paper[1]:.2%}" if paper else ""
            print(f"{run:18} {s:9} {q:11} {m['cosine']:9.6f} {m['rel_l2']:10.3e}  {str(m['bitwise_equal']):7}  {cited}")
    metrics[f"alignment_{run}_retain_bitwise"] = float(
        all(report["alignment"][RETAIN][q]["bitwise_equal"] for q in QUANTITIES)
    )
    metrics[f"alignment_{run}_reweight_gradient_cosine"] = report["alignment"][REWEIGHT]["gradient"]["cosine"]
    metrics[f"alignment_{run}_reweight_gradient_rel_l2"] = report["alignment"][REWEIGHT]["gradient"]["rel_l2"]

# %%
log.log(metrics)
print(f"{len(metrics)} metrics; baseline {BASELINE}")
log.close(summary_path)
