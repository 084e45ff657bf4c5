"""``lean bench memory``: peak memory and time of every schedule in every layout (``lean.parallel.layout``), with
activation checkpointing (``model.gradient_checkpointing``) off and on, measured in one process and interleaved as in
``lean bench schedules``.

Each variant (schedule, layout, checkpointing) runs one untimed iteration from a trimmed heap for its peak (live
bytes, ``lean.observe.metrics.PeakMemory``), then every variant runs in timed rounds, in alternating order, from the
same weights. Reported per variant, beside ``lean plan``'s predictions of the same:

    extra       = peak(schedule) - peak(recompute)              what the schedule holds beyond the baseline, in the
                                                                same layout and checkpointing
    held ratio  = extra(group layout) / extra(slice layout)     Retain: ~ one group / the groups a process holds
    shared ratio = extra(shared layout) / extra(group layout)   Retain: ~ Q = G / W samples / one group of G
    speedup     = T(recompute) / T(schedule),  bound = T(recompute) / (T(recompute) - recompute forward), both in the
                  same layout and checkpointing (``lean.tools.bench.schedules``)
"""

from __future__ import annotations

import dataclasses

import torch

from lean.config import ConfigError, RunConfig
from lean.observe.metrics import keep_freed_memory, live_bytes_heap, median, share_main_arena
from lean.observe.outputs import JsonLines
from lean.parallel.distributed import keeps_process_settings, set_threads
from lean.parallel.sharding import planned_shard, shard_sizes
from lean.plan.cost import (
    applicable_layouts,
    combinations,
    is_own_retain,
    link_speed,
    probe_checkpointing,
    shard_probes,
)
from lean.schedules import BASELINE, LEAN_SCHEDULES, SCHEDULES, run_problem
from lean.tools.bench.schedules import BenchOptions, measured_log, publish, timed_rounds
from lean.train import Trainer

CHECKPOINTING = (False, True)


def configure(trainer: Trainer, layout: str, checkpointing: bool) -> None:
    """Switch ``trainer`` to ``layout`` and checkpointing (both are read per iteration: nothing is rebuilt)."""
    cfg = trainer.pipeline.cfg
    trainer.pipeline.cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, layout=layout),
        model=dataclasses.replace(cfg.model, gradient_checkpointing=checkpointing),
    )
    trainer.policy.set_gradient_checkpointing(checkpointing)


def variant_name(schedule: str, layout: str, checkpointing: bool) -> str:
    return f"{schedule}/{layout}/{'ckpt' if checkpointing else 'no-ckpt'}"


Variant = tuple[str, str, bool]  # (schedule, layout, activation checkpointing)


@keeps_process_settings
def bench_memory(
    cfg: RunConfig,
    out: str | None = None,
    options: BenchOptions = BenchOptions(),
    trainer: Trainer | None = None,
    layouts: list[str] | None = None,
) -> dict:
    """Measure every variant (see the module docstring) in ``layouts`` (None: every applicable one); writes
    ``out/memory.json`` and returns it."""
    set_threads(options.threads)
    if not torch.cuda.is_available():
        share_main_arena()  # before any thread allocates (lean.observe.metrics)
    trainer = trainer or Trainer(cfg)
    own = trainer.pipeline.cfg
    log = measured_log(out, trainer.world.is_main)
    state = trainer.state.state_dict()
    inp = trainer.plan_input()
    shard = planned_shard(cfg.parallel.shard, trainer.world.size)  # what runs (hsdp: as fsdp): the measured rows
    applicable = applicable_layouts(inp)
    if unknown := [lay for lay in layouts or [] if lay not in applicable]:
        raise ConfigError("--layouts", ",".join(layouts), f"{unknown[0]} does not apply; these do: {applicable}")
    variants = [
        (s, lay, ck)
        for lay in layouts or applicable
        for ck in CHECKPOINTING
        for s in SCHEDULES
        if run_problem(cfg, s, trainer.world.size) is None
    ]
    memory = memory_pass(trainer, state, variants, log)
    if trainer.world.device.type == "cpu":
        keep_freed_memory()
    predicted = planned(trainer, inp, shard)
    resident = trainer.state.resident_mb(trainer.policy)  # after the memory pass: AdamW's moments exist
    calls = {variant_name(*v): (lambda v=v: run_variant(trainer, v, measure_memory=False)) for v in variants}
    rows = timed_rounds(trainer, state, options, log, calls)
    trainer.pipeline.cfg = own
    trainer.policy.set_gradient_checkpointing(own.model.gradient_checkpointing)
    trainer.state.load_state_dict(state)
    entries = [variant_entry(v, memory[v], rows[variant_name(*v)], predicted[v]) for v in variants]
    result = {
        "config": {
            "family": cfg.model.family,
            "size": cfg.model.size,
            "resolution": cfg.model.resolution,
            "dtype": cfg.model.dtype,
            "samples_per_process": len(inp.batch.prompts),
            "group_size": cfg.train.group_size,
            "rollout_batch_size": cfg.train.rollout_batch_size,
            "world_size": trainer.world.size,
            "shard": shard,
            "full_finetune": cfg.model.full_finetune,
            "resident_mb": resident,
            "repeats": options.repeats,
            "threads": torch.get_num_threads(),
        },
        "variants": add_relative(entries),
    }
    result.update(held_ratios(entries))
    publish(result, format_table, out, "memory.json", trainer.world.is_main)
    return result


def run_variant(trainer: Trainer, variant: Variant, measure_memory: bool) -> dict:
    """One iteration of ``variant``'s schedule in its layout and checkpointing; its metrics."""
    schedule, layout, checkpointing = variant
    configure(trainer, layout, checkpointing)
    return trainer.iteration(0, schedule, measure_memory=measure_memory).metrics


