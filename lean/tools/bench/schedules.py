"""``lean bench schedules``: every registered schedule (Recompute vs Retain vs Reweight) on one config, measured in
one process, interleaved.

Every round runs the three schedules one after another, in alternating order (A B C, C B A, ...: a machine whose speed
drifts slowly favours no schedule), from the same saved weights and optimizer state, so they do identical work on
identical trajectories; the first ``warmup`` rounds are discarded and medians are taken over ``repeats`` rounds.
Peak memory comes from one extra, untimed iteration per schedule before the timed rounds (``lean.metrics.PeakMemory``:
trimmed heap, reset high-water mark), FLOPs from another under ``FlopCounterMode``: both disturb timing. On CPU the
heap maps every large block on its own during the memory pass (``live_bytes_heap``), so that the resident set counts
live tensor bytes as ``max_memory_allocated`` does on GPU, and keeps freed pages during the timed rounds
(``keep_freed_memory``), as the CUDA caching allocator does.

    speedup        = median T_iter(recompute) / median T_iter(schedule)
    speedup_bound  = (rollout + recompute_forward + backward) / (rollout + backward), from Recompute's phases in this
                     run, where "rollout" is the whole rollout phase of GRPO (sampling, decode, rewards, advantages,
                     and the optimizer step: everything that is neither the recompute forward nor the backward), i.e.
                     T_iter / (T_iter - recompute_forward): the speedup if removing the recompute forward were free
    MFU            = FLOPs the algorithm needs (rollout, reference and decode forwards + backwards; no recompute)
                     / (T_iter x peak FLOP/s)
    HFU            = FLOPs executed / (T_iter x peak FLOP/s)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lean.config import ConfigError, RunConfig, read_params
from lean.configure import load_config
from lean.distributed import set_threads
from lean.metrics import keep_freed_memory, live_bytes_heap, median, peak_flops
from lean.outputs import JsonLines, write_json
from lean.plan import iteration_costs, prediction_table, probe
from lean.provenance import machine
from lean.schedules import BASELINE, LEAN_SCHEDULES, SCHEDULES
from lean.train import Trainer, count_iteration_flops, needed_flops

PHASES = (
    "time_iteration_s",
    "time_rollout_s",
    "time_update_s",
    "time_backward_s",
    "time_recompute_forward_s",
    "time_reward_s",
    "time_reward_exposed_s",
    "time_advantage_s",
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


def bench_config(
    params: str | os.PathLike | None, overrides: list[str] = (), preset: str | None = None, **options
) -> tuple[RunConfig, BenchOptions]:
    """The benchmark's config: the run sections, the preset, then the ``bench`` section's ``run:`` mapping (the
    benchmark's default config: a model size at which CPU time goes to arithmetic, not per-op overhead), then
    ``overrides``; ``options`` that are not None replace the section's repeats / warmup / threads."""
    has_params = params is not None and Path(params).exists()
    section = (read_params(params).get("bench") or {}) if has_params else {}
    cfg = load_config(params if has_params else None, overrides, preset=preset, stage="bench" if has_params else None)
    chosen = {k: (f"bench.{k}", section[k]) for k in ("repeats", "warmup", "threads") if k in section}
    chosen.update({k: (f"--{k}", v) for k, v in options.items() if v is not None})  # the command line wins
    for key, low in (("repeats", 1), ("warmup", 0), ("threads", 0)):
        name, value = chosen.get(key, (key, getattr(BenchOptions, key)))
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(name, value, f"must be an integer >= {low}")
    return cfg, BenchOptions(**{k: v for k, (_, v) in chosen.items()})


def bench_schedules(
    cfg: RunConfig, out: str | None = None, options: BenchOptions = BenchOptions(), trainer: Trainer | None = None
) -> dict:
    """Every registered schedule, measured interleaved on ``cfg`` (see the module docstring); writes
    ``out/schedules.json`` and returns it. Each measured iteration is appended to ``out/measured.jsonl`` as soon as it
    ends, so that a run stopped by a time limit keeps what it measured."""
    set_threads(options.threads)
    trainer = trainer or Trainer(cfg)
    log = JsonLines(Path(out) / "measured.jsonl" if out and trainer.world.is_main else None)
    state = trainer.state.state_dict()
    # Memory first, before the timed rounds grow the heap: one untimed iteration per schedule, each from a trimmed
    # heap that follows live bytes; then the probe `lean plan` predicts from, in the same process.
    memory = {}
    with live_bytes_heap():
        for s in SCHEDULES:
            trainer.state.load_state_dict(state)
            memory[s] = trainer.iteration(0, s).metrics
            log.append({"pass": "memory", **memory[s]})
    if trainer.world.device.type == "cpu":
        keep_freed_memory()  # before the probe too: its step times are then taken as the rounds' are
    plan_input = trainer.plan_input()
    measured = probe(plan_input)
    prediction = prediction_table(iteration_costs(plan_input, measured))
    rows = timed_rounds(trainer, state, options, log)
    peak, peak_source = peak_flops(trainer.world.device, cfg.model.torch_dtype)

    result: dict = {
        "config": {
            "family": cfg.model.family,
            "size": cfg.model.size,
            "dtype": cfg.model.dtype,
            "num_steps": cfg.sample.num_steps,
            "cfg": cfg.sample.cfg,
            "beta": cfg.algorithm.beta,
            "samples_per_process": len(plan_input.batch.prompts),
            "world_size": trainer.world.size,
            "repeats": options.repeats,
            "warmup": options.warmup,
            "resolution": cfg.model.resolution,
            "uncond_grad": cfg.sample.uncond_grad,
            "threads": torch.get_num_threads(),
        },
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "plan": {"probe": measured, "prediction": prediction},
        "measured_on": machine(trainer.world.device),  # where these figures were measured (lean.provenance)
    }
    for s in SCHEDULES:
        trainer.state.load_state_dict(state)
        flops = count_iteration_flops(trainer, s)
        entry = {k: median(row.get(k, 0.0) for row in rows[s]) for k in PHASES}
        t = entry["time_iteration_s"]
        entry.update(
            {
                "peak_memory_mb": memory[s]["peak_memory_mb"],
                "peak_memory_delta_mb": memory[s]["peak_memory_delta_mb"],
                "plan_peak_memory_mb": prediction[s]["peak_memory_mb"],
                "plan_peak_memory_error": prediction[s]["peak_memory_mb"] / memory[s]["peak_memory_mb"] - 1,
                "plan_time_iteration_s": prediction[s]["time_iteration_s"],
                "plan_time_error": prediction[s]["time_iteration_s"] / t - 1,
                "flops_per_iteration": sum(flops.values()),
                "flops_needed_per_iteration": needed_flops(flops),
                "flops_by_region": flops,
                "mfu": needed_flops(flops) / (t * peak),
                "hfu": sum(flops.values()) / (t * peak),
                "time_iteration_all_s": [row["time_iteration_s"] for row in rows[s]],
                # decode + rewards done while the rollout went on (reward.async_scoring): the median round's. Scored
                # after the rollout, the exposed time is the work plus its timer's overhead: nothing hidden (0)
                "reward_hidden_s": median(
                    max(r["time_reward_s"] - r.get("time_reward_exposed_s", 0.0), 0.0) for r in rows[s]
                ),
            }
        )
        if "reweight_buffer_mb" in rows[s][0]:
            entry["reweight_buffer_mb"] = rows[s][0]["reweight_buffer_mb"]
        result[s] = entry
    trainer.state.load_state_dict(state)
    add_speedups(result)
    if trainer.world.is_main:
        print(format_table(result))
        if out:
            write_json(Path(out) / "schedules.json", result)
    return result


def iteration_metrics(trainer: Trainer, schedule: str) -> dict:
    """One timed iteration's metrics (memory is measured in its own pass)."""
    return trainer.iteration(0, schedule, measure_memory=False).metrics


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
        variants = {s: functools.partial(iteration_metrics, trainer, s) for s in SCHEDULES}
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


def add_speedups(result: dict) -> None:
    """Each Lean schedule's speedup over the baseline, the analytic bound, and the ratio of the two."""
    rc = result[BASELINE]
    bound = rc["time_iteration_s"] / (rc["time_iteration_s"] - rc["time_recompute_forward_s"])
    for s in LEAN_SCHEDULES:
        result[s]["speedup"] = rc["time_iteration_s"] / result[s]["time_iteration_s"]
        result[s]["speedup_bound"] = bound
        result[s]["speedup_vs_bound"] = result[s]["speedup"] / bound


def flat_metrics(result: dict) -> dict[str, float]:
    """The numbers a comparison needs, one flat key each (the bench_schedules stage's metrics.json)."""
    out = {}
    for s in SCHEDULES:
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
    return out


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"lean bench schedules: {c['family']}/{c['size']} {c.get('resolution', '?')} px {c['dtype']}, "
        f"{c['num_steps']} steps, cfg={c['cfg']}, uncond_grad={c.get('uncond_grad')}, beta={c['beta']}, "
        f"{c['samples_per_process']} samples/process x {c['world_size']} process(es) x {c.get('threads', '?')} "
        f"thread(s), median of {c['repeats']} (peak {result['peak_flops'] / 1e9:.1f} GFLOP/s, "
        f"{result['peak_flops_source']})",
        f"{'schedule':10} {'iter s':>8} {'plan s':>7} {'rollout s':>10} {'reward s':>9} {'hidden s':>9} "
        f"{'update s':>9} "
        f"{'peak MiB':>9} {'plan MiB':>9} "
        f"{'GFLOP':>8} {'MFU':>6} {'HFU':>6} {'speedup':>8} {'bound':>6} {'of bound':>9}",
    ]
    for s in SCHEDULES:
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
            f"{e['flops_per_iteration'] / 1e9:8.2f} {e['mfu']:6.3f} {e['hfu']:6.3f} {extra}"
        )
    return "\n".join(lines)
