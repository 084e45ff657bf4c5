"""``lean bench schedules``: every registered schedule (Recompute vs Retain vs Reweight) on one config, measured in
one process, interleaved.

Every round runs the three schedules one after another, in alternating order (A B C, C B A, ...: a machine whose speed
drifts slowly favours no schedule), from the same saved weights and optimizer state, so they do identical work on
identical trajectories; the first ``warmup`` rounds are discarded and medians are taken over ``repeats`` rounds.
Peak memory comes from one extra, untimed iteration per schedule before the timed rounds
(``lean.observe.metrics.PeakMemory``: trimmed heap, reset high-water mark), FLOPs from another under
``FlopCounter``: both disturb timing. On CPU the heap maps every large block on its own during the memory pass
(``live_bytes_heap``), so that the resident set counts live tensor bytes as ``max_memory_allocated`` does on GPU, and
keeps freed pages during the timed rounds (``keep_freed_memory``), as the CUDA caching allocator does.

    speedup        = median T_iter(recompute) / median T_iter(schedule)
    speedup_bound  = T_iter / (T_iter - q recompute_forward), from Recompute's phases in this run: the speedup if
                     removing what the Lean schedules remove were free. recompute_forward is the forward of the first
                     update (all of it on-policy; with several updates per rollout the later updates' forwards are
                     ``update_forward``, which the hybrids run too); q is the share of its terms the schedule does not
                     recompute: 1, but for Retain keeping the graphs of only the last m of each sample's K trained
                     steps (``train.retain.steps``: partial retention) q = sum_b min(m, K_b) / sum_b K_b, the bound
                     (n f + K fb) / ((n - m) f + K fb) of docs/design/retain-offload.md. On a tree rollout
                     (``sample.tree``) Retain also removes the share w = 1 - trained nodes / trained edges of
                     Recompute's update backward (one backward per kept node graph, one per recomputed edge):
                     T_iter / (T_iter - q recompute_forward - q w backward). Nothing else is removed, and on one
                     core (``cores: 1``, the default) nothing overlapped can run on hardware the others leave idle:
                     the scoring thread and the backward share the core, as the decode, the rewards and the backward
                     share one GPU. A speedup above its bound is then noise, not a result.
    cpu_speedup    = the same ratio of process CPU time (every thread), beside wall time
    MFU            = FLOPs the algorithm needs (rollout, reference and decode forwards + backwards; no recompute)
                     / (T_iter x peak FLOP/s)
    HFU            = FLOPs executed / (T_iter x peak FLOP/s)

On a tree config the flat rollout of as many leaves (:func:`flat_form`: DanceGRPO's, no branch point, ``grpo``, its own
model) runs under Recompute in the same interleaved rounds; ``flat`` in the result holds its medians and, per tree
schedule, ``tree_speedup_<schedule>`` = median over the rounds of flat time / tree time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from math import nan
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lean.config import AUTO, ConfigError, RunConfig, read_config, read_params
from lean.configure import on_policy_form, validate
from lean.observe.memory_trace import MemoryTrace
from lean.observe.metrics import keep_freed_memory, live_bytes_heap, median, peak_flops, share_main_arena
from lean.observe.outputs import JsonLines, write_json
from lean.observe.provenance import machine
from lean.parallel.distributed import keeps_process_settings, pin_cores, set_threads
from lean.plan.cost import (
    budget_mb,
    choose,
    exact_predictions,
    iteration_costs,
    prediction_table,
    probe,
    retain_choice,
)
from lean.sampling.tree import tree_shape
from lean.schedules import (
    BASELINE,
    LEAN_SCHEDULES,
    SCHEDULES,
    RowCounts,
    algorithm_schedules,
    run_problem,
)
from lean.schedules.retain import ALL_STEPS, DEVICE, Retain
from lean.train import Trainer, count_iteration_flops, needed_flops

RETAIN = next(name for name, schedule in SCHEDULES.items() if schedule is Retain)  # the row train.retain configures

PHASES = (
    "time_iteration_s",
    "time_rollout_s",
    "time_update_s",
    "time_backward_s",
    "time_recompute_forward_s",
    "time_update_forward_s",
    "time_reference_forward_s",
    "time_reward_s",
    "time_reward_exposed_s",
    "time_advantage_s",
    "cpu_iteration_s",
)


@dataclass(frozen=True)
class BenchOptions:
    """``params.yaml``'s ``bench`` section, less its ``run:`` mapping (the config overrides)."""

    repeats: int = 3
    """Timed rounds (medians)."""
    warmup: int = 1
    """Discarded rounds."""
    threads: int = 1
    """Torch threads; 0: torch's default."""
    cores: int = 1
    """CPUs the process runs on (its affinity, every thread); 0: all it may use. One, so that a schedule that overlaps
    work in a second thread (the scoring) does not gain a core the others leave idle."""
    flops: bool = True
    """Count each schedule's FLOPs (one more iteration each, under ``FlopCounter``: MFU and HFU)."""


