"""One GRPO iteration taken apart into DVC stages: rollout -> advantage -> update (one per schedule) -> equivalence.

A computation graph cannot cross a process boundary, so the stages are honest about what each one consumes:

* ``rollout`` samples the iteration's trajectories with gradients on the trained steps (as Retain does, so that the
  per-step activation probe measures what Retain keeps alive), drops every graph at once, and persists what the
  Recompute baseline needs: x_i, x_{i+1} and log p_old(x_{i+1} | x_i) of every trained step, the step selection, the
  final latents and the rewards.
* ``advantage`` turns the persisted rewards into group advantages A_n = (r_n - mean_g) / (std_g + eps).
* ``update`` of a schedule that needs no rollout graphs (Recompute) replays the persisted steps into it and runs its
  update: the second forward pass over stored states that Retain and Reweight remove. ``update`` of Retain or
  Reweight must own the graphs it backpropagates, so it re-runs the rollout in its own process; it first verifies that
  this reproduces the persisted trajectory (x_T, every log-prob, the rewards and advantages) and reports the largest
  differences.
* ``equivalence`` compares the gradients the updates produced, tensor by tensor (``lean.tools.equivalence.compare``).

Every phase is the iteration pipeline's own (``lean.run.iteration``). Every update starts from the same weights: the
pretrained base with its LoRA adapter perturbed by ``perturb_std * N(0, I)`` from the run's seed (peft starts B at
zero, which would make the adapter's A gradients vanish and the check weaker than it looks), as
``lean.tools.equivalence`` does. The stages run in one process (world 1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lean.algorithms import build_algorithm
from lean.algorithms.groups import group_stats
from lean.config import RunConfig
from lean.config.dtypes import dtype_name
from lean.observe.metrics import PeakMemory, SavedBytes
from lean.run.iteration import IterationPipeline, LocalBatch, Rollout
from lean.run.optimizer import capture_synced_grads
from lean.sampling.sde import StepSelection
from lean.sampling.transition import Transition
from lean.schedules import BASELINE, LEAN_SCHEDULES, SCHEDULES, IterationContext, Schedule
from lean.tools.equivalence import compare, passes, tolerance
from lean.train import Trainer


def make_trainer(cfg: RunConfig, perturb_std: float) -> Trainer:
    """A single-process trainer whose adapter starts perturbed (the same start in every method stage)."""
    trainer = Trainer(cfg)
    if trainer.world.size != 1:
        raise ValueError("the workbench's method stages run in one process")
    if perturb_std > 0:
        trainer.policy.perturb_lora_(perturb_std, torch.Generator().manual_seed(cfg.train.seed))
    return trainer


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ---------------------------------------------------------------- rollout stage


class TrajectoryRecorder(Schedule):
    """The rollout stage's schedule: gradients on the trained steps like Retain, but each step's graph is dropped at
    once; it stores what the baseline consumes and the activation bytes ``saved`` saw each step save."""

    def __init__(self, ctx: IterationContext, saved: SavedBytes):
        super().__init__(ctx)
        self.saved = saved
        self.steps: dict[int, dict[str, Tensor]] = {}
        self.saved_bytes: dict[int, int] = defaultdict(int)

    def on_step(self, step: Transition) -> None:
        self.saved_bytes[step.index] += self.saved.take()
        if not self.any_trained[step.index]:
            return
        shape = (self.ctx.batch, *step.sample.shape[1:])
        store = self.steps.setdefault(
            step.index,
            {
                "x": step.sample.new_empty(shape),
                "x_next": step.sample.new_empty(shape),
                "log_prob": step.log_prob.new_empty(self.ctx.batch),
            },
        )
        store["x"][step.rows] = step.sample
        store["x_next"][step.rows] = step.next_sample
        store["log_prob"][step.rows] = step.log_prob.detach()

    def finish(self, advantages, optimizer_step) -> dict:
        raise RuntimeError("the rollout stage records; the update stages update")


def run_rollout(cfg: RunConfig, perturb_std: float) -> tuple[dict[str, Tensor], dict, list[dict]]:
    """The rollout stage: (tensors to persist, summary, one row per sampling step)."""
    trainer = make_trainer(cfg, perturb_std)
    saved = SavedBytes()
    with PeakMemory(trainer.world.device) as memory, saved.watching():
        rolled = trainer.pipeline.roll_out(0, lambda ctx: TrajectoryRecorder(ctx, saved))
    recorder, batch = rolled.schedule, rolled.batch
    tensors = {
        "final": rolled.final,
        "rewards": rolled.rewards,
        "groups": batch.group_ids(),
        "prompt_index": torch.tensor([p for _, p, _ in batch.samples]),
        "sample_index": torch.tensor([k for _, _, k in batch.samples]),
        "trained": batch.steps.trained,
        "stochastic": batch.steps.stochastic,
        **{f"reward_{k}": v.to(torch.float64) for k, v in rolled.parts.items()},
    }
    for i, store in recorder.steps.items():
        tensors.update({f"{name}.{i}": value for name, value in store.items()})
    sigmas = trainer.pipeline.sigmas.cpu()
    per_step = [
        {
            "step": i,
            "sigma": float(sigmas[i]),
            "trained": int(recorder.any_trained[i]),
            "activation_mb": recorder.saved_bytes.get(i, 0) / 2**20,
            "log_prob_mean": float(recorder.steps[i]["log_prob"].mean()) if i in recorder.steps else None,
        }
        for i in range(cfg.sample.num_steps)
    ]
    trained_mb = [row["activation_mb"] for row in per_step if row["trained"]]
    summary = {
        "samples": len(batch.samples),
        "prompts": batch.prompts,
        "reward_mean": rolled.rewards.mean().item(),
        "reward_std": rolled.rewards.std(unbiased=False).item(),
        "steps_trained": len(trained_mb),
        "activation_mb_per_trained_step": max(trained_mb, default=0.0),
        "activation_mb_retained": sum(trained_mb),
        "time_rollout_s": rolled.ctx.timer.seconds["rollout"],
        "peak_memory_mb": memory.peak_mb,
    }
    return tensors, summary, per_step


# ---------------------------------------------------------------- advantage stage


def run_advantage(cfg: RunConfig, trajectory: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict, list[dict]]:
    """The advantage stage: (tensors to persist, summary, one row per sample)."""
    rewards, groups = trajectory["rewards"], trajectory["groups"]
    advantages = build_algorithm(cfg, sigmas=None).targets(rewards, groups)
    stats = group_stats(rewards, groups)
    summary = {
        "advantage_mean": advantages.mean().item(),
        "advantage_std": advantages.std(unbiased=False).item(),
        "advantage_abs_max": advantages.abs().max().item(),
        "zero_std_fraction": stats["zero_std_fraction"],
        "group_reward_mean": stats["mean"].tolist(),
        "group_reward_std": stats["std"].tolist(),
    }
    rows = [
        {"sample": n, "group": int(g), "reward": float(r), "advantage": float(a)}
        for n, (g, r, a) in enumerate(zip(groups, rewards, advantages))
    ]
    return {"advantages": advantages}, summary, rows


# ---------------------------------------------------------------- update stages


def replay_rollout(pipeline: IterationPipeline, schedule: str, trajectory: Mapping[str, Tensor]) -> Rollout:
    """The persisted rollout, fed step by step into a schedule that needs no rollout graphs (the baseline)."""
    samples = [
        (int(g), int(p), int(k))
        for g, p, k in zip(trajectory["groups"], trajectory["prompt_index"], trajectory["sample_index"])
    ]
    batch = LocalBatch(
        0,
        samples,
        slice(0, len(samples)),
        [pipeline.cfg.train.prompts[p] for _, p, _ in samples],
        [],
        None,
        StepSelection(stochastic=trajectory["stochastic"], trained=trajectory["trained"]),
    )
    ctx = pipeline.context(batch, pipeline.embed(batch))
    sched = SCHEDULES[schedule](ctx)
    rows = torch.arange(len(samples))
    for i in sorted(int(k.split(".")[1]) for k in trajectory if k.startswith("x.")):
        sched.on_step(
            Transition(
                index=i,
                rows=rows,
                sample=trajectory[f"x.{i}"],
                next_sample=trajectory[f"x_next.{i}"],
                log_prob=trajectory[f"log_prob.{i}"],
                old_log_prob=trajectory[f"log_prob.{i}"],
            )
        )
    return Rollout(batch, ctx, sched, trajectory["final"], trajectory["rewards"])


def rerun_rollout(
    pipeline: IterationPipeline, schedule: str, trajectory: Mapping[str, Tensor], advantages: Tensor
) -> tuple[Rollout, dict]:
    """The rollout again, in this process, with the schedule's hooks; and how far it is from the persisted one."""
    log_probs: dict[int, Tensor] = {}

    def record(step: Transition) -> None:
        if f"log_prob.{step.index}" in trajectory:
            log_probs.setdefault(step.index, torch.empty_like(trajectory[f"log_prob.{step.index}"]))
            log_probs[step.index][step.rows] = step.log_prob.detach().to(log_probs[step.index].dtype)

    rolled = pipeline.roll_out(0, SCHEDULES[schedule], on_step=record)
    diffs = {
        "final_latents_max_abs_diff": _max_abs(rolled.final, trajectory["final"]),
        "log_prob_max_abs_diff": max(_max_abs(v, trajectory[f"log_prob.{i}"]) for i, v in log_probs.items()),
        "reward_max_abs_diff": _max_abs(rolled.rewards, trajectory["rewards"]),
        "advantage_max_abs_diff": _max_abs(pipeline.advantages(rolled)[1], advantages),
    }
    scale = max(trajectory["final"].abs().max().item(), 1.0)
    reproduces = diffs["final_latents_max_abs_diff"] <= 1e-5 * scale and diffs["reward_max_abs_diff"] <= 1e-6
    return rolled, {
        **diffs,
        "reproduces_trajectory": bool(reproduces),
        "time_rollout_s": rolled.ctx.timer.seconds["rollout"],
    }


