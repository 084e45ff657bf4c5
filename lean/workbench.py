"""Stage logic of the DVC workbench that the library does not already have: one GRPO iteration taken apart into
rollout -> advantage -> update stages, and the check that the three updates agree.

A computation graph cannot cross a process boundary, so the stages are honest about what each one consumes:

* ``rollout`` samples the iteration's trajectories with gradients on the trained steps (as Retain does, so that the
  per-step activation probe measures what Retain keeps alive), drops every graph at once, and persists what the
  Recompute baseline needs: x_i, x_{i+1} and log p_old(x_{i+1} | x_i) of every trained step, the step plan, the final
  latents and the rewards.
* ``advantage`` turns the persisted rewards into group advantages A_n = (r_n - mean_g) / (std_g + eps).
* ``update`` (recompute) replays the persisted steps into the Recompute schedule and runs its update: the second
  forward pass over stored states that Retain and Reweight remove. ``update`` (retain / reweight) must own the graphs
  it backpropagates, so it re-runs the rollout in its own process; it first verifies that this reproduces the
  persisted trajectory (x_T, every log-prob, the rewards and advantages) and reports the largest differences.
* ``equivalence`` compares the gradients the three updates produced, tensor by tensor (``lean.equivalence.compare``).

Every update starts from the same weights: the pretrained base with its LoRA adapter perturbed by
``perturb_std * N(0, I)`` from the run's seed (peft starts B at zero, which would make the adapter's A gradients
vanish and the check weaker than it looks), as ``lean.equivalence`` does. The stages run in one process (world 1).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

from lean.advantage import group_advantages, group_stats
from lean.config import RunConfig, load_config, load_tree
from lean.metrics import PeakMemory, PhaseTimer
from lean.rewards import compute_rewards
from lean.rollout import StepOutput, rollout
from lean.schedules import SCHEDULES, IterationContext
from lean.schedules.base import Schedule
from lean.sde import StepPlan

RUN_SECTIONS = ("model", "sample", "reward", "train")


# ---------------------------------------------------------------- configuration of a stage


def read_params(path: str | Path = "params.yaml") -> dict:
    """The whole params file: the run sections and the stages' own sections."""
    return yaml.safe_load(Path(path).read_text()) or {}


def stage_overrides(run: Mapping[str, Any] | None) -> list[str]:
    """A stage's ``run:`` mapping (shaped like the run sections) as ``section.key=value`` overrides: each listed key
    replaces the run section's value (a mapping value such as ``reward.weights`` replaces it whole)."""
    out = []
    for section, keys in (run or {}).items():
        if section not in RUN_SECTIONS or not isinstance(keys, Mapping):
            raise ValueError(f"run overrides: {section!r} must be one of {', '.join(RUN_SECTIONS)}, holding keys")
        for key, value in keys.items():
            text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
            out.append(f"{section}.{key}={text.removesuffix('...').strip()}")
    return out


def stage_config(params: str | Path, section: str | None = None, *, pretrained: str | None = None,
                 schedule: str | None = None) -> RunConfig:
    """The run config of a stage: ``params``' run sections, then ``<section>.run`` on top, then the stage's
    command-line choices (the pretrained base the ``prepare`` stage made, the schedule of a matrix stage)."""
    stage = (read_params(params).get(section) or {}) if section else {}
    overrides = stage_overrides(stage.get("run"))
    if pretrained is not None:
        overrides.append(f"model.pretrained={pretrained}")
    if schedule is not None:
        overrides.append(f"train.schedule={schedule}")
    return load_config(tree=load_tree(params), overrides=overrides)