def bench_config(
    params: str | os.PathLike | None, overrides: list[str] = (), preset: str | None = None, **options
) -> tuple[RunConfig, BenchOptions]:
    """The benchmark's config: the run sections, the preset, then the ``bench`` section's ``run:`` mapping (the
    benchmark's default config: a model size at which CPU time goes to arithmetic, not per-op overhead), then
    ``overrides``; ``options`` that are not None replace the section's repeats / warmup / threads."""
    has_params = params is not None and Path(params).exists()
    section = (read_params(params).get("bench") or {}) if has_params else {}
    cfg = measured_retain(
        read_config(params if has_params else None, overrides, preset=preset, stage="bench" if has_params else None)
    )
    validate(cfg)
    keys = ("repeats", "warmup", "threads", "cores", "flops")
    chosen = {k: (f"bench.{k}", section[k]) for k in keys if k in section}
    chosen.update({k: (f"--{k}", v) for k, v in options.items() if v is not None})  # the command line wins
    if "flops" in chosen and not isinstance(chosen["flops"][1], bool):
        raise ConfigError(*chosen["flops"], "must be true or false")
    for key, low in (("repeats", 1), ("warmup", 0), ("threads", 0), ("cores", 0)):
        name, value = chosen.get(key, (key, getattr(BenchOptions, key)))
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(name, value, f"must be an integer >= {low}")
    return cfg, BenchOptions(**{k: v for k, (_, v) in chosen.items()})


def measured_retain(cfg: RunConfig) -> RunConfig:
    """The bench runs every schedule whatever ``train.schedule`` names, so ``train.retain``'s keys (Retain's row:
    partial retention, offload) are taken under any: ``train.schedule`` becomes auto, which admits them. Their m must
    be given (an integer or all): the bound depends on it."""
    retain = cfg.train.retain
    if retain.steps == AUTO:
        raise ConfigError("train.retain.steps", AUTO, "lean bench schedules measures a given m: an integer or all")
    if not retain.is_default and cfg.train.schedule not in (RETAIN, AUTO):
        cfg.train.schedule = AUTO
    return cfg


def retained_share(steps: int | str, trained: torch.Tensor) -> float:
    """q: the share of the trained (sample, step) terms whose graphs Retain keeps, the last ``steps`` = m of each
    sample's K_b (``trained`` [B, n] bool): sum_b min(m, K_b) / sum_b K_b; 1 for all."""
    per_sample = trained.sum(1)
    if steps == ALL_STEPS:
        return 1.0
    return int(per_sample.clamp(max=steps).sum()) / max(int(per_sample.sum()), 1)


def speedup_bound(time_s: float, recompute_forward_s: float, removed: float = 1.0, backward_s: float = 0.0) -> float:
    """Recompute's iteration time over itself less the share ``removed`` of its on-policy recompute forward and the
    ``backward_s`` seconds of its update backward the schedule does not run (a tree's Retain:
    :func:`tree_backward_share`)."""
    return time_s / (time_s - removed * recompute_forward_s - backward_s)


def tree_backward_share(rows: RowCounts | None) -> float:
    """The share of Recompute's update backward that Retain does not run on a tree: Recompute backpropagates one
    forward per trained edge (``recompute_terms``), Retain one kept graph per trained node, whose b children's terms
    share it: 1 - trained nodes / trained edges (0 on a flat rollout)."""
    return 0.0 if rows is None else 1 - rows.trained_forwards / rows.trained_edges