def memory_pass(trainer: Trainer, state: dict, variants: list[Variant], log: JsonLines) -> dict[Variant, dict]:
    """Each variant's untimed iteration from ``state`` for its peak (under ``live_bytes_heap``)."""
    memory = {}
    with live_bytes_heap():
        for v in variants:
            trainer.state.load_state_dict(state)
            memory[v] = run_variant(trainer, v, measure_memory=True)
            log.append({"pass": "memory", "variant": variant_name(*v), **memory[v]})
    return memory


def planned(trainer: Trainer, inp, shard: str) -> dict[Variant, dict]:
    """``lean plan``'s row of every variant at ``shard``, from a probe taken in this process."""
    link = link_speed(trainer.world, shard_sizes(inp.policy).unit)
    return {
        (r["schedule"], r["layout"], r["gradient_checkpointing"]): r
        for r in combinations(inp, shard_probes(inp, probe_checkpointing(inp), link))
        if r["shard"] == shard and is_own_retain(r, inp.cfg)  # Retain as the run keeps its graphs
    }


def variant_entry(variant: Variant, memory: dict, timed: list[dict], predicted: dict) -> dict:
    """One variant's measured peak and median times beside the plan's prediction of them."""
    return {
        "schedule": variant[0],
        "layout": variant[1],
        "gradient_checkpointing": variant[2],
        "peak_memory_mb": memory["peak_memory_mb"],
        "time_iteration_s": median(r["time_iteration_s"] for r in timed),
        "time_recompute_forward_s": median(r.get("time_recompute_forward_s", 0.0) for r in timed),
        "plan_peak_memory_mb": predicted["peak_memory_mb"],
        "plan_time_iteration_s": predicted["time_iteration_s"],
        **({"reweight_buffer_mb": memory["reweight_buffer_mb"]} if "reweight_buffer_mb" in memory else {}),
    }


HELD_RATIOS = {"held_ratio": ("group", "slice"), "shared_ratio": ("shared", "group")}  # (numerator, denominator)


def held_ratios(entries: list[dict]) -> dict[str, float]:
    """What the schedule holds beyond Recompute in one layout over another (no checkpointing), where both were
    measured and the second holds more than Recompute: ``held_ratio_<schedule>`` group / slice (one group of the
    groups a process holds), ``shared_ratio_<schedule>`` shared / group (LeanGRPO's Q samples of G)."""
    ratios = {}
    for s in LEAN_SCHEDULES:
        extra = {
            (e["layout"], e["gradient_checkpointing"]): e["extra_memory_mb"] for e in entries if e["schedule"] == s
        }
        for name, (num, den) in HELD_RATIOS.items():
            if extra.get((den, False), 0) > 0 and (num, False) in extra:
                ratios[f"{name}_{s}"] = extra[num, False] / extra[den, False]
    return ratios


def add_relative(entries: list[dict]) -> list[dict]:
    """Each entry's memory above, speedup over and bound from Recompute's entry in the same layout and checkpointing."""
    baseline = {(e["layout"], e["gradient_checkpointing"]): e for e in entries if e["schedule"] == BASELINE}
    for e in entries:
        rc = baseline[e["layout"], e["gradient_checkpointing"]]
        e["extra_memory_mb"] = e["peak_memory_mb"] - rc["peak_memory_mb"]
        e["speedup"] = rc["time_iteration_s"] / e["time_iteration_s"]
        e["speedup_bound"] = rc["time_iteration_s"] / (rc["time_iteration_s"] - rc["time_recompute_forward_s"])
        e["speedup_vs_bound"] = e["speedup"] / e["speedup_bound"]
    return entries


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"lean bench memory: {c['family']}/{c['size']} {c['resolution']} px {c['dtype']}, {c['samples_per_process']} "
        f"samples/process in groups of {c['group_size']}, rollout micro-batch {c['rollout_batch_size']}, "
        f"{c['world_size']} process(es) x {c['threads']} thread(s), shard {c['shard']}, "
        f"{'full fine-tune' if c['full_finetune'] else 'LoRA'} ({c['resident_mb']:.1f} MiB of weights, gradients, "
        f"moments and EMA per process), median of {c['repeats']}",
        f"{'schedule':10} {'layout':7} {'ckpt':>5} {'peak MiB':>9} {'extra MiB':>10} {'plan MiB':>9} {'iter s':>8} "
        f"{'plan s':>7} {'speedup':>8} {'of bound':>9}",
    ]
    for e in result["variants"]:
        relative = f"{e['speedup']:8.3f} {e['speedup_vs_bound']:9.3f}" if e["schedule"] != BASELINE else f"{'':18}"
        lines.append(
            f"{e['schedule']:10} {e['layout']:7} {'on' if e['gradient_checkpointing'] else 'off':>5} "
            f"{e['peak_memory_mb']:9.1f} {e['extra_memory_mb']:10.1f} {e['plan_peak_memory_mb']:9.1f} "
            f"{e['time_iteration_s']:8.3f} {e['plan_time_iteration_s']:7.2f} {relative}"
        )
    for s in LEAN_SCHEDULES:
        for name, (num, den) in HELD_RATIOS.items():
            if f"{name}_{s}" in result:
                lines.append(f"{s}: memory above Recompute's, {num} / {den} layout: {result[f'{name}_{s}']:.3f}")
    buffers = {e["layout"]: e["reweight_buffer_mb"] for e in result["variants"] if "reweight_buffer_mb" in e}
    if buffers:  # checkpointing off and on hold the same buffers
        lines.append("Reweight's buffers (MiB): " + ", ".join(f"{k} {v:.3f}" for k, v in buffers.items()))
    return "\n".join(lines)
