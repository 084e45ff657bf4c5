"""``lean bench ablation``: LeanGRPO's Table 1 (arXiv 2609.03528, Sec. 5.4) on the launching processes, to say which
part of a speedup is the layout, which the coalesced sync and which the removed recompute.

Each row is one (schedule, ``parallel.layout``, ``parallel.grad_sync``) of the same config, measured on the same
processes, interleaved in the same rounds, each from the same weights:

    row               schedule   layout  sync           what it adds
    native            recompute  group   per_backward   DanceGRPO's and FlowGRPO's run: each rank its own prompts, the
                                                        gradient synchronised after every backward (FSDP2's reduce-
                                                        scatter, or DDP's all-reduce)
    shared            recompute  shared  per_backward   the samples of each prompt across the ranks (Sec. 4.1)
    shared_coalesced  recompute  shared  per_update     one sync per update, of the accumulated gradient
    retain            retain     shared  per_backward   no recompute (the paper's Retain keeps the per-backward sync)
    reweight          reweight   shared  per_update     no recompute, and the one sync it needs (App. C)

Where the group layout cannot hold the config (the groups do not divide over the ranks), ``native`` runs the slice
layout, the conventional one that can. A run's sync is fixed when its trainer is built (FSDP2's gradient sync, the
hooks of per_backward), so the rows run on one trainer per sync, both built from the config's seed (the same
weights); the layout and the schedule are read at every iteration.

Per row: the median time per iteration, its recompute forward, the seconds its gradient sync took (``time_sync_s``) and
its collectives (``comm_<kind>_count``), peak memory (one untimed pass), and

    speedup = median over rounds of T(native) / T(row)          (the rows of a round ran next to each other)
    bound   = T(native) / (T(native) - recompute forward(native))   for retain and reweight: the speedup if removing
              the recompute were free (what coalescing the sync adds on top is not in it)

beside Table 1's speedups (:data:`PAPER`, DanceGRPO FLUX.1-dev on 8 RTX A6000 at timestep fraction 1.0).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from lean.config import ConfigError, RunConfig
from lean.configure import shared_layout_problem
from lean.observe.metrics import keep_freed_memory, live_bytes_heap, median
from lean.observe.outputs import write_json
from lean.observe.provenance import machine
from lean.parallel.distributed import init_world, keeps_process_settings
from lean.parallel.grad_sync import PER_BACKWARD, PER_UPDATE
from lean.parallel.layout import GROUP, SHARED, SLICE, group_layout_problem
from lean.schedules import BASELINE, RETAIN, REWEIGHT, run_problem, several_updates
from lean.tools.bench.schedules import BenchOptions, Subject, measured_config, measured_log, pinned, timed_rounds
from lean.train import Trainer


@dataclass(frozen=True)
class AblationRow:
    name: str
    schedule: str
    layout: str
    grad_sync: str


ROWS = (
    AblationRow("native", BASELINE, GROUP, PER_BACKWARD),
    AblationRow("shared", BASELINE, SHARED, PER_BACKWARD),
    AblationRow("shared_coalesced", BASELINE, SHARED, PER_UPDATE),
    AblationRow(RETAIN, RETAIN, SHARED, PER_BACKWARD),
    AblationRow(REWEIGHT, REWEIGHT, SHARED, PER_UPDATE),
)
NATIVE = ROWS[0].name
# Table 1's step times (s): (a) BF16 full fine-tune, (b) BF16 LoRA; DanceGRPO FLUX.1-dev, 8 RTX A6000, f = 1.0
PAPER = {
    "full_finetune": dict(zip((row.name for row in ROWS), (1850.06, 1851.75, 1387.56, 1438.53, 1022.64))),
    "lora": dict(zip((row.name for row in ROWS), (1277.30, 1279.21, 1263.35, 901.99, 880.68))),
}


def ablation_problem(cfg: RunConfig, data_ranks: int) -> tuple[str, object, str] | None:
    """(key, value, why) when the ablation cannot run ``cfg`` on ``data_ranks`` data-parallel processes, or None."""
    if data_ranks < 2:
        why = "the ablation compares layouts and syncs across processes: run it under `lean launch -n 2` (or more)"
        return "data-parallel processes", data_ranks, why
    if later := several_updates(cfg):
        return "train.on_policy", False, f"Table 1's rows take one update per rollout, not {', '.join(later)}: set true"
    if problem := shared_layout_problem(cfg):
        return "parallel.layout", SHARED, f"the ablation's rows after native need it: {problem}"
    return None


def row_config(cfg: RunConfig, row: AblationRow, data_ranks: int) -> RunConfig:
    """``cfg`` as ``row`` runs it (native: the slice layout where the group layout cannot hold the groups)."""
    layout = SLICE if row.layout == GROUP and group_layout_problem(cfg.train, data_ranks) else row.layout
    parallel = dataclasses.replace(cfg.parallel, layout=layout, grad_sync=row.grad_sync)
    return dataclasses.replace(cfg, parallel=parallel, train=dataclasses.replace(cfg.train, schedule=row.schedule))


@keeps_process_settings
def bench_ablation(cfg: RunConfig, out: str | None = None, options: BenchOptions = BenchOptions()) -> dict:
    """Table 1's rows on ``cfg`` (see the module docstring), measured interleaved on the launching processes; writes
    ``out/ablation.json`` (and each measured iteration to ``out/measured.jsonl``) and returns the report."""
    cores = pinned(options)
    world = init_world(cfg.train.dist_timeout_s, cfg.parallel.sequence_parallel)
    data_ranks = world.data_size
    if problem := ablation_problem(cfg, data_ranks):  # before any model is built
        raise ConfigError(*problem)
    trainers = {  # one per sync, from the same seed: the same weights
        sync: Trainer(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grad_sync=sync)), world)
        for sync in (PER_BACKWARD, PER_UPDATE)
    }
    first = trainers[PER_BACKWARD]
    subjects = {}
    for row in ROWS:
        trainer = trainers[row.grad_sync]
        row_cfg = row_config(trainer.cfg, row, data_ranks)
        if why := run_problem(row_cfg, row.schedule, first.world.size):
            raise ConfigError("train.schedule", row.schedule, f"the ablation's {row.name} row: {why}")
        subjects[row.name] = Subject(row_cfg, trainer, trainer.state.state_dict())
    log = measured_log(out, first.world.is_main)
    memory = {}
    with live_bytes_heap():
        for row in ROWS:
            subject = subjects[row.name].activate()
            subject.trainer.state.load_state_dict(subject.state)
            memory[row.name] = subject.trainer.iteration(0, row.schedule).metrics["peak_memory_mb"]
    if first.world.device.type == "cpu":
        keep_freed_memory()
    variants = {row.name: functools.partial(subjects[row.name].fresh_iteration, row.schedule) for row in ROWS}
    rows = timed_rounds(first, subjects[NATIVE].state, options, log, variants)
    report = ablation_report(subjects, rows, memory, options, cores)
    if first.world.is_main:
        print(format_ablation(report))
        if out:
            write_json(Path(out) / "ablation.json", report)
    return report


def ablation_report(
    subjects: dict[str, Subject], rows: dict[str, list[dict]], memory: dict[str, float], options, cores: list[int]
) -> dict:
    """Per row its medians, collectives, peak memory, speedup over native (and the bound for the Lean rows), the sync's
    share of the iteration, and Table 1's speedup for the same fine-tuning mode."""
    cfg = subjects[NATIVE].cfg
    mode = "full_finetune" if cfg.model.full_finetune else "lora"
    paper = PAPER[mode]
    native = rows[NATIVE]
    bound = median(r["time_iteration_s"] / (r["time_iteration_s"] - r["time_recompute_forward_s"]) for r in native)
    report = {
        "config": {
            **measured_config(cfg, options),
            "mode": mode,
            "world_size": subjects[NATIVE].trainer.world.size,
            "data_ranks": subjects[NATIVE].trainer.world.data_size,
            "shard": cfg.parallel.shard,
            "samples_per_process": len(subjects[NATIVE].trainer.plan_input().batch.prompts),
            "rollout_batch_size": cfg.train.rollout_batch_size,
            "train_batch_size": cfg.train.train_batch_size,
            "cores": len(cores),
        },
        "measured_on": machine(subjects[NATIVE].trainer.world.device),
        "rows": [],
    }
    for row in ROWS:
        measured, row_cfg = rows[row.name], subjects[row.name].cfg
        t = median(r["time_iteration_s"] for r in measured)
        entry = {
            "row": row.name,
            "schedule": row.schedule,
            "layout": row_cfg.parallel.layout,
            "grad_sync": row.grad_sync,
            "time_iteration_s": t,
            "time_recompute_forward_s": median(r.get("time_recompute_forward_s", 0.0) for r in measured),
            "time_sync_s": median(r.get("time_sync_s", 0.0) for r in measured),
            "peak_memory_mb": memory[row.name],
            "speedup": median(n["time_iteration_s"] / r["time_iteration_s"] for n, r in zip(native, measured)),
            "paper_speedup": paper[NATIVE] / paper[row.name],
            **{k: v for k, v in measured[0].items() if k.startswith("comm_")},
        }
        entry["sync_share"] = entry["time_sync_s"] / t
        if row.schedule != BASELINE:
            entry["speedup_bound"] = bound
        report["rows"].append(entry)
    return report