@dataclass
class Subject:
    """One config under the bench: its trainer, the state every measured iteration starts from, its memory pass
    (one untimed iteration per schedule) and ``lean plan``'s probe and prediction, taken in the same process. Configs
    that differ only in their loop (a recipe and its on-policy form) share one trainer, its model and weights: each
    iteration sets the trainer's config first (:meth:`activate`), so no form runs on a model whose weights another
    has just pushed out of the caches."""

    cfg: RunConfig
    trainer: Trainer
    state: dict
    memory: dict = field(default_factory=dict)
    plan_input: object = None
    measured: dict = field(default_factory=dict)
    prediction: dict = field(default_factory=dict)
    auto: str = ""  # the schedule ``train.schedule=auto`` takes from that prediction
    rows: RowCounts | None = None  # a tree rollout's counts (``lean.plan.cost.tree_rows``); None: flat

    @property
    def schedules(self) -> list[str]:
        """The schedules that compute this algorithm's gradient and the run allows (:func:`compared_schedules`)."""
        return compared_schedules(self.trainer)

    @classmethod
    def build(cls, cfg: RunConfig, trainer: Trainer | None = None) -> Subject:
        trainer = trainer or Trainer(cfg)
        return cls(trainer.cfg, trainer, trainer.state.state_dict())  # the trainer's config: sample.shift resolved

    def activate(self) -> Subject:
        """Set the (possibly shared) trainer to this config: the pipeline reads it at every iteration."""
        self.trainer.cfg = self.trainer.pipeline.cfg = self.cfg
        return self

    def iteration(self, schedule: str) -> dict:
        """One timed iteration's metrics (memory is measured in its own pass)."""
        return iteration_metrics(self.activate().trainer, schedule)

    def fresh_iteration(self, schedule: str) -> dict:
        """:meth:`iteration` from this subject's own saved state (a subject with a trainer of its own)."""
        self.trainer.state.load_state_dict(self.state)
        return self.iteration(schedule)

    def memory_pass(self, log: JsonLines, label: str = "") -> None:
        """Peak memory per schedule (run under ``live_bytes_heap``, before the timed rounds grow the heap)."""
        self.activate()
        for s in self.schedules:
            self.trainer.state.load_state_dict(self.state)
            trace = MemoryTrace(self.trainer.world.device)  # the peak, and the curve through the iteration
            self.memory[s] = {**self.trainer.iteration(0, s, trace=trace).metrics, "memory_curve": trace.curve()}
            log.append({"pass": "memory", "variant": f"{label}{s}", **self.memory[s]})

    def plan(self) -> None:
        """The probe ``lean plan`` predicts from, and its prediction per schedule."""
        self.plan_input = self.activate().trainer.plan_input()
        self.measured = probe(self.plan_input)
        costs = iteration_costs(self.plan_input, self.measured)
        self.prediction, self.rows = prediction_table(costs), costs.rows
        budget = budget_mb(self.cfg, self.trainer.world.device)
        self.auto = retain_choice(choose(exact_predictions(self.cfg, costs), budget)["choice"], self.cfg)["choice"]

    def result(self, rows: dict[str, list[dict]], options: BenchOptions, cores: list[int]) -> dict:
        """Medians of the timed ``rows`` per schedule, with memory, FLOPs, MFU/HFU, the plan's errors and the
        speedups (see the module docstring)."""
        cfg, trainer, prediction = self.cfg, self.activate().trainer, self.prediction
        peak, peak_source = peak_flops(trainer.world.device, cfg.model.torch_dtype)
        result: dict = {
            "config": self.config_entry(options, cores),
            "peak_flops": peak,
            "peak_flops_source": peak_source,
            "plan": {"probe": self.measured, "prediction": prediction, "auto_choice": self.auto},
            "measured_on": machine(trainer.world.device),  # where these figures were measured (lean.observe.provenance)
        }
        for s in self.schedules:
            entry = {k: median(row.get(k, 0.0) for row in rows[s]) for k in PHASES}
            t = entry["time_iteration_s"]
            if options.flops:
                trainer.state.load_state_dict(self.state)
                flops = count_iteration_flops(trainer, s)
                entry.update(
                    {
                        "flops_per_iteration": sum(flops.values()),
                        "flops_needed_per_iteration": needed_flops(flops),
                        "flops_by_region": flops,
                        "mfu": needed_flops(flops) / (t * peak),
                        "hfu": sum(flops.values()) / (t * peak),
                    }
                )
            entry.update(
                {
                    "memory_curve": self.memory[s]["memory_curve"],  # lean.observe.memory_trace
                    "peak_memory_mb": self.memory[s]["peak_memory_mb"],
                    "peak_memory_delta_mb": self.memory[s]["peak_memory_delta_mb"],
                    "plan_peak_memory_mb": prediction[s]["peak_memory_mb"],
                    "plan_peak_memory_error": prediction[s]["peak_memory_mb"] / self.memory[s]["peak_memory_mb"] - 1,
                    "plan_time_iteration_s": prediction[s]["time_iteration_s"],
                    "plan_time_error": prediction[s]["time_iteration_s"] / t - 1,
                    "time_iteration_all_s": [row["time_iteration_s"] for row in rows[s]],
                    # decode + rewards done while the rollout went on (reward.async_scoring): the median round's.
                    # Scored after the rollout, the exposed time is the work plus its timer's overhead: nothing hidden
                    "reward_hidden_s": median(
                        max(r["time_reward_s"] - r.get("time_reward_exposed_s", 0.0), 0.0) for r in rows[s]
                    ),
                }
            )
            # the optimizer stage's peak, measured (lean.observe.memory_trace) and planned
            entry["optimizer_peak_mb"] = self.memory[s]["memory_curve"]["phases"].get("optimizer", nan)
            entry["plan_optimizer_peak_mb"] = prediction[s]["optimizer_peak_mb"]
            if s == RETAIN:  # the plan's per-step term: one tracked step's graph at one rollout micro-batch
                entry["plan_memory_slope_mb"] = self.measured["activation_mb"]
            if "reweight_buffer_mb" in rows[s][0]:
                entry["reweight_buffer_mb"] = rows[s][0]["reweight_buffer_mb"]
            # the gradients' sync (parallel.grad_sync) and what crossed processes in a round (lean.observe.comms)
            entry["grad_sync"] = rows[s][0].get("grad_sync")
            entry["time_sync_s"] = median(r.get("time_sync_s", 0.0) for r in rows[s])
            entry.update({k: v for k, v in rows[s][0].items() if k.startswith("comm_")})
            result[s] = entry
        trainer.state.load_state_dict(self.state)
        add_speedups(result, rows, {RETAIN: self.retained}, {RETAIN: self.retained * tree_backward_share(self.rows)})
        return result

    def config_entry(self, options: BenchOptions, cores: list[int]) -> dict:
        """What the result states of the measured config (a tree's: its rows too)."""
        cfg = self.cfg
        return {
            **measured_config(cfg, options),
            "cfg": cfg.sample.cfg,
            "beta": cfg.algorithm.beta,
            "samples_per_process": len(self.plan_input.batch.prompts),
            "world_size": self.trainer.world.size,
            "uncond_grad": cfg.sample.uncond_grad,
            "cores": len(cores),
            "optimizer_steps_per_iteration": cfg.train.optimizer_steps_per_iteration,
            "trained_steps_per_sample": int(self.plan_input.batch.steps.trained[0].sum()),
            **{f"retain_{key}": getattr(cfg.train.retain, key) for key in ("steps", "offload")},  # Retain's row
            # per process: node forwards, trained nodes, trained edges, leaves (lean.plan.cost.tree_rows)
            **({"rows": vars(self.rows)} if self.rows is not None else {}),
        }

    @property
    def retained(self) -> float:
        """q of Retain's row (:func:`retained_share`) on the probed batch."""
        return retained_share(self.cfg.train.retain.steps, self.plan_input.batch.steps.trained)