def run_update(
    cfg: RunConfig, schedule: str, trajectory: Mapping[str, Tensor], advantages: Tensor, perturb_std: float
) -> tuple[dict[str, Tensor], dict]:
    """One update with ``schedule`` from the persisted iteration: (grads/params to persist, summary).

    Persisted: ``grad.<name>`` (the synchronised gradient just before the optimizer step), ``param.<name>`` (after
    it) and ``start.<name>`` (before), for every trainable tensor."""
    trainer = make_trainer(cfg, perturb_std)
    start = [p.detach().clone() for p in trainer.params]
    summary: dict[str, Any] = {"schedule": schedule}
    with PeakMemory(trainer.world.device) as memory, capture_synced_grads(trainer.state) as grads:
        if SCHEDULES[schedule].tracks_rollout_graphs:
            rolled, reproduced = rerun_rollout(trainer.pipeline, schedule, trajectory, advantages)
            summary.update(reproduced)
        else:  # the baseline consumes the persisted steps: no rollout here
            rolled = replay_rollout(trainer.pipeline, schedule, trajectory)
        stats = trainer.pipeline.finish(rolled, advantages, trainer.state.step)
    summary.update(
        {
            "time_update_s": rolled.ctx.timer.seconds["update"],
            "peak_memory_mb": memory.peak_mb,
            **{k: v for k, v in stats.items() if isinstance(v, (int, float))},
        }
    )
    tensors = {}
    for name, g, p, s in zip(trainer.state.names, grads, trainer.params, start):
        tensors.update({f"grad.{name}": g, f"param.{name}": p.detach().clone(), f"start.{name}": s})
    return tensors, summary


