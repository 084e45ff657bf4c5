"""``lean train``: GRPO iterations (``lean.run.iteration``) with the chosen schedule, checkpoints, tracking and outputs.

Data parallel through Accelerate (``lean.parallel.distributed``): every process rolls out its slice of each iteration's
batch, advantages are computed over all of them, and gradients are averaged once per update
(``lean.run.optimizer.TrainState.step``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save_file
from tqdm.auto import tqdm

from lean import checkpoint, export
from lean.algorithms import ALGORITHMS
from lean.config import SECTIONS, ConfigError, RunConfig
from lean.config.moved import relocated
from lean.evaluation import Evaluator
from lean.observe import tracking
from lean.observe.comms import CollectiveLog
from lean.observe.memory_trace import MemoryTrace
from lean.observe.metrics import FlopTally, median
from lean.observe.outputs import numbers, write_csv, write_json
from lean.parallel.distributed import World, init_world, set_threads
from lean.parallel.grad_sync import PER_BACKWARD, resolve_grad_sync
from lean.parallel.sharding import effective_shard, reduce_scatter_accumulated, set_gradient_sync, shards
from lean.plan.cost import PlanInput, decide, described_choice, plan_input, with_layout, with_retain
from lean.run.iteration import IterationResult, NonFiniteError, build_pipeline
from lean.run.optimizer import TrainState
from lean.run.preemption import Preempted, StopOnSigterm
from lean.schedules import AUTO, LEAN_SCHEDULES, SCHEDULES
from lean.schedules.recompute import RECOMPUTE_FORWARD


class Trainer:
    """One process's share of a GRPO run: the iteration pipeline (policy, config, layout) and the trainable state."""

    def __init__(self, cfg: RunConfig, world: World | None = None):
        self.world = world or init_world(cfg.train.dist_timeout_s, cfg.parallel.sequence_parallel)
        self.pipeline = build_pipeline(cfg, self.world)
        self.cfg, self.policy = self.pipeline.cfg, self.pipeline.policy  # sample.shift resolved
        each_backward = resolve_grad_sync(self.cfg) == PER_BACKWARD
        self.state = TrainState(self.policy.trainable_parameters(), cfg.optimizer, cfg.ema, self.world, each_backward)
        if self.state.sharded and not each_backward:  # FSDP2 accumulates unsharded; one reduce-scatter per update
            set_gradient_sync(self.policy, False)
            self.state.reduce_accumulated = functools.partial(reduce_scatter_accumulated, self.policy)
        self.state.snapshot = self.pipeline.snapshot  # checkpointed with the weights
        self.state.algorithm = self.pipeline.algorithm  # its state across iterations too (GARDO's controller)

    @property
    def params(self):
        return self.state.params

    def iteration(
        self,
        iteration: int,
        schedule: str,
        *,
        tally: FlopTally | None = None,
        progress: Callable[[int], None] | None = None,
        measure_memory: bool = True,
        trace: MemoryTrace | None = None,
    ) -> IterationResult:
        """One GRPO iteration with the named schedule, applied to the trainable state (and its EMA, when
        ``ema.unit`` counts iterations)."""
        self.state.iteration = iteration
        self.state.take_sync_seconds()  # from here: this iteration's
        with CollectiveLog() as comms:
            result = self.pipeline.run(
                iteration,
                schedule,
                self.state.step,
                tally=tally,
                progress=progress,
                measure_memory=measure_memory,
                trace=trace,
            )
        self.state.end_iteration()
        # what crossed processes (lean.observe.comms), and the seconds the gradients' sync took: the whole gradients'
        # all-reduces, or a sharded full fine-tune's reduce-scatters
        counted = comms.metrics()
        sync_s = self.state.take_sync_seconds() + counted.pop("time_reduce_scatter_s")
        result.metrics.update(grad_sync=resolve_grad_sync(self.cfg), time_sync_s=sync_s, **counted)
        return result

    def plan_input(self) -> PlanInput:
        """What ``lean plan`` needs of this run (a fresh local batch of iteration 0)."""
        return plan_input(self.pipeline)