def format_ablation(report: dict) -> str:
    c = report["config"]
    mode = "full fine-tune" if c["mode"] == "full_finetune" else "LoRA"
    lines = [
        f"lean bench ablation (LeanGRPO Table 1): {c['family']}/{c['size']} {c['dtype']}, {mode}, shard "
        f"{c['shard']}, {c['samples_per_process']} samples/process x {c['world_size']} process(es), micro-batches "
        f"{c['rollout_batch_size']} / {c['train_batch_size']}, median of {c['repeats']}; paper: DanceGRPO FLUX.1-dev "
        f"{mode}, 8 RTX A6000",
        f"{'row':17} {'schedule':9} {'layout':6} {'sync':12} {'iter s':>8} {'recompute s':>11} {'sync s':>7} "
        f"{'sync %':>6} {'all-reduce':>10} {'red-scatter':>11} {'peak MiB':>9} {'speedup':>8} {'bound':>6} "
        f"{'paper':>6}",
    ]
    for e in report["rows"]:
        bound = f"{e['speedup_bound']:6.3f}" if "speedup_bound" in e else f"{'':6}"
        lines.append(
            f"{e['row']:17} {e['schedule']:9} {e['layout']:6} {e['grad_sync']:12} {e['time_iteration_s']:8.3f} "
            f"{e['time_recompute_forward_s']:11.3f} {e['time_sync_s']:7.3f} {100 * e['sync_share']:6.1f} "
            f"{e.get('comm_all_reduce_count', 0):10.0f} {e.get('comm_reduce_scatter_count', 0):11.0f} "
            f"{e['peak_memory_mb']:9.1f} {e['speedup']:8.3f} {bound} {e['paper_speedup']:6.2f}"
        )
    return "\n".join(lines)
