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
# # Objective equivalence: Retain and Reweight compute Recompute's update
#
# The `update@<schedule>` stages each ran one GRPO update from the same weights on the same persisted iteration
# (Retain and Reweight re-ran the rollout in their own process and verified it reproduced the persisted trajectory).
# On every trainable tensor t we compare the gradient g just before the optimizer step with Recompute's g_rc:
# `rel_t = ||g_t - g_rc,t||_inf / ||g_rc,t||_inf`, and the cosine of the flattened gradients. The certificate passes
# when `max_t rel_t` and `1 - cosine` are under the dtype's tolerance (1e-5 / 1e-6 in float32, 1e-10 in float64).

# %% tags=["parameters"]
outputs = "../outputs"  # the DVC pipeline's outputs folder
track = True  # log figures and metrics to MLflow (experiment lean-workbench)
parent_run_id = None  # set by the report stage: this notebook's run is nested under it
summary_path = None  # set by the report stage: where this notebook's metrics go (JSON)

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from safetensors.torch import load_file

from lean.schedules import BASELINE, LEAN_SCHEDULES
from lean.tools.equivalence import half_tolerance
from lean.workbench.method import split_update
from lean.workbench.notebook import NotebookLog

report = json.loads((Path(outputs) / "equivalence" / "equivalence.json").read_text())
updates = {s: load_file(Path(outputs) / "update" / s / "update.safetensors") for s in (BASELINE, *LEAN_SCHEDULES)}
reproduced = {s: json.loads((Path(outputs) / "update" / s / "metrics.json").read_text()) for s in LEAN_SCHEDULES}
log = NotebookLog("equivalence", track=track, parent_run_id=parent_run_id)
print(f"certificate ({report['dtype']}): {'PASS' if report['passes'] else 'FAIL'}; tolerance {report['tolerance']}")
for s in LEAN_SCHEDULES:
    r = report[s]
    print(
        f"{s:9s} max rel grad diff {r['max_rel_grad_diff']:.3e}  1-cos {1 - r['cosine']:.2e}  "
        f"max rel param diff after step {r['max_rel_param_diff_after_step']:.2e}  "
        f"trajectory reproduced: {reproduced[s]['reproduces_trajectory']} "
        f"(max |dx_T| {reproduced[s]['final_latents_max_abs_diff']:.1e})"
    )

# %% [markdown]
# ## Relative gradient difference per parameter tensor

# %%
names = list(report[LEAN_SCHEDULES[0]]["rel_grad_diff_per_tensor"])
floor = 1e-18  # exact zeros drawn at the floor of the log axis
fig, ax = plt.subplots(figsize=(8, max(3.0, 0.16 * len(names))))
for k, s in enumerate(LEAN_SCHEDULES):
    values = [max(report[s]["rel_grad_diff_per_tensor"][n], floor) for n in names]
    ax.barh([i + 0.4 * k for i in range(len(names))], values, 0.4, label=s)
ax.axvline(report["tolerance"]["max_rel_grad_diff"], color="k", ls="--", label="tolerance")
ax.set_xscale("log")
ax.set_yticks([i + 0.2 for i in range(len(names))], [n.replace("base_model.model.", "") for n in names], fontsize=5)
ax.set_xlabel("||g - g_recompute||_inf / ||g_recompute||_inf")
ax.legend(fontsize=7)
fig.tight_layout()
log.figure(fig, "equivalence_per_tensor.png")
plt.show()

# %% [markdown]
# ## Every gradient entry against Recompute's

# %%
_, ref, _, _ = split_update(updates[BASELINE])
ref = torch.cat([g.flatten() for g in ref]).double()
fig, axes = plt.subplots(1, len(LEAN_SCHEDULES), figsize=(8, 3.4))
for ax, s in zip(axes, LEAN_SCHEDULES):
    _, grads, _, _ = split_update(updates[s])
    g = torch.cat([t.flatten() for t in grads]).double()
    ax.scatter(ref.numpy(), g.numpy(), s=2)
    lim = float(ref.abs().max())
    ax.plot([-lim, lim], [-lim, lim], "k--", lw=0.5)
    ax.set_xlabel("recompute gradient")
    ax.set_ylabel(f"{s} gradient")
    ax.set_title(f"{s}: cosine {report[s]['cosine']:.12f}", fontsize=8)
fig.tight_layout()
log.figure(fig, "equivalence_scatter.png")
plt.show()

# %% [markdown]
# ## In bfloat16: every schedule against the float64 on-policy gradient
# Rounding makes the baseline's recomputed forward differ from the rollout's, so its ratio leaves the clip range
# `[1 - c, 1 + c]` (c = 1e-4 in FlowGRPO and DanceGRPO) by rounding alone and the clipped surrogate drops those terms'
# gradient. Retain and Reweight reuse the rollout's own forward: ratio 1, the on-policy gradient. The yardstick is the
# float64 gradient of each schedule's own trajectories (same x_j, x_{j+1}, advantages); the dashed line is the
# tolerance, 10 x the relative error bfloat16 puts on the model's own velocity
# (`lean.tools.equivalence.half_tolerance`).

# %%
bf16 = json.loads((Path(outputs) / "equivalence_bf16" / "equivalence.json").read_text())
rounding, tolerance_bf16 = bf16["rounding"], half_tolerance(bf16["rounding"]["forward_error"])[0]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
names_bf16 = list(bf16["reference"])
ax1.bar(names_bf16, [bf16["reference"][s]["rel_norm_diff"] for s in names_bf16], color=["C3", "C0", "C1"])
ax1.axhline(tolerance_bf16, color="k", ls="--", label=f"tolerance ({tolerance_bf16:.3g})")
ax1.set_ylabel("||g - g_float64|| / ||g_float64||")
ax1.set_title(f"bfloat16 ({bf16['family']}): {'PASS' if bf16['passes'] else 'FAIL'}", fontsize=9)
ax1.legend(fontsize=7)
by_step = rounding["rounding_clipped_fraction_by_step"]
ax2.bar(range(len(by_step)), [100 * f for f in by_step], color="C3")
ax2.set_xlabel("sampling step")
ax2.set_ylabel(f"% of {BASELINE}'s terms clipped by rounding")
ax2.set_title(f"{rounding['clipped_gradient_norm_fraction']:.0%} of the reference gradient's norm dropped", fontsize=9)
fig.tight_layout()
log.figure(fig, "equivalence_bfloat16.png")
plt.show()

# %%
metrics = {
    "equivalence_passes": float(report["passes"]),
    "bf16_passes": float(bf16["passes"]),
    "bf16_clipped_fraction": rounding["rounding_clipped_fraction"],
    "bf16_clipped_gradient_norm_fraction": rounding["clipped_gradient_norm_fraction"],
}
metrics.update({f"bf16_rel_l2_{s}": r["rel_norm_diff"] for s, r in bf16["reference"].items()})
for s in LEAN_SCHEDULES:
    metrics.update(
        {
            f"max_rel_grad_diff_{s}": report[s]["max_rel_grad_diff"],
            f"max_abs_grad_diff_{s}": report[s]["max_abs_grad_diff"],
            f"one_minus_cosine_{s}": 1 - report[s]["cosine"],
        }
    )
log.log(metrics)
log.close(summary_path)
