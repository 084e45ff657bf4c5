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
# # Training: the reward curves of the three schedules
#
# The `train@<schedule>` stages ran GRPO from the pretrained base with the `rl` settings of `params.yaml`. Same seed,
# same trajectories, and the same update (see the equivalence notebook): the three curves must coincide, up to the
# floating-point rounding that separates their gradients (it grows slowly over iterations in float32; run
# `dvc exp run -S 'rl.run.model.dtype=float64'` to see it vanish). The reward is measured on the images each
# iteration generates (prompt alignment: `lean.rewards`).

# %% tags=["parameters"]
outputs = "../outputs"  # the DVC pipeline's outputs folder
track = True  # log figures and metrics to MLflow (experiment lean-workbench)
parent_run_id = None  # set by the report stage: this notebook's run is nested under it
summary_path = None  # set by the report stage: where this notebook's metrics go (JSON)

# %%
import csv
import json
from pathlib import Path

import matplotlib.pyplot as plt

from lean.schedules import BASELINE, SCHEDULES
from lean.workbench.notebook import NotebookLog

schedules = list(SCHEDULES)


def read_curve(schedule: str) -> list[dict]:
    with open(Path(outputs) / "train" / schedule / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


curves = {s: read_curve(s) for s in schedules}
config = json.loads((Path(outputs) / "train" / BASELINE / "config.json").read_text())
log = NotebookLog("training", track=track, parent_run_id=parent_run_id)
print(
    f"{config['model']['family']}/{config['model']['size']} {config['model']['dtype']}, "
    f"{config['train']['iterations']} iterations x {config['train']['prompts_per_iteration']} prompts x "
    f"{config['train']['group_size']} samples, reward {config['reward']['weights']}"
)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
for s, style in zip(schedules, ("-o", "--s", ":^")):
    it = [row["iteration"] for row in curves[s]]
    ax1.plot(it, [row["reward_mean"] for row in curves[s]], style, ms=4, label=s)
ax1.set_xlabel("iteration")
ax1.set_ylabel("mean reward")
ax1.set_title("reward per iteration")
ax1.legend()
for s in schedules[1:]:
    diff = [max(abs(a["reward_mean"] - b["reward_mean"]), 1e-17) for a, b in zip(curves[s], curves[BASELINE])]
    ax2.semilogy([row["iteration"] for row in curves[s]], diff, "-o", ms=3, label=f"|{s} - {BASELINE}|")
ax2.set_xlabel("iteration")
ax2.set_title("distance between the curves")
ax2.legend()
fig.tight_layout()
log.figure(fig, "training_reward_curves.png")
plt.show()

# %%
fig, ax = plt.subplots(figsize=(6, 3))
for s in schedules:
    ax.plot(
        [row["iteration"] for row in curves[s]], [row["time_iteration_s"] for row in curves[s]], "-o", ms=3, label=s
    )
ax.set_xlabel("iteration")
ax.set_ylabel("seconds")
ax.set_title("time per iteration")
ax.legend()
log.figure(fig, "training_time.png")
plt.show()

# %%
metrics = {
    "max_reward_curve_diff": max(
        abs(a["reward_mean"] - b["reward_mean"]) for s in schedules[1:] for a, b in zip(curves[s], curves[BASELINE])
    )
}
for s in schedules:
    r = [row["reward_mean"] for row in curves[s]]
    metrics.update({f"reward_first_{s}": r[0], f"reward_final_{s}": r[-1], f"reward_gain_{s}": r[-1] - r[0]})
log.log(metrics)
for k, v in metrics.items():
    print(f"{k:24s} {v:.6f}")
log.close(summary_path)