def resolve_schedule(trainer: Trainer) -> tuple[str, dict]:
    """``auto`` -> a Lean schedule from the memory budget (``lean.plan.cost``), and ``train.retain``'s ``auto`` keys
    -> the kept steps and offload of the fastest Retain variant that fits the device and host budgets (the run's
    config takes them). An explicit Lean schedule with a ``train.memory_budget_mb`` is refused up front when its
    predicted peak exceeds the budget."""
    t = trainer.cfg.train
    if t.schedule == AUTO or AUTO in (t.retain.steps, t.retain.offload):
        # each process times its own probe: they take the main process's choice
        decision = trainer.world.main_value(decide(trainer.plan_input()))
        if "retain_steps" in decision:  # train.retain's auto keys, resolved for the run's schedule
            resolved = with_retain(trainer.cfg, decision["retain_steps"], decision["retain_offload"])
            trainer.cfg = trainer.pipeline.cfg = resolved
        take_layout(trainer, decision["layout"])
        if trainer.world.is_main:
            print(
                f"lean auto: {', '.join(f'{k} {v:.0f} MiB' for k, v in decision.items() if k.endswith('_mb'))} "
                f"-> {described_choice(decision)}, parallel.layout={decision['layout']}",
                flush=True,
            )
        return decision["choice"], decision
    if SCHEDULES[t.schedule].exact_only_on_policy and t.memory_budget_mb is not None:
        decision = trainer.world.main_value(decide(trainer.plan_input()))  # one layout for every process
        take_layout(trainer, decision["layout"])
        peak = decision[f"{t.schedule}_predicted_peak_mb"]
        if peak > t.memory_budget_mb:
            others = [f"train.schedule={s}" for s in (*LEAN_SCHEDULES, AUTO) if s != t.schedule]
            raise ConfigError(
                "train.memory_budget_mb",
                t.memory_budget_mb,
                f"{t.schedule} is predicted to peak at {peak:.0f} MiB; raise the budget, or use {' or '.join(others)}",
            )
        return t.schedule, decision
    return t.schedule, {}


def take_layout(trainer: Trainer, layout: str) -> None:
    """``parallel.layout: auto`` set to the planner's ``layout`` before the first iteration (each iteration's local
    batch and finishing units follow the config's layout: ``lean.parallel.layout``); an explicit layout stays."""
    if trainer.cfg.parallel.layout == AUTO:
        trainer.cfg = trainer.pipeline.cfg = with_layout(trainer.cfg, layout)


def count_iteration_flops(trainer: Trainer, schedule: str, iteration: int = 0) -> dict[str, int]:
    """FLOPs of one iteration per region (rollout_forward, backward, recompute_forward, reference_forward, decode):
    a full iteration under ``FlopCounter``, with the weights and optimizer restored afterwards (``lean train``
    counts during its first iteration instead: :func:`train`)."""
    state = trainer.state.state_dict()
    tally = FlopTally()
    with tally.measuring():
        trainer.iteration(iteration, schedule, tally=tally)
    trainer.state.load_state_dict(state)
    return dict(tally.flops)


def needed_flops(flops: dict[str, int]) -> int:
    """What the algorithm needs: rollout forwards, reference forwards, decode, backwards and the forwards of updates
    after the first (``update_forward``, under moved weights); not the on-policy recompute."""
    return sum(v for k, v in flops.items() if k != RECOMPUTE_FORWARD)


# ---------------------------------------------------------------- lean train


def train(cfg: RunConfig, out: str | None = None, resume: bool = False, force: bool = False) -> list[dict]:
    """``lean train``: ``cfg.train.iterations`` iterations; metrics, LoRA weights and checkpoints under ``out``.

    ``resume`` continues from the newest complete checkpoint in ``out/checkpoints`` (bit-identical to a run that was
    never interrupted: every iteration's trajectories are a function of (seed, iteration) alone). A checkpoint
    written under a config that differs in anything but :data:`RESUMABLE_CHANGES` is refused before any model is
    built (a :class:`ConfigError` naming the keys), unless ``force``.

    FLOPs per region are counted during the first iteration this process runs (``FlopCounter``; every iteration
    does the same work, so the count is any iteration's). Counting slows that iteration down, so its row says
    ``flops_counted: 1`` and the summary's ``time_*`` medians leave it out when other iterations were timed. Only
    when no iteration completed (a resume with nothing left, every iteration skipped) is one more, undone,
    iteration run to count.

    With ``eval.every`` the run evaluates (``lean.evaluation``) before the first iteration, after every
    ``eval.every``-th and after the last: ``<out>/eval/<iteration>/``, ``<out>/eval.csv``, MLflow.
    """
    with StopOnSigterm() as stop:  # from the start: a SIGTERM during set-up stops after the first iteration
        return _train(cfg, Path(out or cfg.train.out), resume, force, stop)