# ---------------------------------------------------------------- equivalence stage


def split_update(tensors: Mapping[str, Tensor]) -> tuple[list[str], list[Tensor], list[Tensor], list[Tensor]]:
    """(names, grads, params after the step, params before) from an update stage's file, in a fixed order."""
    names = sorted(k.removeprefix("grad.") for k in tensors if k.startswith("grad."))
    return (
        names,
        [tensors[f"grad.{n}"] for n in names],
        [tensors[f"param.{n}"] for n in names],
        [tensors[f"start.{n}"] for n in names],
    )


def compare_updates(updates: Mapping[str, Mapping[str, Tensor]], dtype: torch.dtype) -> dict:
    """The certificate: each Lean schedule's gradient and step against the baseline's
    (``lean.tools.equivalence.compare``), plus flat metrics ``max_rel_grad_diff_<schedule>`` / ``cosine_<schedule>``
    and ``passes``."""
    names, ref_grads, ref_params, start = split_update(updates[BASELINE])
    report: dict[str, Any] = {"dtype": dtype_name(dtype)}
    for schedule in LEAN_SCHEDULES:
        other_names, grads, params, other_start = split_update(updates[schedule])
        if other_names != names or any(not torch.equal(a, b) for a, b in zip(start, other_start)):
            raise ValueError(f"{schedule}: the update did not start from {BASELINE}'s weights")
        report[schedule] = compare(grads, ref_grads, params, ref_params, start, names)
    report["passes"] = passes(report, dtype)
    report["tolerance"] = dict(zip(("max_rel_grad_diff", "one_minus_cosine"), tolerance(dtype)))
    for schedule in LEAN_SCHEDULES:
        report[f"max_rel_grad_diff_{schedule}"] = report[schedule]["max_rel_grad_diff"]
        report[f"cosine_{schedule}"] = report[schedule]["cosine"]
    return report
