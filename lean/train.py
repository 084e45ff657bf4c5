"""GRPO training: one iteration = rollout -> decode -> rewards -> group advantages -> the schedule's update.

Data parallel through Accelerate (one process, several CPU processes on gloo, several GPUs on NCCL). The global batch
of an iteration is prompts_per_iteration x group_size samples; process r rolls out the contiguous slice r of it. Rewards
are gathered so that every group is normalised over all its samples, and each process keeps its own slice of the
advantages. Gradients are averaged across processes in ``optimizer_step`` (one flat all-reduce: with LoRA the gradient
is small, and all schedules then sync at the same, explicit point; Reweight relies on that delay).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from lean import tracking
from lean.advantage import group_advantages, local_slice
from lean.config import ConfigError, RunConfig, validate
from lean.metrics import FlopTally, PeakMemory, PhaseTimer, median
from lean.rewards import compute_rewards
from lean.rollout import iteration_generator, rollout, sample_generator
from lean.schedules import SCHEDULES, IterationContext
from lean.schedules.base import flat_grad, set_grads, trainable
from lean.sde import plan_steps, sigma_schedule

def make_accelerator(timeout_s: float = 60.0):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cpu = not torch.cuda.is_available()
    return Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))])


@dataclasses.dataclass
class LocalBatch:
    samples: list[tuple[int, int, int]]  # (group, prompt index, sample index) of the whole iteration
    mine: list[tuple[int, int, int]]  # this process's contiguous slice of them
    prompts: list[str]
    generators: list[torch.Generator]
    plan: object  # lean.sde.StepPlan


class NonFiniteError(FloatingPointError):
    """A non-finite reward, log-prob, loss or gradient; the message names the tensor and the iteration."""


class Trainer:
    """The policy, its optimizer and the process layout; ``iteration()`` runs one GRPO iteration."""

    def __init__(self, cfg: RunConfig, accelerator=None):
        self.accelerator = accelerator or make_accelerator(cfg.train.dist_timeout_s)
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        validate(cfg, world_size=self.world)
        self.cfg = cfg
        self.device = self.accelerator.device
        from lean.models import build_policy

        self.policy = build_policy(cfg.model, cfg.train.prompts, device=self.device)
        self.params = trainable(self.policy)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           weight_decay=t.weight_decay)
        self.ema = [p.detach().clone() for p in self.params] if t.ema else None
        self.optimizer_steps = 0
        self.current_iteration = 0
        self.sigmas = sigma_schedule(cfg.sample.num_steps, cfg.sample.shift, cfg.sample.sigma_grid).to(self.device)
        self.grad_probe: Callable[[list[torch.nn.Parameter]], None] | None = None

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    # ------------------------------------------------------------ the batch of one iteration

    def global_samples(self, iteration: int) -> list[tuple[int, int, int]]:
        """(group, prompt index, sample index) of every sample of the iteration, in global order."""
        t = self.cfg.train
        gen = iteration_generator(t.seed, iteration)
        n = len(t.prompts)
        if t.prompts_per_iteration <= n:
            chosen = torch.randperm(n, generator=gen)[: t.prompts_per_iteration].tolist()
        else:
            chosen = torch.randint(n, (t.prompts_per_iteration,), generator=gen).tolist()
        return [(g, p, k) for g, p in enumerate(chosen) for k in range(t.group_size)]

    # ------------------------------------------------------------ update

    def optimizer_step(self) -> dict:
        """Average gradients across processes, clip, AdamW, EMA. The only place gradients are synchronised."""
        grads = flat_grad(self.params, [p.grad for p in self.params])
        if self.world > 1:
            torch.distributed.all_reduce(grads)
            grads /= self.world
        for p in self.params:
            p.grad = None
        set_grads(self.params, grads)
        if not torch.isfinite(grads).all():
            names = [n for (n, p) in self.policy.trainable_parameters() if not torch.isfinite(p.grad).all()]
            raise NonFiniteError(f"non-finite gradient of {names[0]} (and {len(names) - 1} more tensors) "
                                 f"at iteration {self.current_iteration}")
        if self.grad_probe is not None:
            self.grad_probe(self.params)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        t = self.cfg.train
        if self.ema is not None and self.optimizer_steps % t.ema_every == 0:
            with torch.no_grad():
                for e, p in zip(self.ema, self.params):
                    e.lerp_(p, 1 - t.ema_decay)
        return {"grad_norm": float(norm)}

    # ------------------------------------------------------------ one iteration

    def local_batch(self, iteration: int) -> LocalBatch:
        """This process's samples of the iteration: prompts, random streams and trained-step plan."""
        cfg, t = self.cfg, self.cfg.train
        samples = self.global_samples(iteration)
        mine = samples[local_slice(len(samples), self.rank, self.world)]
        generators = [sample_generator(t.seed, iteration, p, k) for _, p, k in mine]
        # The plan draws from the sample streams first, the rollout's noise comes after: a fixed order.
        plan = plan_steps(cfg.sample.num_steps, len(mine), timestep_fraction=cfg.sample.timestep_fraction,
                          selection=cfg.sample.timestep_selection, sde_window=cfg.sample.sde_window,
                          sde_window_max_start=cfg.sample.sde_window_max_start,
                          window_generator=iteration_generator(t.seed, iteration, purpose=99),
                          sample_generators=generators)
        return LocalBatch(samples, mine, [t.prompts[p] for _, p, _ in mine], generators, plan)

    def iteration(self, iteration: int, schedule: str, *, tally: FlopTally | None = None,
                  progress: Callable[[int], None] | None = None, measure_memory: bool = True) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self.current_iteration = iteration
        tally = tally or FlopTally()
        timer = PhaseTimer(self.device)
        with PeakMemory(self.device, enabled=measure_memory) as memory, timer("iteration"):
            batch = self.local_batch(iteration)
            samples, prompts, generators, plan = batch.samples, batch.prompts, batch.generators, batch.plan
            emb = self.policy.encode_prompts(prompts)
            ctx = IterationContext(self.policy, cfg, self.sigmas, emb, plan, tally, timer)
            sched = SCHEDULES[schedule](ctx, iteration=iteration)

            def on_step(step):
                if not torch.isfinite(step.log_prob).all():
                    raise NonFiniteError(f"non-finite log_prob at step {step.index} of iteration {iteration}")
                sched.on_step(step)

            with timer("rollout"), tally.region("rollout_forward"):
                final = rollout(self.policy, emb, generators, plan, cfg.sample, self.sigmas, on_step=on_step,
                                track_grad=sched.track_grad, micro_batch=t.rollout_batch_size,
                                grad_micro_batch=sched.grad_micro_batch,
                                progress=progress)
            with timer("reward"):
                with tally.region("decode"):
                    images = self.policy.decode(final)
                rewards, parts = compute_rewards(cfg.reward.weights, images, prompts)
            with timer("advantage"):
                all_rewards = self.gather(rewards.to(self.device, torch.float64))
                self.last_latents, self.last_rewards = final, all_rewards
                groups = torch.tensor([g for g, _, _ in samples], device=all_rewards.device)
                advantages = group_advantages(all_rewards, groups, global_std=t.global_std, clip=t.adv_clip_max)
                local_adv = advantages[local_slice(len(samples), self.rank, self.world)].cpu()
            if not torch.isfinite(all_rewards).all():
                bad = torch.nonzero(~torch.isfinite(all_rewards)).flatten().tolist()
                raise NonFiniteError(f"non-finite reward of samples {bad} at iteration {iteration}")
            with timer("update"):
                stats = sched.finish(local_adv, self.optimizer_step)
            for key in ("policy_loss", "kl"):
                if key in stats and not math.isfinite(stats[key]):
                    raise NonFiniteError(f"non-finite {key} at iteration {iteration}")

        out = {
            "iteration": iteration,
            "schedule": schedule,
            "reward_mean": all_rewards.mean().item(),
            "reward_std": all_rewards.std(unbiased=False).item(),
            **{f"reward_{k}": self.gather(v.to(self.device, torch.float64)).mean().item() for k, v in parts.items()},
            **{f"time_{k}_s": v for k, v in timer.seconds.items()},
            "peak_memory_mb": memory.peak_mb,
            "peak_memory_delta_mb": memory.delta_mb,
            **stats,
        }
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(x) if self.world > 1 else x

    # ------------------------------------------------------------ state (equivalence, bench, checkpoints)

    def trainable_state(self) -> dict:
        return {
            "params": [p.detach().clone() for p in self.params],
            "optimizer": _clone(self.optimizer.state_dict()),
            "ema": None if self.ema is None else [e.clone() for e in self.ema],
            "optimizer_steps": self.optimizer_steps,
        }

    def load_trainable_state(self, state: dict) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
        self.optimizer.load_state_dict(_clone(state["optimizer"]))
        if state["ema"] is not None:
            self.ema = [e.clone() for e in state["ema"]]
        self.optimizer_steps = state["optimizer_steps"]


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def resolve_schedule(trainer: Trainer) -> tuple[str, dict]:
    """``auto`` -> retain or reweight from the memory budget (see ``lean.plan``). An explicit ``retain`` with a
    ``train.memory_budget_mb`` is refused up front when its predicted peak exceeds the budget."""
    from lean.plan import choose_schedule

    t = trainer.cfg.train
    if t.schedule == "auto":
        return choose_schedule(trainer)
    if t.schedule == "retain" and t.memory_budget_mb is not None:
        choice, decision = choose_schedule(trainer)
        if choice != "retain":
            raise ConfigError("train.memory_budget_mb", t.memory_budget_mb,
                              f"Retain is predicted to peak at {decision['retain_predicted_peak_mb']:.0f} MiB; "
                              "raise the budget, or use train.schedule=reweight or auto")
        return "retain", decision
    return t.schedule, {}


