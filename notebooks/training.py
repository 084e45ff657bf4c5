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
# # Training: the reward curves of the three schedules, and what the model learned
#
# The `train` stage ran GRPO, one run per schedule side by side, from the pretrained base with the `rl` settings of
# `params.yaml`. Same seed, same trajectories, and the same update (see the equivalence notebook): the three curves
# must coincide, up to the floating-point rounding that separates their gradients (it grows slowly over iterations in
# float32; run `dvc exp run -S 'rl.run.model.dtype=float64'` to see it vanish). The reward is measured on the images
# each iteration generates (prompt alignment: `lean.rewards`).
#
# The training reward is that of the exploring (SDE) samples. Whether the model itself got better is the evaluation's
# question (`rl.run.eval`, `lean/evaluation.py`): deterministic (ODE) samples of the prompts from the same noise at
# every evaluation, scored with the same reward. The run *visibly learns* when its eval reward rises by at least
# 0.15 and by more than 5 times `eval_reward_noise_std`, the std of the base model's mean eval reward over eval
# seeds (`eval.noise_seeds`): a gain the choice of noise alone could not make.

# %% tags=["parameters"]
outputs = "../outputs"  # the DVC pipeline's outputs folder
track = True  # log figures and metrics to MLflow (experiment lean-workbench)
parent_run_id = None  # set by the report stage: this notebook's run is nested under it
summary_path = None  # set by the report stage: where this notebook's metrics go (JSON)
time_to_reward_gain = 0.08  # set by the report stage (params rl.time_to_reward_gain): the time-to-reward target

# %%
import csv
import itertools
import json
import math
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
from PIL import Image

from lean.algorithms import ALGORITHMS
from lean.schedules import BASELINE, SCHEDULES
from lean.workbench.notebook import NotebookLog
from lean.workbench.reproduction import GRPO_RUN
from lean.workbench.time_to_reward import eval_curve, read_numbers, time_to_reward

schedules = list(SCHEDULES)
MIN_GAIN, NOISE_MULTIPLE = 0.15, 5  # the eval reward must rise by >= MIN_GAIN and > NOISE_MULTIPLE x its noise std


def read_rows(schedule: str, name: str, stage: str = "train") -> list[dict]:
    """A run's CSV (metrics.csv, eval.csv) as numbers; no rows when the file is missing (a run without evaluation).
    ``stage``: the folder under outputs: ``train`` (the schedules' runs), ``algorithms`` (the algorithms')."""
    return read_numbers(Path(outputs) / stage / schedule / name)