def measured_config(cfg: RunConfig, options: BenchOptions) -> dict:
    """What every benchmark's result states of the model, the sampler and the measurement."""
    return {
        "family": cfg.model.family,
        "size": cfg.model.size,
        "dtype": cfg.model.dtype,
        "num_steps": cfg.sample.num_steps,
        "resolution": cfg.model.resolution,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "threads": torch.get_num_threads(),
    }


def pinned(options: BenchOptions) -> list[int]:
    """Torch threads and CPU affinity as ``options`` ask, and one heap for every thread (on a CPU); the CPUs the
    process runs on."""
    set_threads(options.threads)
    if torch.cuda.is_available():
        return []
    share_main_arena()  # before any thread allocates: the scoring worker's decode then reuses warm pages
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # under a launch each process on cores of its own
    return pin_cores(options.cores, local_rank)


def measured_log(out: str | None, is_main: bool) -> JsonLines:
    """``out/measured.jsonl``: each measured iteration appended as soon as it ends, so that a run stopped by a time
    limit keeps what it measured (written by the main process only; without ``out``, nowhere)."""
    return JsonLines(Path(out) / "measured.jsonl" if out and is_main else None)


def publish(result: dict, format_table: Callable[[dict], str], out: str | None, filename: str, is_main: bool) -> None:
    """On the main process: prints ``result``'s table and writes ``result`` to ``out/filename`` (without ``out``:
    printed only)."""
    if is_main:
        print(format_table(result))
        if out:
            write_json(Path(out) / filename, result)