def count_iteration_flops(trainer: Trainer, schedule: str, iteration: int = 0) -> dict[str, int]:
    """FLOPs of one iteration per region (rollout_forward, backward, recompute_forward, reference_forward, decode).

    Runs a full iteration under ``FlopCounterMode`` and restores the weights and optimizer afterwards.
    """
    state = trainer.trainable_state()
    tally = FlopTally()
    with tally.measuring():
        trainer.iteration(iteration, schedule, tally=tally)
    trainer.load_trainable_state(state)
    return dict(tally.flops)


def needed_flops(flops: dict[str, int]) -> int:
    """What the algorithm needs: rollout forwards, reference forwards, decode and backwards; no recompute."""
    return sum(v for k, v in flops.items() if k != "recompute_forward")


def train(cfg: RunConfig, out: str | None = None, resume: bool = False) -> list[dict]:
    """``lean train``: run cfg.train.iterations iterations; write metrics, LoRA weights and checkpoints under ``out``.

    ``resume`` continues from the newest complete checkpoint in ``out/checkpoints`` (bit-identical to a run that was
    never interrupted: every iteration's trajectories are a function of (seed, iteration) alone).
    """
    from tqdm.auto import tqdm

    from lean import checkpoint

    t = cfg.train
    trainer = Trainer(cfg)
    out_dir = Path(out or t.out)
    schedule, decision = resolve_schedule(trainer)
    history, start, run_id = [], 0, None
    if resume and (state := checkpoint.latest(out_dir / "checkpoints")) is not None:
        trainer.load_trainable_state(state["trainer"])
        history, start = state["history"], state["iteration"] + 1
        run_id = state.get("tracking_run_id")
    if trainer.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"lean train: {trainer.world} process(es) on {trainer.device}, schedule={schedule}, "
              f"{cfg.model.family}/{cfg.model.size} {cfg.model.dtype}"
              + (f", resuming at iteration {start}" if start else ""), flush=True)
    # --- MLflow (lean.tracking): one run per training, continued by --resume; rank 0 only; a no-op unless on.
    # Calls that fail wait in <out>/tracking_pending.jsonl (replayed later, or by `lean sync --out <out>`).
    spool = out_dir / tracking.SPOOL
    if not trainer.is_main:
        run = tracking.Run()
    elif run_id is not None:
        run = tracking.attach(run_id, spool=spool, resume=True)
    else:
        run = tracking.start_run(f"train[{schedule}]", schedule=schedule, params=cfg.to_dict(), spool=spool)
    bar = tqdm(range(start, t.iterations), desc=f"train[{schedule}]", initial=start, total=t.iterations,
               disable=not trainer.is_main)
    for it in bar:
        steps = tqdm(total=cfg.sample.num_steps, desc="rollout", leave=False, disable=not trainer.is_main)
        before = trainer.trainable_state() if t.on_nonfinite == "skip" else None
        try:
            row = trainer.iteration(it, schedule, progress=lambda i: steps.update(1))
        except NonFiniteError as err:
            if before is None:
                raise
            trainer.load_trainable_state(before)  # the step never happened
            trainer.optimizer.zero_grad(set_to_none=True)
            warnings.warn(f"skipping iteration {it}: {err}")
            row = {"iteration": it, "schedule": schedule, "skipped": 1, "reward_mean": float("nan")}
        steps.close()
        history.append(row)
        run.log_metrics(row, step=it)  # --- MLflow: every iteration's numbers
        bar.set_postfix(reward=f"{row['reward_mean']:.4f}")
        if t.save_every and (it + 1) % t.save_every == 0 and trainer.is_main:
            checkpoint.save(out_dir / "checkpoints", it, {"trainer": trainer.trainable_state(), "history": history,
                                                          "tracking_run_id": run.run_id}, keep=t.keep_checkpoints)
    try:  # FLOPs of one more (untimed, undone) iteration; a measurement must not fail the run
        flops = count_iteration_flops(trainer, schedule, iteration=t.iterations - 1)
    except NonFiniteError:
        flops = {}
    latents = trainer.gather(trainer.last_latents.contiguous())  # the last iteration's trajectories, all ranks
    if trainer.is_main:
        write_outputs(out_dir, cfg, history, flops, schedule, decision, trainer)
        save_file({"latents": latents.cpu(), "rewards": trainer.last_rewards.cpu()}, out_dir / "rollout.safetensors")
        # --- MLflow: the run's summary numbers and its metrics files, then close it ---
        summary = json.loads((out_dir / "metrics.json").read_text())
        run.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        run.log_artifact(out_dir / "metrics.csv")
        run.log_artifact(out_dir / "metrics.json")
    run.finish()
    trainer.accelerator.wait_for_everyone()
    return history


def write_outputs(out_dir: Path, cfg: RunConfig, history: list[dict], flops: dict, schedule: str, decision: dict,
                  trainer: Trainer) -> None:
    keys = sorted({k for row in history for k in row if isinstance(row[k], (int, float))})
    with open(out_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(history)
    summary = {
        "schedule": schedule,
        "world_size": trainer.world,
        "reward_mean": [row["reward_mean"] for row in history],
        "final_reward_mean": history[-1]["reward_mean"],
        "flops_per_iteration": sum(flops.values()),
        "flops_needed_per_iteration": needed_flops(flops),
        "flops_by_region": flops,
        "skipped_iterations": [row["iteration"] for row in history if row.get("skipped")],
        **{k: median([row[k] for row in history if k in row]) for k in keys if k.startswith("time_")},
        "peak_memory_mb": max((row["peak_memory_mb"] for row in history if "peak_memory_mb" in row),
                              default=float("nan")),
        **({"auto": decision} if decision else {}),
    }
    (out_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
    trainer.policy.save_lora(out_dir / "lora.safetensors")
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

