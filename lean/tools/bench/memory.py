"""``lean bench memory``: peak memory and time of every schedule in every layout (``lean.parallel.layout``), with
activation checkpointing (``model.gradient_checkpointing``) off and on, measured in one process and interleaved as in
``lean bench schedules``.

Each variant (schedule, layout, checkpointing) runs one untimed iteration from a trimmed heap for its peak (live
bytes, ``lean.observe.metrics.PeakMemory``), then every variant runs in timed rounds, in alternating order, from the
same weights. Reported per variant, beside ``lean plan``'s predictions of the same:

    extra       = peak(schedule) - peak(recompute)              what the schedule holds beyond the baseline, in the
                                                                same layout and checkpointing
    held ratio  = extra(group layout) / extra(slice layout)     Retain: ~ one group / the groups a process holds
    speedup     = T(recompute) / T(schedule),  bound = T(recompute) / (T(recompute) - recompute forward), both in the
                  same layout and checkpointing (``lean.tools.bench.schedules``)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from lean.config import RunConfig
from lean.observe.metrics import keep_freed_memory, live_bytes_heap, median
from lean.observe.outputs import JsonLines, write_json
from lean.parallel.distributed import set_threads
from lean.parallel.sharding import FSDP, effective_shard, shard_sizes
from lean.plan.cost import (
    applicable_layouts,
    combinations,
    link_speed,
    probe_checkpointing,
    shard_probes,
    with_schedule,
)
from lean.schedules import BASELINE, LEAN_SCHEDULES, SCHEDULES, fsdp_problem
from lean.tools.bench.schedules import BenchOptions, timed_rounds
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


def bench_memory(
    cfg: RunConfig, out: str | None = None, options: BenchOptions = BenchOptions(), trainer: Trainer | None = None
) -> dict:
    """Measure every variant (see the module docstring); writes ``out/memory.json`` and returns it."""
    set_threads(options.threads)
    trainer = trainer or Trainer(cfg)
    own = trainer.pipeline.cfg
    log = JsonLines(Path(out) / "measured.jsonl" if out and trainer.world.is_main else None)
    state = trainer.state.state_dict()
    inp = trainer.plan_input()
    shard = effective_shard(cfg.parallel.shard, trainer.world.size)  # what runs: the measured rows
    variants = [
        (s, lay, ck)
        for lay in applicable_layouts(inp)
        for ck in CHECKPOINTING
        for s in SCHEDULES
        if shard != FSDP or not fsdp_problem(with_schedule(cfg, s))
    ]

    def run(schedule: str, layout: str, checkpointing: bool, measure_memory: bool) -> dict:
        configure(trainer, layout, checkpointing)
        return trainer.iteration(0, schedule, measure_memory=measure_memory).metrics

    memory = {}
    with live_bytes_heap():
        for v in variants:
            trainer.state.load_state_dict(state)
            memory[v] = run(*v, measure_memory=True)
            log.append({"pass": "memory", "variant": variant_name(*v), **memory[v]})
    if trainer.world.device.type == "cpu":
        keep_freed_memory()
    link = link_speed(trainer.world, shard_sizes(inp.policy).unit)
    predicted = {
        (r["schedule"], r["layout"], r["gradient_checkpointing"]): r
        for r in combinations(inp, shard_probes(inp, probe_checkpointing(inp), link))
        if r["shard"] == shard
    }
    resident = trainer.state.resident_mb(trainer.policy)  # after the memory pass: AdamW's moments exist
    calls = {variant_name(*v): (lambda v=v: run(*v, measure_memory=False)) for v in variants}
    rows = timed_rounds(trainer, state, options, log, calls)
    trainer.pipeline.cfg = own
    trainer.policy.set_gradient_checkpointing(own.model.gradient_checkpointing)
    trainer.state.load_state_dict(state)

    entries = []
    for v in variants:
        timed = rows[variant_name(*v)]
        entries.append(
            {
                "schedule": v[0],
                "layout": v[1],
                "gradient_checkpointing": v[2],
                "peak_memory_mb": memory[v]["peak_memory_mb"],
                "time_iteration_s": median(r["time_iteration_s"] for r in timed),
                "time_recompute_forward_s": median(r.get("time_recompute_forward_s", 0.0) for r in timed),
                "plan_peak_memory_mb": predicted[v]["peak_memory_mb"],
                "plan_time_iteration_s": predicted[v]["time_iteration_s"],
            }
        )
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
    for s in LEAN_SCHEDULES:  # what the schedule holds beyond Recompute: group layout / slice layout
        extra = {
            (e["layout"], e["gradient_checkpointing"]): e["extra_memory_mb"] for e in entries if e["schedule"] == s
        }
        if extra.get(("slice", False), 0) > 0 and ("group", False) in extra:
            result[f"held_ratio_{s}"] = extra["group", False] / extra["slice", False]
    if trainer.world.is_main:
        print(format_table(result))
        if out:
            write_json(Path(out) / "memory.json", result)
    return result


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
        if f"held_ratio_{s}" in result:
            lines.append(f"{s}: memory above Recompute's, group / slice layout: {result[f'held_ratio_{s}']:.3f}")
    return "\n".join(lines)