@keeps_process_settings
def bench_schedules(
    cfg: RunConfig, out: str | None = None, options: BenchOptions = BenchOptions(), trainer: Trainer | None = None
) -> dict:
    """Every registered schedule, measured interleaved on ``cfg`` (see the module docstring); writes
    ``out/schedules.json`` and returns it. Each measured iteration is appended to ``out/measured.jsonl`` as soon as it
    ends, so that a run stopped by a time limit keeps what it measured."""
    cores = pinned(options)
    subject = Subject.build(cfg, trainer)
    log = measured_log(out, subject.trainer.world.is_main)
    with live_bytes_heap():
        subject.memory_pass(log)
    if subject.trainer.world.device.type == "cpu":
        keep_freed_memory()  # before the probe too: its step times are then taken as the rounds' are
    subject.plan()
    # a tree: the flat rollout of as many leaves, timed in the same rounds (its own model, built after the tree's
    # memory pass and probe, which it would otherwise weigh on)
    flat = None if tree_shape(cfg.sample) is None else Subject.build(flat_form(cfg))
    variants = None
    if flat is not None:
        variants = {s: functools.partial(subject.fresh_iteration, s) for s in subject.schedules}
        variants[FLAT] = functools.partial(flat.fresh_iteration, BASELINE)
    rows = timed_rounds(subject.trainer, subject.state, options, log, variants)
    result = subject.result({s: rows[s] for s in subject.schedules}, options, cores)
    if flat is not None:
        result[FLAT] = flat_comparison(rows, subject.schedules, flat.cfg)
    publish(result, format_table, out, "schedules.json", subject.trainer.world.is_main)
    return result


FLAT = "flat"  # the result's entry for a tree's flat counterpart (:func:`flat_form`)


def flat_form(cfg: RunConfig) -> RunConfig:
    """A tree config's flat counterpart: as many trajectories as the trees have leaves, each its own (no branch
    point), the same steps, trained steps and groups, under GRPO's per-sample advantages: DanceGRPO's rollout, which
    BranchGRPO's paper compares its tree with (its Recompute is DanceGRPO's update)."""
    sample = dataclasses.replace(cfg.sample, tree=dataclasses.replace(cfg.sample.tree, branch_points=[]))
    flat = dataclasses.replace(cfg, sample=sample, algorithm=dataclasses.replace(cfg.algorithm, name="grpo"))
    validate(flat)
    return flat


def flat_comparison(rows: dict[str, list[dict]], schedules: list[str], flat_cfg: RunConfig) -> dict:
    """The flat rollout's timed iterations (:data:`FLAT`, under the baseline) against the tree's: its medians, and per
    tree schedule ``tree_speedup_<schedule>``, the median over the rounds of flat time / tree time."""
    flat = rows[FLAT]
    return {
        "algorithm": flat_cfg.algorithm.name,
        "schedule": BASELINE,
        **{k: median(r.get(k, 0.0) for r in flat) for k in PHASES},
        "time_iteration_all_s": [r["time_iteration_s"] for r in flat],
        **{
            f"tree_speedup_{s}": median(f["time_iteration_s"] / t["time_iteration_s"] for f, t in zip(flat, rows[s]))
            for s in schedules
        },
    }


FORMS = ("recipe", "on_policy")  # a recipe of several updates per rollout, and its one-step form (train.on_policy)