def begin_stage(params: str | Path) -> dict:
    """Process set-up of a stage from ``params``' ``workbench`` and ``tracking`` sections; returns the whole file.

    Torch threads: tiny models are bound by per-op overhead, and on a shared 2-core machine a second thread that waits
    for a busy core makes every op slower, not faster (``workbench.threads``, 0: torch's default). Tracking:
    ``tracking.enabled`` unless ``LEAN_TRACKING`` is set in the environment, which wins."""
    from lean import tracking

    tree = read_params(params)
    threads = int((tree.get("workbench") or {}).get("threads", 0))
    if threads > 0:
        torch.set_num_threads(threads)
    section = tree.get("tracking") or {}
    if "LEAN_TRACKING" not in os.environ:
        tracking.configure(enabled=bool(section.get("enabled", False)))
    tracking.configure(experiment=section.get("experiment"))
    return tree


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_csv(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def numbers(tree: Mapping[str, Any]) -> dict[str, float]:
    """The top-level numbers of a summary (what goes to MLflow as metrics)."""
    return {k: v for k, v in tree.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# ---------------------------------------------------------------- one iteration, up to the rewards


@dataclass
class RolloutPhase:
    """What the first half of a GRPO iteration leaves for the update (single process)."""

    ctx: IterationContext
    schedule: Schedule  # the schedule that saw every step
    samples: list[tuple[int, int, int]]  # (group, prompt index, sample index), in batch order
    prompts: list[str]
    final: Tensor  # x_T
    rewards: Tensor  # float64 [N]
    parts: dict[str, Tensor]


def rollout_phase(trainer, iteration: int, make_schedule: Callable[[IterationContext], Schedule],
                  on_step: Callable[[StepOutput], None] | None = None) -> RolloutPhase:
    """Rollout, decode and rewards of ``trainer``'s iteration ``iteration``, the same calls in the same order as
    ``Trainer.iteration``; the schedule sees every step, then ``on_step`` (a recorder) does."""
    if trainer.world != 1:
        raise ValueError("the workbench's method stages run in one process")
    cfg, t = trainer.cfg, trainer.cfg.train
    batch = trainer.local_batch(iteration)  # one process: the local slice is the whole iteration
    samples, prompts, generators, plan = batch.samples, batch.prompts, batch.generators, batch.plan
    emb = trainer.policy.encode_prompts(prompts)
    ctx = IterationContext(trainer.policy, cfg, trainer.sigmas, emb, plan, timer=PhaseTimer(trainer.device))
    schedule = make_schedule(ctx)

    def hook(step: StepOutput) -> None:
        schedule.on_step(step)
        if on_step is not None:
            on_step(step)

    with ctx.timer("rollout"):
        final = rollout(trainer.policy, emb, generators, plan, cfg.sample, trainer.sigmas, on_step=hook,
                        track_grad=schedule.track_grad, micro_batch=t.rollout_batch_size,
                        grad_micro_batch=schedule.grad_micro_batch)
    with ctx.timer("reward"):
        rewards, parts = compute_rewards(cfg.reward.weights, trainer.policy.decode(final), prompts)
    return RolloutPhase(ctx, schedule, samples, prompts, final, rewards.to(torch.float64), parts)


def group_ids(samples: list[tuple[int, int, int]]) -> Tensor:
    return torch.tensor([g for g, _, _ in samples])


def advantages_of(cfg: RunConfig, rewards: Tensor, groups: Tensor) -> Tensor:
    return group_advantages(rewards, groups, global_std=cfg.train.global_std, clip=cfg.train.adv_clip_max)


def make_trainer(cfg: RunConfig, perturb_std: float):
    """A single-process trainer whose adapter starts perturbed (the same start in every method stage)."""
    from lean.train import Trainer

    trainer = Trainer(cfg)
    if perturb_std > 0:
        trainer.policy.perturb_lora_(perturb_std, torch.Generator().manual_seed(cfg.train.seed))
    return trainer


# ---------------------------------------------------------------- rollout stage


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward, collected between two ``take()`` calls."""

    def __init__(self):
        self.pending: dict[int, int] = {}

    def pack(self, tensor):
        if isinstance(tensor, Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            self.pending[storage.data_ptr()] = storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def watching(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self

    def take(self) -> int:
        total = sum(self.pending.values())
        self.pending.clear()
        return total


class TrajectoryRecorder(Schedule):
    """The rollout stage's schedule: gradients on the trained steps like Retain, but each step's graph is dropped at
    once; it stores what Recompute consumes and the activation bytes ``probe`` saw each step save."""

    name = "record"

    def __init__(self, ctx: IterationContext, probe: SavedBytes):
        super().__init__(ctx)
        self.probe = probe
        self.steps: dict[int, dict[str, Tensor]] = {}
        self.saved_bytes: dict[int, int] = defaultdict(int)

    def on_step(self, step: StepOutput) -> None:
        self.saved_bytes[step.index] += self.probe.take()
        if not self.any_trained[step.index]:
            return
        shape = (self.ctx.batch, *step.sample.shape[1:])
        store = self.steps.setdefault(step.index, {"x": step.sample.new_empty(shape),
                                                   "x_next": step.sample.new_empty(shape),
                                                   "log_prob": step.log_prob.new_empty(self.ctx.batch)})
        store["x"][step.rows] = step.sample
        store["x_next"][step.rows] = step.next_sample
        store["log_prob"][step.rows] = step.log_prob.detach()

    def finish(self, advantages, optimizer_step) -> dict:
        raise RuntimeError("the rollout stage records; the update stages update")


def run_rollout(cfg: RunConfig, perturb_std: float) -> tuple[dict[str, Tensor], dict, list[dict]]:
    """The rollout stage: (tensors to persist, summary, one row per sampling step)."""
    trainer = make_trainer(cfg, perturb_std)
    probe = SavedBytes()
    with PeakMemory(trainer.device) as memory, probe.watching():
        phase = rollout_phase(trainer, 0, lambda ctx: TrajectoryRecorder(ctx, probe))
    recorder = phase.schedule
    tensors = {"final": phase.final, "rewards": phase.rewards, "groups": group_ids(phase.samples),
               "prompt_index": torch.tensor([p for _, p, _ in phase.samples]),
               "sample_index": torch.tensor([k for _, _, k in phase.samples]),
               "trained": phase.ctx.plan.trained, "stochastic": phase.ctx.plan.stochastic,
               **{f"reward_{k}": v.to(torch.float64) for k, v in phase.parts.items()}}
    for i, store in recorder.steps.items():
        tensors.update({f"{name}.{i}": value for name, value in store.items()})
    sigmas = trainer.sigmas.cpu()
    per_step = [{"step": i, "sigma": float(sigmas[i]), "trained": int(recorder.any_trained[i]),
                 "activation_mb": recorder.saved_bytes.get(i, 0) / 2**20,
                 "log_prob_mean": float(recorder.steps[i]["log_prob"].mean()) if i in recorder.steps else None}
                for i in range(cfg.sample.num_steps)]
    trained_mb = [row["activation_mb"] for row in per_step if row["trained"]]
    summary = {"samples": len(phase.samples), "prompts": phase.prompts,
               "reward_mean": phase.rewards.mean().item(), "reward_std": phase.rewards.std(unbiased=False).item(),
               "steps_trained": len(trained_mb), "activation_mb_per_trained_step": max(trained_mb, default=0.0),
               "activation_mb_retained": sum(trained_mb), "time_rollout_s": phase.ctx.timer.seconds["rollout"],
               "peak_memory_mb": memory.peak_mb}
    return tensors, summary, per_step


# ---------------------------------------------------------------- advantage stage


def run_advantage(cfg: RunConfig, trajectory: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict, list[dict]]:
    """The advantage stage: (tensors to persist, summary, one row per sample)."""
    rewards, groups = trajectory["rewards"], trajectory["groups"]
    advantages = advantages_of(cfg, rewards, groups)
    stats = group_stats(rewards, groups)
    summary = {"advantage_mean": advantages.mean().item(), "advantage_std": advantages.std(unbiased=False).item(),
               "advantage_abs_max": advantages.abs().max().item(), "zero_std_fraction": stats["zero_std_fraction"],
               "group_reward_mean": stats["mean"].tolist(), "group_reward_std": stats["std"].tolist()}
    rows = [{"sample": n, "group": int(g), "reward": float(r), "advantage": float(a)}
            for n, (g, r, a) in enumerate(zip(groups, rewards, advantages))]
    return {"advantages": advantages}, summary, rows


# ---------------------------------------------------------------- update stages


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_update(cfg: RunConfig, schedule: str, trajectory: Mapping[str, Tensor], advantages: Tensor,
               perturb_std: float) -> tuple[dict[str, Tensor], dict]:
    """One update with ``schedule`` from the persisted iteration: (grads/params to persist, summary).

    Persisted: ``grad.<name>`` (the synchronised gradient just before the optimizer step), ``param.<name>`` (after
    it) and ``start.<name>`` (before), for every trainable tensor."""
    trainer = make_trainer(cfg, perturb_std)
    names = [n for n, _ in trainer.policy.trainable_parameters()]
    start = [p.detach().clone() for p in trainer.params]
    captured: dict[str, list[Tensor]] = {}
    trainer.grad_probe = lambda params: captured.update(grads=[p.grad.detach().clone() for p in params])
    summary: dict[str, Any] = {"schedule": schedule}
    with PeakMemory(trainer.device) as memory:
        if schedule == "recompute":  # the baseline consumes the persisted steps: no rollout here
            prompts = [cfg.train.prompts[int(p)] for p in trajectory["prompt_index"]]
            plan = StepPlan(stochastic=trajectory["stochastic"], trained=trajectory["trained"])
            ctx = IterationContext(trainer.policy, cfg, trainer.sigmas, trainer.policy.encode_prompts(prompts), plan,
                                   timer=PhaseTimer(trainer.device))
            sched = SCHEDULES["recompute"](ctx, iteration=0)
            rows = torch.arange(len(prompts))
            for key in sorted((k for k in trajectory if k.startswith("x.")), key=lambda k: int(k.split(".")[1])):
                i = int(key.split(".")[1])
                sched.on_step(StepOutput(i, rows, trajectory[f"x.{i}"], trajectory[f"x_next.{i}"],
                                         trajectory[f"log_prob.{i}"], None, None))
        else:  # Retain / Reweight own their graphs: re-run the rollout, then check it is the persisted one
            log_probs: dict[int, Tensor] = {}

            def record(step: StepOutput) -> None:
                if f"log_prob.{step.index}" in trajectory:
                    log_probs.setdefault(step.index, torch.empty_like(trajectory[f"log_prob.{step.index}"]))
                    log_probs[step.index][step.rows] = step.log_prob.detach().to(log_probs[step.index].dtype)

            phase = rollout_phase(trainer, 0, lambda c: SCHEDULES[schedule](c, iteration=0), on_step=record)
            ctx, sched = phase.ctx, phase.schedule
            diffs = {"final_latents_max_abs_diff": _max_abs(phase.final, trajectory["final"]),
                     "log_prob_max_abs_diff": max(_max_abs(v, trajectory[f"log_prob.{i}"])
                                                  for i, v in log_probs.items()),
                     "reward_max_abs_diff": _max_abs(phase.rewards, trajectory["rewards"]),
                     "advantage_max_abs_diff": _max_abs(advantages_of(cfg, phase.rewards, trajectory["groups"]),
                                                        advantages)}
            scale = max(trajectory["final"].abs().max().item(), 1.0)
            summary.update(diffs, reproduces_trajectory=bool(diffs["final_latents_max_abs_diff"] <= 1e-5 * scale
                                                             and diffs["reward_max_abs_diff"] <= 1e-6))
            summary["time_rollout_s"] = ctx.timer.seconds["rollout"]
        with ctx.timer("update"):
            stats = sched.finish(advantages, trainer.optimizer_step)
    summary.update({"time_update_s": ctx.timer.seconds["update"], "peak_memory_mb": memory.peak_mb,
                    **{k: v for k, v in stats.items() if isinstance(v, (int, float))}})
    tensors = {}
    for name, g, p, s in zip(names, captured["grads"], trainer.params, start):
        tensors.update({f"grad.{name}": g, f"param.{name}": p.detach().clone(), f"start.{name}": s})
    return tensors, summary


# ---------------------------------------------------------------- equivalence stage


def split_update(tensors: Mapping[str, Tensor]) -> tuple[list[str], list[Tensor], list[Tensor], list[Tensor]]:
    """(names, grads, params after the step, params before) from an update stage's file, in a fixed order."""
    names = sorted(k.removeprefix("grad.") for k in tensors if k.startswith("grad."))
    return (names, [tensors[f"grad.{n}"] for n in names], [tensors[f"param.{n}"] for n in names],
            [tensors[f"start.{n}"] for n in names])


def compare_updates(updates: Mapping[str, Mapping[str, Tensor]], dtype: str) -> dict:
    """The certificate: each Lean schedule's gradient and step against Recompute's (``lean.equivalence.compare``),
    plus flat metrics ``max_rel_grad_diff_<schedule>`` / ``cosine_<schedule>`` and ``passes``."""
    from lean.equivalence import LEAN_SCHEDULES, compare, passes, tolerance

    names, ref_grads, ref_params, start = split_update(updates["recompute"])
    report: dict[str, Any] = {"dtype": dtype}
    for schedule in LEAN_SCHEDULES:
        other_names, grads, params, other_start = split_update(updates[schedule])
        if other_names != names or any(not torch.equal(a, b) for a, b in zip(start, other_start)):
            raise ValueError(f"{schedule}: the update did not start from Recompute's weights")
        report[schedule] = compare(grads, ref_grads, params, ref_params, start, names)
    report["passes"] = passes(report)
    report["tolerance"] = dict(zip(("max_rel_grad_diff", "one_minus_cosine"), tolerance(dtype)))
    for schedule in LEAN_SCHEDULES:
        report[f"max_rel_grad_diff_{schedule}"] = report[schedule]["max_rel_grad_diff"]
        report[f"cosine_{schedule}"] = report[schedule]["cosine"]
    return report


# ---------------------------------------------------------------- overlap stage


def overlap_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """Flat metrics of ``lean bench overlap``'s ``overlap.json``: per method, the median hidden fraction
    (1 - exposed / communication-only) and the median latency over every measured op and shape, and the median
    relative error of the timeline model."""
    from statistics import median

    by_method: dict[str, list[dict]] = defaultdict(list)
    for row in summary.get("results", []):
        by_method[row["method"]].append(row)
    out = {}
    for method, rows in by_method.items():
        key = method.replace("-", "_")
        out[f"overlap_hidden_fraction_{key}"] = median(r["hidden_fraction"] for r in rows)
        out[f"overlap_latency_ms_{key}"] = median(r["latency_ms"] for r in rows)
    model = summary.get("model") or {}
    if model.get("mean_abs_error") is not None:
        out["overlap_model_mean_abs_error"] = model["mean_abs_error"]
    return out


# ---------------------------------------------------------------- notebooks


class NotebookLog:
    """A notebook's MLflow run (nested under the report stage's run when that passes ``parent_run_id``), its figures
    and metrics, and the JSON summary (``{"notebook", "run_id", "metrics"}``) the report stage collects."""

    def __init__(self, name: str, track: bool = True, parent_run_id: str | None = None):
        from lean import tracking

        tracking.configure(enabled=track)
        self.name, self.metrics = name, {}
        parent = tracking.attach(parent_run_id) if parent_run_id else None
        self.run = tracking.start_run(f"notebook[{name}]", stage="report", parent=parent,
                                      tags={"lean.notebook": name})
        self.run_id = self.run.run_id

    def figure(self, figure, filename: str) -> None:
        self.run.log_figure(figure, filename)

    def log(self, metrics: Mapping[str, float]) -> None:
        self.metrics.update({k: float(v) for k, v in metrics.items()})
        self.run.log_metrics(metrics)

    def close(self, summary_path: str | Path | None = None) -> dict:
        summary = {"notebook": self.name, "run_id": self.run_id, "metrics": self.metrics}
        if summary_path:
            write_json(summary_path, summary)
        self.run.finish()
        return summary