def _train(cfg: RunConfig, out_dir: Path, resume: bool, force: bool, stop: StopOnSigterm) -> list[dict]:
    """The run loop of ``lean train``: per iteration run it and log it, evaluate when due, checkpoint when due (and
    at a SIGTERM, ``stop``, after which it stops), until ``train.iterations``; returns the metric rows."""
    training = Training.set_up(cfg, out_dir, resume, force)
    training.evaluate(training.start)  # iteration 0: the base model
    bar = tqdm(
        range(training.start, cfg.train.iterations),
        desc=f"train[{training.schedule}]",
        initial=training.start,
        total=cfg.train.iterations,
        disable=not training.trainer.world.is_main,
    )
    for it in bar:
        row = training.iterate(it)  # its row kept and logged
        bar.set_postfix(reward=f"{row['reward_mean']:.4f}")
        training.evaluate(it + 1)  # the weights after it + 1 updates
        preempted = stop.requested(training.trainer.world)  # the safe point: every rank agrees
        if training.checkpoint_due(it) or preempted:  # every process: sharded state is gathered for the file
            training.save_checkpoint(it)
        if preempted:
            bar.close()
            raise training.stop(it)
    training.finish()
    return training.history


@dataclasses.dataclass(kw_only=True)
class Training:
    """One ``lean train`` in progress: its trainer and schedule, where it writes, and what its loop gathered."""

    cfg: RunConfig
    out_dir: Path
    trainer: Trainer
    schedule: str
    decision: dict  # auto's choice and the predictions behind it (resolve_schedule), or {}
    start: int  # the first iteration to run (after a resumed checkpoint's)
    history: list[dict]  # one metrics row per iteration
    evaluations: list[dict]
    run: tracking.Run
    evaluator: Evaluator | None
    flops: dict[str, int] | None = None  # per region, counted in the first iteration this process runs
    last: IterationResult | None = None  # the last completed iteration

    @classmethod
    def set_up(cls, cfg: RunConfig, out_dir: Path, resume: bool, force: bool) -> Training:
        """Resume from the newest checkpoint under ``out_dir`` (refused under another config unless ``force``) or
        start: the trainer, its schedule, the tracking run and the evaluator."""
        set_threads(cfg.train.threads)
        saved = checkpoint.latest(out_dir / "checkpoints") if resume else None
        if saved is not None and not force:
            check_resumable(saved.get("config"), cfg, out_dir)
        trainer = Trainer(cfg)
        trainer.pipeline.failed_rollouts = out_dir / "failed_rollouts"  # a batch no reward server scored is kept
        schedule, decision = resolve_schedule(trainer)
        start, history, run_id = resume_point(trainer, saved)
        if trainer.world.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            resuming = f", resuming at iteration {start}" if start else ""
            print(f"lean train: {describe_run(trainer, schedule)}{resuming}", flush=True)
        return cls(
            cfg=cfg,
            out_dir=out_dir,
            trainer=trainer,
            schedule=schedule,
            decision=decision,
            start=start,
            history=history,
            evaluations=list(saved.get("eval_history", [])) if saved is not None else [],
            run=tracking_run(trainer, out_dir, schedule, run_id),
            evaluator=Evaluator(trainer.pipeline, out_dir) if cfg.eval.every else None,
        )

    def iterate(self, it: int) -> dict:
        """Iteration ``it`` (FLOPs counted in the first this process runs); its row kept and logged to MLflow."""
        tally = FlopTally() if self.flops is None else None
        memory = it == self.start or it % self.cfg.train.memory_every == 0
        row, result = guarded_iteration(self.trainer, it, self.schedule, tally, measure_memory=memory)
        if tally is not None and result is not None:
            self.flops, row["flops_counted"] = dict(tally.flops), 1
        self.last = result or self.last
        self.history.append(row)
        self.run.log_metrics(row, step=it)  # --- MLflow: every iteration's numbers
        return row

    def evaluate(self, iteration: int) -> None:
        """The evaluation of the weights after ``iteration`` updates, when due (:func:`evaluate`)."""
        evaluate(self.trainer, self.evaluator, iteration, self.run, self.evaluations)

    def checkpoint_due(self, it: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and (it + 1) % every == 0

    def save_checkpoint(self, it: int) -> None:
        save_checkpoint(self.out_dir, it, self.trainer, self.history, self.evaluations, self.run.run_id, self.cfg)

    def stop(self, it: int) -> Preempted:
        """After a SIGTERM at iteration ``it`` (its checkpoint written): the tracking run closed, every process
        waiting for the checkpoint before any exits; the error to raise."""
        self.run.finish()
        self.trainer.world.wait_for_everyone()
        return Preempted(
            f"SIGTERM: stopped after iteration {it} ({it + 1} of {self.cfg.train.iterations} done), checkpoint in "
            f"{self.out_dir / 'checkpoints'}; continue with --resume"
        )

    def finish(self) -> None:
        """After the last iteration: the FLOPs (one more, undone, iteration when none completed), the last
        rollout's latents, the trained weights and every output (:func:`write_outputs`); the tracking run closed."""
        trainer, last = self.trainer, self.last
        flops = self.flops
        if flops is None:
            flops = flops_of_one_iteration(trainer, self.schedule, self.cfg.train.iterations - 1)
        latents = trainer.world.gather(last.final.contiguous()) if last is not None else None  # every rank's x_T
        weights = trained_weights(trainer)  # every process: sharded weights are gathered
        if trainer.world.is_main:
            write_outputs(
                self.out_dir, trainer, self.history, flops, self.schedule, self.decision, self.evaluations, weights
            )
            if last is not None:
                rollout = {"latents": latents.cpu(), "rewards": last.rewards.cpu()}
                save_file(rollout, self.out_dir / "rollout.safetensors")
            log_summary(self.run, self.out_dir)
        self.run.finish()
        trainer.world.wait_for_everyone()


def describe_run(trainer: Trainer, schedule: str) -> str:
    """How many processes, in which layout (data x sequence parallel, FSDP), on which device, with which schedule
    and model (:func:`describe_model`)."""
    world, parallel = trainer.world, trainer.cfg.parallel
    shard = effective_shard(parallel.shard, world.size)
    sharded = f", {shard} over all {world.size}" if shards(shard) else ""
    if world.sequence_parallel > 1:
        layout = (
            f" ({world.data_size} data-parallel x {world.sequence_parallel} sequence-parallel, "
            f"overlap={parallel.overlap}{sharded})"
        )
    else:
        layout = f" ({shard})" if shards(shard) else ""
    return f"{world.size} process(es){layout} on {world.device}, schedule={schedule}, {describe_model(trainer)}"


def save_checkpoint(
    out_dir: Path, it: int, trainer: Trainer, history: list, evaluations: list, run_id, cfg: RunConfig
) -> Path:
    """``<out>/checkpoints/iter-<it>``: the trainer's state after iteration ``it`` (whole tensors: a sharded state is
    gathered, so every process calls this and the main one writes), the metrics so far, the MLflow run and the config
    as given (sample.shift unresolved: what ``--resume`` compares)."""
    folder = out_dir / "checkpoints"
    if not (trainer.world.is_main or trainer.state.sharded):
        return folder  # nothing of this process's goes into the file
    trainer_state = trainer.state.state_dict(whole=True)  # a collective when sharded
    if not trainer.world.is_main:
        return folder
    state = {
        "trainer": trainer_state,
        "history": history,
        "eval_history": evaluations,
        "tracking_run_id": run_id,
        "config": cfg.to_dict(),
    }
    return checkpoint.save(folder, it, state, keep=cfg.checkpoint.keep)


RESUMABLE_CHANGES = frozenset(
    {
        "train.iterations",
        "train.out",
        "checkpoint.every",
        "checkpoint.keep",
        "train.dist_timeout_s",
        "train.threads",
        "reward.remote",
        "reward.pickle_servers",
        "eval.every",
        "eval.batch_size",
    }
)  # the run's length, where it writes, how it runs (a reward server's address); everything else changes the result


def config_changes(saved: dict, cfg: RunConfig) -> list[str]:
    """``key: saved -> now`` for every dotted key (outside :data:`RESUMABLE_CHANGES`) whose value differs. A section
    or key the saved config lacks (written before it existed) ran with its default; a key that moved since is compared
    at its new place (``lean.config.moved.relocated``)."""
    saved, now = relocated(saved), cfg.to_dict()
    changes = []
    for section in sorted(set(saved) | set(now)):
        default = dataclasses.asdict(SECTIONS[section]()) if section in SECTIONS else {}
        before, after = {**default, **(saved.get(section) or {})}, now.get(section) or {}  # a key added since: default
        for key in sorted(set(before) | set(after)):
            dotted = f"{section}.{key}"
            if dotted not in RESUMABLE_CHANGES and before.get(key) != after.get(key):
                changes.append(f"{dotted}: {_short(before.get(key))} -> {_short(after.get(key))}")
    return changes


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_resumable(saved: dict | None, cfg: RunConfig, out_dir: Path) -> None:
    """Refuse to resume a checkpoint written under another config (checkpoints from before configs were saved pass)."""
    changes = config_changes(saved, cfg) if saved is not None else []
    if changes:
        raise ConfigError(
            "--resume",
            str(out_dir),
            f"the checkpoint was written with another config ({'; '.join(changes)}); resume with the same config, "
            "or pass --force to continue with this one",
        )


def resume_point(trainer: Trainer, state: dict | None) -> tuple[int, list[dict], str | None]:
    """(first iteration to run, history so far, tracking run id) from a checkpoint (nothing: a fresh start)."""
    if state is None:
        return 0, [], None
    trainer.state.load_state_dict(state["trainer"])
    return state["iteration"] + 1, state["history"], state.get("tracking_run_id")


def tracking_run(trainer: Trainer, out_dir: Path, schedule: str, run_id: str | None) -> tracking.Run:
    """One MLflow run per training, continued by ``--resume``; rank 0 only; a no-op unless tracking is on. Calls
    that fail wait in ``<out>/tracking_pending.jsonl`` (replayed later, or by ``lean sync --out <out>``)."""
    spool = out_dir / tracking.SPOOL
    if not trainer.world.is_main:
        return tracking.Run()
    if run_id is not None:
        return tracking.attach(run_id, spool=spool, resume=True)
    algorithm = trainer.cfg.algorithm.name  # named beside GRPO's runs (the algorithms side by side in the chart view)
    name = f"train[{schedule}]" if algorithm == ALGORITHMS.default else f"train[{algorithm}:{schedule}]"
    tags = {"lean.algorithm": algorithm}
    return tracking.start_run(name, schedule=schedule, params=trainer.cfg.to_dict(), spool=spool, tags=tags)


def evaluate(
    trainer: Trainer, evaluator: Evaluator | None, iteration: int, run: tracking.Run, evaluations: list[dict]
) -> None:
    """The evaluation of ``iteration`` when it is due and not done yet (a resumed run has the earlier ones): with
    the EMA weights when ``ema.enabled`` and ``eval.use_ema``; its row appended to ``evaluations`` and
    ``<out>/eval.csv``, logged to MLflow at step ``iteration`` with its grid (a stepped image, ``eval_grid``) and
    its folder (artifacts ``eval/<iteration>/``). With ``eval.noise_seeds`` the row of iteration 0 (the base
    model) also holds ``eval_reward_noise_std`` (``Evaluator.noise_std``), which the checkpoints keep with it."""
    if evaluator is None or not evaluator.due(iteration) or any(e["iteration"] == iteration for e in evaluations):
        return
    with trainer.state.ema_swapped_in(trainer.cfg.eval.use_ema) as ema:
        row = {**evaluator.evaluate(iteration), "eval_ema": int(ema)}
        if iteration == 0 and trainer.cfg.eval.noise_seeds:  # the base model: the yardstick of the run's gain
            row.update(evaluator.noise_std(row["eval_reward_mean"]))
    evaluations.append(row)
    run.log_metrics({k: v for k, v in row.items() if k != "iteration"}, step=iteration)  # the step says it
    if trainer.world.is_main:
        noise = f", noise std {row['eval_reward_noise_std']:.4f}" if "eval_reward_noise_std" in row else ""
        images = evaluator.images_due(iteration)
        tqdm.write(
            f"lean eval at iteration {iteration}: reward {row['eval_reward_mean']:.4f} +- {row['eval_reward_std']:.4f} "
            f"({row['eval_samples']} samples, {row['eval_time_s']:.1f} s{noise})"
            + (f" -> {evaluator.folder(iteration)}" if images else "")
        )
        write_csv(evaluator.root.parent / "eval.csv", evaluations)
        if not images:
            return
        run.log_image(evaluator.folder(iteration) / "grid.png", "eval_grid", iteration)
        if (evaluator.folder(iteration) / "edits.png").exists():  # reference | base | trained, for edits
            run.log_image(evaluator.folder(iteration) / "edits.png", "eval_edits", iteration)
        run.log_artifact(evaluator.folder(iteration), f"eval/{iteration}")


def guarded_iteration(
    trainer: Trainer, it: int, schedule: str, tally: FlopTally | None = None, measure_memory: bool = True
) -> tuple[dict, IterationResult | None]:
    """One iteration with a progress bar over its sampling steps, its FLOPs counted into ``tally`` if given (and its
    peak memory measured if ``measure_memory``). A non-finite value aborts the run (``train.on_nonfinite: abort``) or
    undoes the iteration (``skip``: weights and optimizer restored)."""
    before = trainer.state.state_dict() if trainer.cfg.train.on_nonfinite == "skip" else None
    prompts = trainer.pipeline.local_batch(it).prompts
    steps = tqdm(  # every rollout micro-batch takes all the sampling steps
        total=trainer.cfg.sample.num_steps * math.ceil(len(prompts) / trainer.cfg.train.rollout_batch_size),
        desc="rollout",
        leave=False,
        disable=not trainer.world.is_main,
    )
    if tally is not None:  # prompts (and CFG's empty one) are encoded once per run, not per iteration: cache them
        # outside the count; one at a time: an edit and the negative prompt do not batch together
        for prompt in (*prompts, trainer.policy.negative_prompt):
            trainer.policy.encode_prompts([prompt])
    try:
        with tally.measuring() if tally is not None else contextlib.nullcontext():
            result = trainer.iteration(
                it, schedule, tally=tally, progress=lambda i: steps.update(1), measure_memory=measure_memory
            )
        return result.metrics, result
    except NonFiniteError as err:
        if before is None:
            raise
        trainer.state.load_state_dict(before)  # the step never happened
        trainer.state.zero_grad()
        warnings.warn(f"skipping iteration {it}: {err}", stacklevel=2)
        return {"iteration": it, "schedule": schedule, "skipped": 1, "reward_mean": float("nan")}, None
    finally:
        steps.close()


def describe_model(trainer: Trainer) -> str:
    """What the run loaded: family/size and dtype, the pretrained folder (or random weights), the transformer's
    parameters and how many are trained, and the sigma grid's shift with its source."""
    m, policy = trainer.cfg.model, trainer.policy
    total = sum(p.numel() for p in policy.denoisers.parameters())  # with the LoRA layers, if any
    trained = sum(p.numel() for _, p in policy.trainable_parameters())
    how = "full fine-tune" if m.full_finetune else f"LoRA r{m.lora_rank}"
    return (
        f"{m.family}/{m.size} {m.dtype} "
        + (f"from {m.pretrained}" if m.pretrained else "random weights")
        + f" (transformer {short_count(total)} parameters, {short_count(trained)} trained: {how}), "
        + f"shift {trainer.cfg.sample.shift:.6g} ({trainer.pipeline.shift_source})"
    )


def short_count(n: int) -> str:
    """1234567 -> '1.23M'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def flops_of_one_iteration(trainer: Trainer, schedule: str, iteration: int) -> dict[str, int]:
    """FLOPs per region of one more (untimed, undone) iteration; a measurement never fails the run."""
    try:
        return count_iteration_flops(trainer, schedule, iteration)
    except NonFiniteError:
        return {}


@dataclasses.dataclass
class TrainedWeights:
    """What ``lean train`` exports, as whole tensors on the main process (``trained_weights``)."""

    params: dict  # keyed as Policy.lora_state_dict
    ema: dict | None  # the same keys, with ema.enabled
    base_sha256: str | None  # a random base's fingerprint (lean.export.base_fingerprint), where it can be rebuilt


def trained_weights(trainer: Trainer) -> TrainedWeights:
    """The trained weights, EMA and base fingerprint, gathered where sharded: every process calls it."""
    m = trainer.cfg.model
    fingerprint = export.base_fingerprint(trainer.policy) if export.rebuildable(m) else None
    return TrainedWeights(trainer.policy.lora_state_dict(), trainer.state.ema_state_dict(), fingerprint)


def write_outputs(
    out_dir: Path,
    trainer: Trainer,
    history: list[dict],
    flops: dict,
    schedule: str,
    decision: dict,
    evaluations: list[dict],
    weights: TrainedWeights,
) -> None:
    """metrics.csv (one row per iteration), metrics.json (the summary), lora.safetensors, config.json; with
    ``ema.enabled`` also lora_ema.safetensors (the EMA weights, keyed as lora.safetensors); the diffusers LoRA folders
    ``lora/`` (``lora_ema/``) and a random base's fingerprint (``lean.export.write_run_exports``). With evaluations,
    the summary has the eval reward of each (``eval_reward_mean`` at ``eval_iterations``), the first, the last,
    ``eval_reward_gain`` = last - first and, with ``eval.noise_seeds``, the base model's ``eval_reward_noise_std``."""
    keys = sorted({k for row in history for k in row if isinstance(row[k], (int, float))})
    # the iteration that counted FLOPs ran slower; its times count only when no other iteration was timed
    timed = [row for row in history if not row.get("flops_counted")] or history
    write_csv(out_dir / "metrics.csv", history, fields=keys)
    write_json(
        out_dir / "metrics.json",
        {
            "schedule": schedule,
            "world_size": trainer.world.size,
            "reward_mean": [row["reward_mean"] for row in history],
            "final_reward_mean": history[-1]["reward_mean"],
            "flops_per_iteration": sum(flops.values()),
            "flops_needed_per_iteration": needed_flops(flops),
            "flops_by_region": flops,
            "skipped_iterations": [row["iteration"] for row in history if row.get("skipped")],
            **{k: median([row[k] for row in timed if k in row]) for k in keys if k.startswith("time_")},
            "peak_memory_mb": max(  # over the iterations that measured it (train.memory_every)
                (row["peak_memory_mb"] for row in history if not math.isnan(row.get("peak_memory_mb", math.nan))),
                default=math.nan,
            ),
            **({AUTO: decision} if decision else {}),
            **eval_summary(evaluations),
        },
    )
    trainer.policy.save_lora(out_dir / "lora.safetensors", weights.params)
    if weights.ema is not None:
        trainer.policy.save_lora(out_dir / "lora_ema.safetensors", weights.ema)
    export.write_run_exports(out_dir, trainer.policy, weights.ema, weights.base_sha256, trainer.cfg)
    write_json(out_dir / "config.json", trainer.cfg.to_dict())


def eval_summary(evaluations: list[dict]) -> dict:
    """The evaluations' part of metrics.json (nothing without evaluations)."""
    if not evaluations:
        return {}
    ordered = sorted(evaluations, key=lambda e: e["iteration"])
    first, last = ordered[0]["eval_reward_mean"], ordered[-1]["eval_reward_mean"]
    noise = ordered[0].get("eval_reward_noise_std")  # the base model's, when eval.noise_seeds measured it
    return {
        "eval_iterations": [e["iteration"] for e in ordered],
        "eval_reward_mean": [e["eval_reward_mean"] for e in ordered],
        "eval_reward_first": first,
        "eval_reward_last": last,
        "eval_reward_gain": last - first,
        **({"eval_reward_noise_std": noise} if noise is not None else {}),
    }


def log_summary(run: tracking.Run, out_dir: Path) -> None:
    """MLflow: the run's summary numbers and its metrics files."""
    run.log_metrics(numbers(json.loads((out_dir / "metrics.json").read_text())))
    run.log_artifact(out_dir / "metrics.csv")
    run.log_artifact(out_dir / "metrics.json")