@keeps_process_settings
def bench_recipe(cfg: RunConfig, out: str | None = None, options: BenchOptions = BenchOptions()) -> dict:
    """A recipe with several updates per rollout (every published preset): Recompute and the exact hybrids on the
    recipe, and the three schedules on its on-policy form (``train.on_policy``: the samples per optimizer step kept,
    half of them per rollout at S = 2), all six interleaved in the same rounds, on one model (:class:`Subject`). Each
    form's schedules compare with its own Recompute against its own bound; :func:`recipe_rows` puts both per sample
    beside the recipe's Recompute.
    Writes ``out/{recipe,on_policy}/schedules.json`` and ``out/recipe.json``."""
    cores = pinned(options)
    recipe = Subject.build(cfg)
    on_policy = Subject(on_policy_form(recipe.cfg), recipe.trainer, recipe.state)  # the same model, another loop
    subjects = dict(zip(FORMS, (recipe, on_policy)))
    is_main = recipe.trainer.world.is_main
    log = measured_log(out, is_main)
    with live_bytes_heap():
        for name, subject in subjects.items():
            subject.memory_pass(log, label=f"{name}/")
    if recipe.trainer.world.device.type == "cpu":
        keep_freed_memory()
    for subject in subjects.values():
        subject.plan()
    variants = {
        f"{name}/{s}": functools.partial(subject.iteration, s) for name, subject in subjects.items() for s in SCHEDULES
    }
    rows = timed_rounds(recipe.trainer, recipe.state, options, log, variants)
    results = {
        name: subject.result({s: rows[f"{name}/{s}"] for s in SCHEDULES}, options, cores)
        for name, subject in subjects.items()
    }
    report = {**results, "table": recipe_rows(results), "measured_on": results["recipe"]["measured_on"]}
    if is_main:
        print(format_recipe_table(report))
        if out:
            for form in FORMS:
                write_json(Path(out) / form / "schedules.json", results[form])
            write_json(Path(out) / "recipe.json", report)
    return report


def recipe_rows(results: dict[str, dict]) -> list[dict]:
    """One row per (form, schedule): time per sample and its speedup against the recipe's Recompute (what a user
    buys per sample), the speedup against its own form's Recompute with that form's bound, peak memory, the plan's
    errors, and the trained steps per sample (K of the num_steps: a small K leaves little to remove)."""

    def per_sample(result: dict, s: str) -> float:
        c = result["config"]
        return result[s]["time_iteration_s"] / (c["samples_per_process"] * c["world_size"])

    baseline = per_sample(results["recipe"], BASELINE)
    rows = []
    for form in FORMS:
        result = results[form]
        c = result["config"]
        for s in SCHEDULES:
            e = result[s]
            rows.append(
                {
                    "form": form,
                    "schedule": s,
                    "updates_per_rollout": c["optimizer_steps_per_iteration"],
                    "trained_steps": f"{c['trained_steps_per_sample']}/{c['num_steps']}",
                    "taken_by_auto": s == result["plan"]["auto_choice"],  # what train.schedule=auto takes on this form
                    "time_per_sample_s": per_sample(result, s),
                    "speedup_vs_recipe_recompute": baseline / per_sample(result, s),
                    "speedup": e.get("speedup", 1.0),
                    "speedup_bound": e.get("speedup_bound"),
                    "speedup_vs_bound": e.get("speedup_vs_bound"),
                    "cpu_speedup": e.get("cpu_speedup", 1.0),
                    "peak_memory_mb": e["peak_memory_mb"],
                    "plan_time_error": e["plan_time_error"],
                    "plan_peak_memory_error": e["plan_peak_memory_error"],
                }
            )
    return rows


def iteration_metrics(trainer: Trainer, schedule: str) -> dict:
    """One timed iteration's metrics (memory is measured in its own pass)."""
    return trainer.iteration(0, schedule, measure_memory=False).metrics


def compared_schedules(trainer: Trainer) -> list[str]:
    """The schedules that compute the algorithm's gradient (:func:`algorithm_schedules`) and that the run's processes
    and ``parallel.grad_sync`` allow (:func:`run_problem`: not Reweight syncing every backward, App. C)."""
    cfg, world = trainer.cfg, trainer.world.size
    return [s for s in algorithm_schedules(cfg) if run_problem(cfg, s, world) is None]


def timed_rounds(
    trainer: Trainer,
    state: dict,
    options: BenchOptions,
    log: JsonLines,
    variants: dict[str, Callable[[], dict]] | None = None,
) -> dict[str, list[dict]]:
    """Per variant (default: each schedule's iteration), the metrics of its timed iterations: every round runs each
    variant once from ``state``, in alternating order (A B C, C B A, ...: a drifting machine speed cancels); warm-up
    rounds are dropped."""
    if variants is None:
        variants = {s: functools.partial(iteration_metrics, trainer, s) for s in compared_schedules(trainer)}
    names = list(variants)
    rows: dict[str, list[dict]] = {s: [] for s in names}
    for r in tqdm(range(options.warmup + options.repeats), desc="bench rounds", disable=not trainer.world.is_main):
        for s in names[:: 1 if r % 2 == 0 else -1]:
            trainer.state.load_state_dict(state)
            metrics = variants[s]()
            log.append({"pass": "warm-up" if r < options.warmup else "timed", "round": r, "variant": s, **metrics})
            if r >= options.warmup:
                rows[s].append(metrics)
    return rows


