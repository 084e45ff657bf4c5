"""``lean bench schedules`` under sequence parallelism (``parallel.sequence_parallel`` > 1, run under
``lean launch``): one GRPO iteration of every schedule with every overlap method of the Ulysses all-to-alls, and once
more with every transfer replaced by a local copy of the same bytes (``compute-only``, ``Overlap.loopback``: the same
GEMMs, no communication, wrong numbers), measured interleaved in one run (``timed_rounds``: every round runs every
variant from the same saved state, in alternating order; medians after the warm-up rounds).

    exposed communication (ms per iteration) = median T_iter(method) - median T_iter(compute-only)

the yardstick of ``lean bench overlap``'s ops, for a whole iteration: what the communication costs beyond the same
computation, comparable across methods (a method that hides its transfers behind its GEMMs tends to 0; chunking
overhead counts against it).

Every row also gives the VAE decode's seconds per process (``time_decode_s``), with the decode split over the group
(``parallel.split_decode``, each process its share of the samples); one more variant, the baseline with the
configured method and every process decoding every sample (``whole-decode``), measures what the split saves: the
decode per process drops to about 1/P.

On gloo the transfers are CPU copies by gloo's threads on the cores the GEMMs use; on NCCL the same code measures
the GPU (``benchmarks/gpu_overlap.sh`` runs it).
"""

from __future__ import annotations

import dataclasses

from lean.config import ConfigError, RunConfig
from lean.observe.metrics import median
from lean.observe.provenance import machine
from lean.parallel.distributed import keeps_process_settings, set_threads
from lean.parallel.overlap.p2p import METHODS, Overlap
from lean.schedules import BASELINE, SCHEDULES
from lean.tools.bench.schedules import (
    BenchOptions,
    iteration_metrics,
    measured_config,
    measured_log,
    publish,
    timed_rounds,
)
from lean.train import Trainer

COMPUTE_ONLY = "compute-only"
WHOLE_DECODE = "whole-decode"  # the baseline's variant without parallel.split_decode


@keeps_process_settings
def bench_sequence_parallel(
    cfg: RunConfig, out: str | None = None, options: BenchOptions = BenchOptions(), trainer: Trainer | None = None
) -> dict:
    """Every schedule x (every method + compute-only), interleaved; writes ``out/sequence_parallel.json`` (and each
    measured iteration to ``out/measured.jsonl`` as it ends) and returns it."""
    set_threads(options.threads)
    trainer = trainer or Trainer(cfg)
    sp = trainer.policy.sequence_parallel
    if sp is None:
        raise ConfigError(
            "parallel.sequence_parallel",
            cfg.parallel.sequence_parallel,
            "needs as many processes: run it under `lean launch -n P -- bench schedules ...`",
        )
    log = measured_log(out, trainer.world.is_main)
    state, configured = trainer.state.state_dict(), sp.ov
    overlaps = overlap_variants(configured)
    parallel = trainer.pipeline.cfg.parallel

    def variant(schedule: str, method: str, split_decode: bool = True):
        def run() -> dict:
            sp.ov, parallel.split_decode = overlaps[method], split_decode
            return iteration_metrics(trainer, schedule)

        return run

    variants = {f"{s}/{m}": variant(s, m) for s in SCHEDULES for m in overlaps}
    variants[WHOLE_DECODE] = variant(BASELINE, configured.method, split_decode=False)
    try:
        rows = timed_rounds(trainer, state, options, log, variants)
    finally:
        sp.ov, parallel.split_decode = configured, cfg.parallel.split_decode
        trainer.state.load_state_dict(state)
    result: dict = {
        "config": {
            **measured_config(cfg, options),
            "sequence_parallel": sp.size,
            "processes": trainer.world.size,
            "tokens": trainer.policy.runtime.image_seq_len,
            "samples_per_group": len(trainer.pipeline.local_batch(0).prompts),
        },
        "methods": list(overlaps),
        "measured_on": machine(trainer.world.device),  # where these figures were measured (lean.observe.provenance)
    }
    result.update({s: method_entries({m: rows[f"{s}/{m}"] for m in overlaps}) for s in SCHEDULES})
    result["decode"] = decode_comparison(rows, configured.method, result["config"]["samples_per_group"])
    publish(result, format_table, out, "sequence_parallel.json", trainer.world.is_main)
    return result


