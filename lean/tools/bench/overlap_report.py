"""What ``lean bench overlap`` reports: its measurements next to the timeline model, as files, tables and metrics.

The model (``lean.parallel.overlap.sim``) predicts every measured case of its methods twice: calibrated on the fastest
repeats and compared with the fastest repeat (the machine without outside load), and calibrated on and compared with the
medians (what a user of the shared machine sees). Links, memory, per-call cost and contention come from the
calibration (``lean.parallel.overlap.measure``); GEMM efficiency differs between shapes (caches), so each case uses the
FLOP/s of its own compute-only run, and what is predicted is the links, memory, contention and the schedule.

    error = predicted latency / measured latency - 1

Every method is compared by its exposed communication (latency - compute-only, ms). flash is compared with sliced per
case, and the gap counts only when it exceeds the larger interquartile range of the two ("within noise" otherwise).
Rank 0 writes into the output folder:

    overlap.json         the measurements, the calibration and ``model``: the prediction for every case and its error
    projection.json      the model on H100 / H200 profiles at Llama-70B-like shapes, degree 8 (per op and per block),
                         its assumptions, and its comparison with published H100 / H800 figures
    gantt.png            the projection's timelines
    gantt_measured.png   the calibrated profile's timelines at the first shape (>= 2 ranks)

With one process ``overlap.json``'s ``not_measured`` lists what needs a peer, and ``skipped`` lists the variants that
cannot run here and why. :func:`flat_metrics` reduces ``overlap.json`` to the numbers the pipeline stage and the
notebook log.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from lean.config.dtypes import dtype_name
from lean.observe.outputs import write_json
from lean.observe.provenance import machine
from lean.parallel.overlap import projection, sim
from lean.parallel.overlap.measure import case_flops, measured_profile
from lean.parallel.overlap.p2p import METHODS

NOT_MEASURED_ON_ONE_RANK = (
    "latency, communication-only time and exposed communication of every method (need >= 2 ranks)",
    "link latencies, bandwidth and compute/transfer contention (the model uses the datasheet profile's figures)",
)
MODELLED = (*METHODS, "flash-bidir")  # the variants the timeline model has schedules for


@dataclass(frozen=True)
class Measurements:
    """What one run of the benchmark measured, and how (the report's input, from rank 0)."""

    world: int
    device: torch.device
    dtype: torch.dtype
    repeats: int  # timed samples per case (after --quick)
    warmup: int  # discarded samples per case (after --quick)
    quick: bool
    shapes: dict[str, dict[str, int]]  # measured shape name -> its ``sim.layer_ops`` sizes, in measured order
    calibration: dict  # ``lean.parallel.overlap.measure.calibrate`` plus peak_flops and peak_source
    compute_rows: list[dict]  # per op x shape: the whole local GEMM alone
    results: list[dict]  # per op x shape x method: ``overlap_stats``
    skipped: list[dict] = field(default_factory=list)  # per op x shape x method that could not run: the reason

    @property
    def element_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8


def report(out: Path, m: Measurements) -> None:
    """Writes overlap.json, projection.json and the Gantt charts into ``out`` and prints the tables."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(m)
    write_json(out / "overlap.json", summary)
    projected = write_projection(out / "projection.json")
    draw_methods(
        sim.H100_SXM,
        projection.projection_ops(4096),
        out / "gantt.png",
        f"H100-SXM model, {projection.PROJECTION_SHAPES}, 4096 tokens",
    )
    if m.world > 1 and m.results:
        first = next(iter(m.shapes))
        profile = measured_profile(m.calibration, m.compute_rows, m.device)
        draw_methods(
            profile,
            sim.layer_ops(m.world, **m.shapes[first], element_bytes=m.element_bytes),
            out / "gantt_measured.png",
            f"{profile.name} profile, {first}, world {m.world}",
        )
    print_tables(summary, projected)
    print(f"lean bench overlap: wrote {out}/overlap.json, projection.json, gantt*.png", flush=True)


# ---------------------------------------------------------------- overlap.json


def summarize(m: Measurements) -> dict:
    """overlap.json: the machine, the settings, the measurements, flash vs sliced and the model's predictions."""
    summary = {
        "world": m.world,
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "device": str(m.device),
        "device_name": torch.cuda.get_device_name(m.device) if m.device.type == "cuda" else "cpu",
        "dtype": dtype_name(m.dtype),
        "threads_per_rank": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "measured_on": machine(m.device),  # where these figures were measured (lean.observe.provenance)
        "repeats": m.repeats,
        "warmup": m.warmup,
        "quick": m.quick,
        "shapes": m.shapes,
        "calibration": m.calibration,
        "compute_only": m.compute_rows,
        "results": m.results,
        "flash_vs_sliced": flash_vs_sliced(m.results),
        "not_measured": [] if m.world > 1 else list(NOT_MEASURED_ON_ONE_RANK),
        "skipped": m.skipped,
    }
    modelled = [r for r in m.results if r["method"] in MODELLED]
    cases = (
        model_cases(modelled, m.compute_rows, m.world, m.element_bytes, m.shapes, m.calibration, m.device)
        if modelled
        else []
    )
    summary["model"] = {
        "profile": asdict(measured_profile(m.calibration, m.compute_rows, m.device)),
        "profile_median": asdict(measured_profile(m.calibration, m.compute_rows, m.device, "_median")),
        "cases": cases,
        **error_summary(cases, "fastest"),
        **error_summary(cases, "median"),
    }
    return summary


def model_cases(
    results: list[dict],
    compute_rows: list[dict],
    world: int,
    element_bytes: int,
    shapes: Mapping[str, Mapping[str, int]],
    calibration: dict,
    device: torch.device,
) -> list[dict]:
    """The model's prediction for every measured case (of ``MODELLED``), calibrated on the fastest repeats (keys
    ``*_fastest*``, compared with the fastest repeat) and on the medians (``*_median*``); ``shapes``: name -> layer
    sizes."""
    specs = {
        (spec.name, name): spec
        for name in {r["shape"] for r in results}
        for spec in sim.layer_ops(world, **shapes[name], element_bytes=element_bytes)
    }
    cases = [{"op": r["op"], "shape": r["shape"], "method": r["method"]} for r in results]
    for key, suffix, measured in (("fastest", "", "_min"), ("median", "_median", "")):
        profile = measured_profile(calibration, compute_rows, device, suffix)
        # each case's own GEMM FLOP/s: the roofline then reproduces its compute-only time
        flops = {
            (r["op"], r["shape"]): refit_flops(r, specs.get((r["op"], r["shape"])), profile, suffix)
            for r in compute_rows
        }
        for case, r in zip(cases, results):
            pr = sim.predict(
                specs[r["op"], r["shape"]],
                "flash" if r["method"] == "flash-bidir" else r["method"],
                replace(profile, flops=flops[r["op"], r["shape"]]),
                bidirectional=r["method"] == "flash-bidir",
            )
            case |= {
                f"predicted_{key}_ms": pr.latency * 1e3,
                f"measured_{key}_ms": r[f"latency{measured}_ms"],
                f"error_{key}": pr.latency * 1e3 / r[f"latency{measured}_ms"] - 1,
                f"predicted_exposed_{key}_ms": pr.exposed * 1e3,
                f"measured_exposed_{key}_ms": r[f"exposed{measured}_ms"],
                f"predicted_comm_{key}_ms": pr.comm_only * 1e3,
                f"measured_comm_{key}_ms": r[f"comm{measured}_ms"],
            }
    return cases


def refit_flops(compute_row: dict, spec: sim.OpSpec | None, profile: sim.Profile, suffix: str) -> float:
    """The GEMM FLOP/s with which ``profile`` reproduces this compute-only row (its wave efficiency where the op's
    shape is known)."""
    m, _, n = spec.full_gemm if spec is not None else (1, 1, 1)
    efficiency = sim.wave_efficiency(m, n, profile) if spec is not None else 1.0
    return case_flops(compute_row, profile.launch + profile.host_issue, suffix, efficiency)


def error_summary(cases: list[dict], key: str) -> dict:
    """Mean and max |error| of the model over the cases, and how many are within 15% (``key``: fastest | median)."""
    errors = [abs(c[f"error_{key}"]) for c in cases]
    return {
        f"mean_abs_error_{key}": sum(errors) / len(errors) if errors else None,
        f"max_abs_error_{key}": max(errors) if errors else None,
        f"within_15pct_{key}": sum(e <= 0.15 for e in errors),
    }


def flash_vs_sliced(results: list[dict]) -> list[dict]:
    """flash against sliced per case; 'within noise' when the gap is below the larger interquartile range."""
    by = {(r["op"], r["shape"], r["method"]): r for r in results}
    rows = []
    for (op, shape, method), f in by.items():
        s = by.get((op, shape, "sliced"))
        if method != "flash" or s is None:
            continue
        gap, noise = f["latency_ms"] - s["latency_ms"], max(f["latency_iqr_ms"], s["latency_iqr_ms"])
        verdict = "faster" if gap < -noise else "slower" if gap > noise else "within noise"
        rows.append(
            {
                "op": op,
                "shape": shape,
                "flash_ms": f["latency_ms"],
                "sliced_ms": s["latency_ms"],
                "gap_ms": gap,
                "noise_ms": noise,
                "verdict": verdict,
                "flash_min_ms": f["latency_min_ms"],
                "sliced_min_ms": s["latency_min_ms"],
            }
        )
    return rows


# ---------------------------------------------------------------- projection and Gantt charts


def write_projection(path: Path) -> dict:
    """projection.json: the model on the datasheet GPU profiles at Llama-70B-like shapes, per op (``rows``) and per
    block (``blocks``), its assumptions, and its comparison with published figures (``published``); returns it."""
    rows = projection.projection(sim.GPU_PROFILES)
    projected = {
        "shapes": projection.PROJECTION_SHAPES,
        "profiles": {k: asdict(p) for k, p in sim.GPU_PROFILES.items()},
        "assumptions": list(projection.ASSUMPTIONS),
        "rows": rows,
        "blocks": projection.block_totals(rows),
        "published": projection.published_comparison(),
        "video_ulysses": projection.video_ulysses(sim.GPU_PROFILES),  # Wan shapes under sequence parallelism
    }
    write_json(path, projected)
    return projected


def draw_methods(profile: sim.Profile, specs: list[sim.OpSpec], path: Path, title: str) -> None:
    """One Gantt panel per op and method (a row per op, a column per method)."""
    panels = [(f"{spec.name} - {method}", sim.predict(spec, method, profile)) for spec in specs for method in METHODS]
    sim.draw_gantt(panels, str(path), columns=len(METHODS), title=title)


# ---------------------------------------------------------------- tables


def print_tables(summary: dict, projected: dict) -> None:
    """The measurements (or, with one rank, the compute-only rows), the model's error, flash vs sliced, what was not
    measured or skipped, the projection and its check against published figures."""
    print_measurements(summary)
    print_verdicts(summary)
    print_projection(projected)


def ms(value: float | None, width: int = 5) -> str:
    """A time in ms for the tables ('-' where there is none)."""
    return f"{value:{width}.2f}" if value is not None else "-".rjust(width)


def print_measurements(summary: dict) -> None:
    print(
        f"\nFlashOverlap on {summary['world']} x {summary['device_name']} ({summary['backend']}, "
        f"{summary['dtype']}, {summary['threads_per_rank']} threads/rank), {summary['repeats']} repeats, "
        f"load average {summary['load_average'][0]:.1f} on {summary['cpu_count']} cores. Times in ms: median (min); "
        f"exposed = latency - compute-only; model: calibrated on medians (on minima)"
    )
    predicted = {(c["op"], c["shape"], c["method"]): c for c in summary["model"]["cases"]}
    header = (
        f"{'op':34s} {'shape':15s} {'method':11s} {'latency':>15s} {'iqr':>5s} {'compute':>14s} "
        f"{'comm-only':>13s} {'exposed':>13s} {'GFLOP/s':>7s} {'MFU':>5s} {'model':>14s} {'error':>13s}"
    )
    print(header + "\n" + "-" * len(header))
    for r in summary["results"]:
        m = predicted.get((r["op"], r["shape"], r["method"]))
        model = (
            f"{m['predicted_median_ms']:6.2f} ({m['predicted_fastest_ms']:5.2f}) "
            f"{m['error_median']:+5.0%} ({m['error_fastest']:+5.0%})"
            if m
            else f"{'-':>14s} {'-':>13s}"
        )
        print(
            f"{r['op']:34s} {r['shape']:15s} {r['method']:11s} {r['latency_ms']:7.2f} ({r['latency_min_ms']:5.2f}) "
            f"{r['latency_iqr_ms']:5.2f} {r['compute_ms']:6.2f} ({r['compute_min_ms']:5.2f}) "
            f"{ms(r['comm_ms'])} ({ms(r['comm_min_ms'])}) {r['exposed_ms']:5.2f} ({r['exposed_min_ms']:5.2f}) "
            f"{r['gflops']:7.1f} {r['mfu']:5.0%} {model}"
        )
    for r in summary["compute_only"] if not summary["results"] else []:  # one rank: only the GEMMs were measured
        print(
            f"{r['op']:36s} {r['shape']:16s} compute-only {r['compute_ms']:8.2f} ms {r['gflops']:8.1f} GFLOP/s "
            f"MFU {r['mfu']:6.1%}"
        )


def print_verdicts(summary: dict) -> None:
    model = summary["model"]
    for key in ("median", "fastest") if model["cases"] else ():
        print(
            f"timeline model vs measured latency ({key} repeats): mean |error| {model[f'mean_abs_error_{key}']:.1%}, "
            f"max {model[f'max_abs_error_{key}']:.1%}, {model[f'within_15pct_{key}']}/{len(model['cases'])} "
            f"cases within 15%"
        )
    for row in summary["flash_vs_sliced"]:
        print(
            f"flash vs sliced  {row['op']:34s} {row['shape']:15s} median {row['flash_ms']:6.2f} vs "
            f"{row['sliced_ms']:6.2f} ms: {row['verdict']:12s} (min {row['flash_min_ms']:6.2f} vs "
            f"{row['sliced_min_ms']:6.2f})"
        )
    for line in summary["not_measured"]:
        print(f"not measured: {line}")
    for row in summary["skipped"]:
        print(f"skipped: {row['method']} for {row['op']} ({row['shape']}): {row['reason']}")


def print_projection(projected: dict) -> None:
    """Latency / exposed ms per op and per block, then the model against the published figures, with every
    assumption."""
    print(f"\nProjection (timeline model), {projected['shapes']}: latency / exposed communication, ms")
    cols = [(p, m) for p in sim.GPU_PROFILES for m in METHODS]
    print(f"{'op':36s} {'tokens':>6s} " + " ".join(f"{p[:8] + ' ' + m:>18s}" for p, m in cols))
    for key, rows in (("op", projected["rows"]), ("block", projected["blocks"])):
        by = {(r[key], r["tokens"], r["profile"], r["method"]): r for r in rows}
        for name, tokens in dict.fromkeys((r[key], r["tokens"]) for r in rows):
            cells = [by[name, tokens, p, m] for p, m in cols]
            label = name if len(name) <= 36 else name[:35] + "~"
            print(
                f"{label:36s} {tokens:6d} " + " ".join(f"{c['latency_ms']:9.3f}/{c['exposed_ms']:<8.3f}" for c in cells)
            )
    print(
        "\nThe model against published figures (error = projected / published - 1; projected with the 128x256 tile, "
        "then with the best of several tiles: the wave model's pessimistic and optimistic cases):"
    )
    for source in dict.fromkeys(r["source"] for r in projected["published"]):
        print(f"  {source}")
        for r in (r for r in projected["published"] if r["source"] == source):
            print(
                f"    {r['case']:22s} {r['quantity']:38s} published {r['published']:7.3f} {r['unit']:2s} "
                f"projected {r['projected']:7.3f} ({r['error']:+4.0%}), best tiles {r['projected_best_tiles']:7.3f} "
                f"({r['error_best_tiles']:+4.0%})  [{r['assumed']}]"
            )
    print_video_ulysses(projected.get("video_ulysses", []))
    print("Assumptions:", *projected["assumptions"], sep="\n  - ")


def print_video_ulysses(rows: list[dict]) -> None:
    """Sequence parallelism's Ulysses block per layer at Wan's shapes: latency / exposed ms per profile and method."""
    if not rows:
        return
    print("\nUlysses attention per layer at Wan's video shapes (fused QKV + output projection): latency / exposed, ms")
    cells = {(r["model"], r["world"], r["tokens"], r["profile"], r["method"]): r for r in rows}
    for model, world, tokens, profile in dict.fromkeys(k[:4] for k in cells):
        line = "  ".join(
            f"{m} {cells[model, world, tokens, profile, m]['latency_ms']:6.3f} / "
            f"{cells[model, world, tokens, profile, m]['exposed_ms']:5.3f}"
            for m in METHODS
            if (model, world, tokens, profile, m) in cells
        )
        print(f"  {model:12s} SP={world} {tokens:6d} tokens {profile:10s} {line}")


# ---------------------------------------------------------------- metrics


def flat_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """Flat metrics of ``overlap.json``: per method, the median over every measured op and shape of the exposed
    communication (latency - compute-only, ms) and of the latency (ms), and the timeline model's mean relative
    error (calibrated on and compared with medians)."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    for row in summary.get("results", []):
        by_method[row["method"]].append(row)
    out = {}
    for method, rows in by_method.items():
        key = method.replace("-", "_")  # metric names: flash-bidir -> flash_bidir
        out[f"overlap_exposed_ms_{key}"] = median(r["exposed_ms"] for r in rows)
        out[f"overlap_latency_ms_{key}"] = median(r["latency_ms"] for r in rows)
    model = summary.get("model") or {}
    if model.get("mean_abs_error_median") is not None:
        out["overlap_model_mean_abs_error"] = model["mean_abs_error_median"]
    return out