def add_speedups(
    result: dict,
    rows: dict[str, list[dict]],
    removed: dict[str, float] | None = None,
    removed_backward: dict[str, float] | None = None,
) -> None:
    """Each Lean schedule's speedup over the baseline, the analytic bound, and the ratio of the two: medians over the
    rounds of each round's ratio (the two iterations of a round ran next to each other, so a machine whose speed
    drifts between rounds moves both), in wall and in CPU time. ``removed``: per schedule, the share q of the
    recompute forward it removes (default 1; Retain's under partial retention, :func:`retained_share`);
    ``removed_backward``: the share of the update backward it does not run (default 0; Retain's on a tree,
    :func:`tree_backward_share`)."""
    base = rows[BASELINE]
    for s in (s for s in LEAN_SCHEDULES if s in rows):
        q, w = (removed or {}).get(s, 1.0), (removed_backward or {}).get(s, 0.0)
        bounds = [
            speedup_bound(
                r["time_iteration_s"], r.get("time_recompute_forward_s", 0.0), q, w * r.get("time_backward_s", 0.0)
            )
            for r in base
        ]
        pairs = list(zip(base, rows[s]))
        speedups = [b["time_iteration_s"] / r["time_iteration_s"] for b, r in pairs]
        result[s]["removed_share"] = q
        if w:
            result[s]["removed_backward_share"] = w
        result[s]["speedup"] = median(speedups)
        result[s]["speedup_bound"] = median(bounds)
        result[s]["speedup_vs_bound"] = median(x / bound for x, bound in zip(speedups, bounds))
        result[s]["cpu_speedup"] = median(b["cpu_iteration_s"] / r["cpu_iteration_s"] for b, r in pairs)


def flat_metrics(result: dict) -> dict[str, float]:
    """The numbers a comparison needs, one flat key each (the bench_schedules stage's metrics.json)."""
    out = {}
    for s in (s for s in SCHEDULES if s in result):
        e = result[s]
        out.update(
            {
                f"mfu_{s}": e["mfu"],
                f"hfu_{s}": e["hfu"],
                f"peak_memory_mb_{s}": e["peak_memory_mb"],
                f"time_iteration_s_{s}": e["time_iteration_s"],
                f"plan_time_error_{s}": e["plan_time_error"],
                f"reward_hidden_s_{s}": e["reward_hidden_s"],
            }
        )
        if "speedup" in e:
            out.update({f"speedup_{s}": e["speedup"], f"speedup_bound_{s}": e["speedup_bound"]})
    if FLAT in result:  # a tree: its flat counterpart's iteration, and the tree's speedup over it per schedule
        out[f"time_iteration_s_{FLAT}"] = result[FLAT]["time_iteration_s"]
        out.update({k: v for k, v in result[FLAT].items() if k.startswith("tree_speedup_")})
    return out


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"lean bench schedules: {c['family']}/{c['size']} {c.get('resolution', '?')} px {c['dtype']}, "
        f"{c['num_steps']} steps, cfg={c['cfg']}, uncond_grad={c.get('uncond_grad')}, beta={c['beta']}, "
        f"{c['samples_per_process']} samples/process x {c['world_size']} process(es) x {c.get('threads', '?')} "
        f"thread(s), median of {c['repeats']} (peak {result['peak_flops'] / 1e9:.1f} GFLOP/s, "
        f"{result['peak_flops_source']}){retain_note(result)}",
        f"{'schedule':10} {'iter s':>8} {'plan s':>7} {'rollout s':>10} {'reward s':>9} {'hidden s':>9} "
        f"{'update s':>9} "
        f"{'peak MiB':>9} {'plan MiB':>9} "
        f"{'GFLOP':>8} {'MFU':>6} {'HFU':>6} {'speedup':>8} {'bound':>6} {'of bound':>9}",
    ]
    for s in (s for s in SCHEDULES if s in result):
        e = result[s]
        extra = (
            f"{e['speedup']:8.3f} {e['speedup_bound']:6.3f} {e['speedup_vs_bound']:9.3f}"
            if "speedup" in e
            else f"{'1.000':>8} {'':6} {'':9}"
        )
        lines.append(
            f"{s:10} {e['time_iteration_s']:8.3f} {e['plan_time_iteration_s']:7.2f} {e['time_rollout_s']:10.3f} "
            f"{e['time_reward_s']:9.3f} {e['reward_hidden_s']:9.3f} {e['time_update_s']:9.3f} "
            f"{e['peak_memory_mb']:9.1f} {e['plan_peak_memory_mb']:9.1f} "
            f"{e.get('flops_per_iteration', nan) / 1e9:8.2f} {e.get('mfu', nan):6.3f} {e.get('hfu', nan):6.3f} {extra}"
        )
    if FLAT in result:
        lines.append(flat_line(result))
    return "\n".join(lines)