def overlap_variants(configured: Overlap) -> dict[str, Overlap]:
    """The configured overlap with each method, and its compute-only form (``loopback``: every transfer a local
    copy of the same bytes)."""
    overlaps = {m: dataclasses.replace(configured, method=m, loopback=False) for m in METHODS}
    overlaps[COMPUTE_ONLY] = dataclasses.replace(configured, method=METHODS[0], loopback=True)
    return overlaps


def method_entries(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """One schedule's medians per method (``rows``: its timed rounds by method), with the exposed communication
    (median T_iter(method) - median T_iter(compute-only), ms)."""
    times = {m: [row["time_iteration_s"] for row in method_rows] for m, method_rows in rows.items()}
    compute = median(times[COMPUTE_ONLY])
    return {
        m: {
            "time_iteration_s": median(t),
            "exposed_ms": (median(t) - compute) * 1e3,
            "time_decode_s": median([row["time_decode_s"] for row in rows[m]]),
            "time_iteration_all_s": t,
        }
        for m, t in times.items()
    }


def decode_comparison(rows: dict[str, list[dict]], method: str, samples_per_group: int) -> dict:
    """The baseline with the configured ``method``: the decode per process, the decode + rewards and the iteration,
    split over the group vs every process decoding every sample (``decode_ratio``: split / whole)."""
    split, whole = rows[f"{BASELINE}/{method}"], rows[WHOLE_DECODE]
    decode = {
        "method": method,
        "samples_per_group": samples_per_group,
        **{f"{k}_s": median([row[f"time_{k}_s"] for row in split]) for k in ("decode", "reward", "iteration")},
        **{f"{k}_whole_s": median([row[f"time_{k}_s"] for row in whole]) for k in ("decode", "reward")},
        "time_iteration_whole_s": median([row["time_iteration_s"] for row in whole]),
    }
    decode["decode_ratio"] = decode["decode_s"] / decode["decode_whole_s"]
    return decode


def flat_metrics(result: dict) -> dict[str, float]:
    """One key per schedule and method: ``sp_exposed_ms_<schedule>_<method>``, ``sp_time_iteration_s_<...>``; the
    split decode's ``sp_decode_s``, ``sp_decode_whole_s`` and their ``sp_decode_ratio``."""
    out = {}
    for s in SCHEDULES:
        for m, e in result[s].items():
            key = f"{s}_{m.replace('-', '_')}"
            out[f"sp_time_iteration_s_{key}"] = e["time_iteration_s"]
            if m != COMPUTE_ONLY:
                out[f"sp_exposed_ms_{key}"] = e["exposed_ms"]
    if "decode" in result:
        d = result["decode"]
        out |= {
            "sp_decode_s": d["decode_s"],
            "sp_decode_whole_s": d["decode_whole_s"],
            "sp_decode_ratio": d["decode_ratio"],
        }
    return out


def format_table(result: dict) -> str:
    c = result["config"]
    methods = [m for m in result["methods"] if m != COMPUTE_ONLY]
    lines = [
        f"lean bench schedules, sequence parallel: {c['family']}/{c['size']} {c['resolution']} px {c['dtype']}, "
        f"{c['tokens']} tokens split over {c['sequence_parallel']} processes ({c['processes']} in all), "
        f"{c['samples_per_group']} samples per group, {c['num_steps']} steps, median of {c['repeats']}",
        f"{'schedule':10} {'compute-only s':>15} " + " ".join(f"{m + ' s':>13} {'exposed ms':>11}" for m in methods),
    ]
    for s in SCHEDULES:
        e = result[s]
        cells = " ".join(f"{e[m]['time_iteration_s']:13.3f} {e[m]['exposed_ms']:11.1f}" for m in methods)
        lines.append(f"{s:10} {e[COMPUTE_ONLY]['time_iteration_s']:15.3f} {cells}")
    if "decode" in result:  # results written before the split decode have no such entry
        d = result["decode"]
        lines.append(
            f"decode per process ({BASELINE}/{d['method']}, {d['samples_per_group']} samples per group): "
            f"split {d['decode_s']:.3f} s vs whole {d['decode_whole_s']:.3f} s ({d['decode_ratio']:.2f}x); "
            f"decode + rewards {d['reward_s']:.3f} vs {d['reward_whole_s']:.3f} s; "
            f"iteration {d['iteration_s']:.3f} vs {d['time_iteration_whole_s']:.3f} s"
        )
    return "\n".join(lines)