def show_eval_figure(fig, ax, xlabel: str, title: str, name: str) -> None:
    """Label an eval-reward plot, log it to MLflow as ``name`` and show it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean eval reward")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    log.figure(fig, name)
    plt.show()


curves = {s: read_rows(s, "metrics.csv") for s in schedules}
evals = {s: read_rows(s, "eval.csv") for s in schedules}
summaries = {s: json.loads((Path(outputs) / "train" / s / "metrics.json").read_text()) for s in schedules}
evaluated = all(evals.values()) and all("eval_reward_gain" in summaries[s] for s in schedules)
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
ax.set_title("time per iteration (the runs shared the cores: speed is the bench's)")
ax.legend()
log.figure(fig, "training_time.png")
plt.show()

# %% [markdown]
# ## The base model beside the trained one
#
# Per prompt, the eval samples of the base model (iteration 0) and of the trained model (the last evaluation) of the
# baseline schedule, from the same noise: what changed is what training changed. Each title is the sample's reward.

# %%
if not evaluated:
    print("no evaluations in these runs (rl.run.eval.every: 0): nothing to show")
else:
    folder = Path(outputs) / "train" / BASELINE / "eval"
    last = int(evals[BASELINE][-1]["iteration"])

    def samples(iteration: int) -> list[dict]:
        with open(folder / str(iteration) / "samples.csv") as f:
            return list(csv.DictReader(f))

    shown = [("base", 0, samples(0)), (f"iteration {last}", last, samples(last))]
    prompts = {int(r["prompt_index"]): r["prompt"] for r in shown[0][2]}
    per_prompt = 1 + max(int(r["sample_index"]) for r in shown[0][2])
    fig, axes = plt.subplots(
        len(prompts), 2 * per_prompt, figsize=(1.5 * 2 * per_prompt + 1.5, 1.7 * len(prompts)), squeeze=False
    )
    for half, (label, iteration, rows) in enumerate(shown):
        for r in rows:
            p, k = int(r["prompt_index"]), int(r["sample_index"])
            ax = axes[p, half * per_prompt + k]
            with Image.open(folder / str(iteration) / r["file"]) as image:  # a video's GIF opens at its first frame
                ax.imshow(image.convert("RGB"), interpolation="nearest")
            ax.set_title(f"{label}: {float(r['reward']):.3f}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    for p, prompt in prompts.items():
        axes[p, 0].set_ylabel("\n".join(textwrap.wrap(prompt, 18)), fontsize=8)
    fig.suptitle(f"{BASELINE}: base model (left) | after {last} iterations (right), the same eval noise", fontsize=10)
    fig.tight_layout()
    log.figure(fig, "training_eval_base_vs_trained.png")
    plt.show()

# %% [markdown]
# ## The eval-reward curves
#
# The mean eval reward of each evaluation, per schedule (the curves coincide as the training ones do), with the band
# of ± the noise std around the base model's and the line the trained model must reach.

# %%
if evaluated:
    gain = min(summaries[s]["eval_reward_gain"] for s in schedules)
    noises = [summaries[s]["eval_reward_noise_std"] for s in schedules if "eval_reward_noise_std" in summaries[s]]
    noise = max(noises) if noises else math.nan  # the base model's: the same in every run
    needed = max(MIN_GAIN, NOISE_MULTIPLE * noise) if noises else MIN_GAIN
    learns = gain >= MIN_GAIN and gain > NOISE_MULTIPLE * noise  # False without a noise figure
    base = evals[BASELINE][0]["eval_reward_mean"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for s, style in zip(schedules, ("-o", "--s", ":^")):
        ax.plot([r["iteration"] for r in evals[s]], [r["eval_reward_mean"] for r in evals[s]], style, ms=4, label=s)
    if noises:
        ax.axhspan(base - noise, base + noise, color="grey", alpha=0.25, label="base ± noise std")
    ax.axhline(base + needed, color="green", ls="--", lw=1, label=f"base + {needed:.3f} (criterion)")
    show_eval_figure(
        fig, ax, "iteration", "eval (ODE, fixed noise) reward per evaluation", "training_eval_reward_curves.png"
    )
    print(
        f"eval reward gain {gain:.4f} (the smallest of the three) against >= {MIN_GAIN} and > {NOISE_MULTIPLE} x "
        f"noise std {noise:.4f} = {NOISE_MULTIPLE * noise:.4f}: " + ("learns" if learns else "does NOT visibly learn")
    )

# %% [markdown]
# ## Time to reward: the recipe, its exact hybrid and its on-policy form
#
# What a user buys is eval reward per hour. The runs above are the on-policy form (one optimizer step per rollout) of
# the recipe `rl.recipe` runs as FlowGRPO does: two optimizer steps per rollout of twice the samples, the second
# under weights the first has moved (`recipe-recompute`), and its exact hybrid (`recipe-retain`: the first update from
# the rollout's graphs). Every run takes the same optimizer steps of the same number of samples from the same base.
# The x axis is each run's own CPU seconds of training (the runs shared the cores: CPU time is each one's work, not
# its wait); the time to reward is when the eval curve first reaches the base's eval reward + `time_to_reward_gain`.

# %%
recipe_runs = [r for r in ("recipe-recompute", "recipe-retain") if (Path(outputs) / "train" / r / "eval.csv").exists()]
forms = {**{s: s for s in schedules}, **{r: r for r in recipe_runs}}
reached = {}
if evaluated and recipe_runs:
    target = evals[BASELINE][0]["eval_reward_mean"] + time_to_reward_gain
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for name, style in zip(forms, ("-o", "--s", ":^", "-D", "--v")):
        rows, steps = read_rows(name, "eval.csv"), read_rows(name, "metrics.csv")
        curve = eval_curve(rows, steps, "cpu_iteration_s" if "cpu_iteration_s" in steps[0] else "time_iteration_s")
        reached[name] = time_to_reward(curve, target)
        ax.plot([t for t, _ in curve], [r for _, r in curve], style, ms=4, label=name)
    ax.axhline(target, color="green", ls="--", lw=1, label=f"target: base + {time_to_reward_gain}")
    show_eval_figure(
        fig,
        ax,
        "training CPU seconds (each run's own)",
        "eval reward against compute: recipe (2 steps per rollout) vs on-policy form",
        "training_time_to_reward.png",
    )
    for name, seconds in reached.items():
        print(f"{name:18s} " + (f"reaches {target:.4f} after {seconds:7.1f} CPU s" if seconds else "never reaches it"))

# %% [markdown]
# ## The algorithms side by side
#
# The `train` stage also ran each algorithm of `lean/algorithms/` on the same task, from the same base, with the
# same prompts and evaluation (`rl.run`, with each algorithm's own keys from `rl.<algorithm>.run`): GRPO-Guard,
# MixGRPO and Flash-GRPO (one SDE step per trajectory) with Retain (exact for them); BranchGRPO with Retain on a tree
# rollout (16 leaves per prompt, its fused depth-wise advantages); Flow-DPPO in the recipe's shape (two optimizer
# steps per rollout, where its trust-region mask differs from GRPO's clip; on-policy it is GRPO to the bit), with
# Retain's exact hybrid; DiffusionNFT, online DPO and AWM with their own update on re-noised clean samples. GRPO is the
# `train` stage's Retain run. The x axis is each run's own training CPU seconds; the criterion is the one above (gain
# >= 0.15 and > 5 x the base's eval-noise std).

# %%
algorithm_runs = {ALGORITHMS.default: (GRPO_RUN, "train")}  # GRPO's run: the train stage's Retain
for name in ALGORITHMS:
    if (Path(outputs) / "algorithms" / name / "eval.csv").exists():
        algorithm_runs[name] = (name, "algorithms")
algorithm_summaries = {
    name: json.loads((Path(outputs) / stage / run / "metrics.json").read_text())
    for name, (run, stage) in algorithm_runs.items()
}
algorithm_reached = {}
if evaluated and len(algorithm_runs) > 1:
    target = evals[BASELINE][0]["eval_reward_mean"] + time_to_reward_gain
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, (run, stage)), style in zip(algorithm_runs.items(), itertools.cycle(("-o", "--s", ":^", "-D", "--v"))):
        rows, steps = read_rows(run, "eval.csv", stage), read_rows(run, "metrics.csv", stage)
        curve = eval_curve(rows, steps, "cpu_iteration_s")
        algorithm_reached[name] = time_to_reward(curve, target)
        ax1.plot([r["iteration"] for r in rows], [r["eval_reward_mean"] for r in rows], style, ms=4, label=name)
        ax2.plot([t for t, _ in curve], [r for _, r in curve], style, ms=4, label=name)
    for ax in (ax1, ax2):
        ax.axhline(target, color="green", ls="--", lw=1, label=f"base + {time_to_reward_gain}")
        ax.set_ylabel("mean eval reward")
        ax.legend(fontsize=8)
    ax1.set_xlabel("iteration")
    ax1.set_title("eval reward per iteration")
    ax2.set_xlabel("training CPU seconds (each run's own)")
    ax2.set_title("eval reward against compute")
    fig.tight_layout()
    log.figure(fig, "training_algorithms.png")
    plt.show()
    for name, summary in algorithm_summaries.items():
        gain, noise_std = summary["eval_reward_gain"], summary.get("eval_reward_noise_std", math.nan)
        ok = gain >= MIN_GAIN and gain > NOISE_MULTIPLE * noise_std
        seconds = algorithm_reached[name]
        print(
            f"{name:11s} eval gain {gain:.4f} ({gain / noise_std:5.1f} x noise): "
            + ("learns" if ok else "does NOT visibly learn")
            + (f"; base + {time_to_reward_gain} after {seconds:6.1f} CPU s" if seconds else "")
        )

# %% [markdown]
# What each algorithm's model draws at its last evaluation, from the same eval noise (each title: the reward).

# %%
if evaluated and len(algorithm_runs) > 1:
    fig, axes = plt.subplots(len(algorithm_runs), 4, figsize=(6.5, 1.7 * len(algorithm_runs)), squeeze=False)
    for row, (name, (run, stage)) in enumerate(algorithm_runs.items()):
        folder = Path(outputs) / stage / run / "eval"
        last = max(int(p.name) for p in folder.iterdir() if p.name.isdigit())
        with open(folder / str(last) / "samples.csv") as f:
            shown = [r for r in csv.DictReader(f)][:4]
        for col, r in enumerate(shown):
            ax = axes[row, col]
            with Image.open(folder / str(last) / r["file"]) as image:
                ax.imshow(image.convert("RGB"), interpolation="nearest")
            ax.set_title(f"{float(r['reward']):.3f}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[row, 0].set_ylabel(name, fontsize=9)
    fig.suptitle("each algorithm's model after its run, the same eval noise", fontsize=10)
    fig.tight_layout()
    log.figure(fig, "training_algorithms_samples.png")
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
if evaluated:
    for s in schedules:
        metrics.update({f"eval_reward_{k}_{s}": summaries[s][f"eval_reward_{k}"] for k in ("first", "last", "gain")})
    if noises:
        metrics["eval_reward_noise_std"] = noise
    metrics["eval_learning_passes"] = float(learns)
for name, seconds in reached.items():  # a run that never reaches the target has no time, and says so
    key = name.replace("-", "_")
    metrics[f"reached_reward_target_{key}"] = float(seconds is not None)
    if seconds is not None:
        metrics[f"time_to_reward_{key}"] = seconds
for name, summary in algorithm_summaries.items():
    if "eval_reward_gain" in summary:
        metrics[f"eval_reward_gain_{name}"] = summary["eval_reward_gain"]
        if summary.get("eval_reward_noise_std"):
            metrics[f"eval_gain_over_noise_{name}"] = summary["eval_reward_gain"] / summary["eval_reward_noise_std"]
    if algorithm_reached.get(name) is not None:
        metrics[f"time_to_reward_{name}"] = algorithm_reached[name]
for name in recipe_runs:
    rows = read_rows(name, "eval.csv")
    metrics[f"eval_reward_gain_{name.replace('-', '_')}"] = rows[-1]["eval_reward_mean"] - rows[0]["eval_reward_mean"]
log.log(metrics)
for k, v in metrics.items():
    print(f"{k:28s} {v:.6f}")
log.close(summary_path)