def flat_line(result: dict) -> str:
    """A tree's counts and its iteration against the flat rollout of as many leaves (:func:`flat_comparison`)."""
    r, flat = result["config"]["rows"], result[FLAT]
    speedups = ", ".join(f"{s} {flat[f'tree_speedup_{s}']:.3f}x" for s in SCHEDULES if f"tree_speedup_{s}" in flat)
    return (
        f"tree: {r['forwards']} node forwards, {r['trained_forwards']} trained nodes, {r['trained_edges']} trained "
        f"edges for {r['leaves']} leaves; the flat {flat['algorithm']} rollout of {r['leaves']} samples under "
        f"{flat['schedule']}: {flat['time_iteration_s']:.3f} s per iteration; the tree is faster by {speedups}"
    )


def retain_note(result: dict) -> str:
    """Retain's row under partial retention or offload (``train.retain``), in words; empty at its defaults."""
    c = result["config"]
    steps, offload = c.get("retain_steps", ALL_STEPS), c.get("retain_offload", DEVICE)
    if steps == ALL_STEPS and offload == DEVICE:
        return ""
    kept = "every" if steps == ALL_STEPS else f"the last {steps}"
    share = result.get(RETAIN, {}).get("removed_share", 1.0)
    return f"; retain keeps {kept} of {c['trained_steps_per_sample']} trained steps (q {share:.3f}), offload {offload}"


def recipe_metrics(report: dict) -> dict[str, float]:
    """The per-sample table of :func:`bench_recipe`, one flat key each (``<figure>_<form>_<schedule>``)."""
    out = {}
    for row in report["table"]:
        tag = f"{row['form']}_{row['schedule']}"
        for key in ("time_per_sample_s", "speedup_vs_recipe_recompute", "speedup", "cpu_speedup", "peak_memory_mb"):
            out[f"{key}_{tag}"] = row[key]
        if row["speedup_bound"] is not None:
            out[f"speedup_bound_{tag}"], out[f"speedup_vs_bound_{tag}"] = row["speedup_bound"], row["speedup_vs_bound"]
        if row["taken_by_auto"]:
            out[f"speedup_{row['form']}_auto"] = row["speedup"]
    return out


def format_recipe_table(report: dict) -> str:
    c = report["recipe"]["config"]
    lines = [
        f"lean bench schedules, recipe and on-policy form: {c['family']}/{c['size']} {c['resolution']} px "
        f"{c['dtype']}, {c['trained_steps_per_sample']} of {c['num_steps']} steps trained, "
        f"{c['optimizer_steps_per_iteration']} updates per rollout, {c['cores']} core(s), median of {c['repeats']} "
        "(*: what train.schedule=auto takes)",
        f"{'form':10} {'schedule':11} {'s/sample':>9} {'vs recipe':>10} {'speedup':>8} {'bound':>6} {'of bound':>9} "
        f"{'cpu':>6} {'peak MiB':>9} {'plan t':>7} {'plan mem':>9}",
    ]
    for r in report["table"]:
        bound = "" if r["speedup_bound"] is None else f"{r['speedup_bound']:6.3f} {r['speedup_vs_bound']:9.3f}"
        lines.append(
            f"{r['form']:10} {r['schedule'] + (' *' if r['taken_by_auto'] else ''):11} {r['time_per_sample_s']:9.3f} "
            f"{r['speedup_vs_recipe_recompute']:10.3f} "
            f"{r['speedup']:8.3f} {bound or ' ' * 16:>16} {r['cpu_speedup']:6.3f} {r['peak_memory_mb']:9.1f} "
            f"{r['plan_time_error']:+7.2f} {r['plan_peak_memory_error']:+9.2f}"
        )
    return "\n".join(lines)
