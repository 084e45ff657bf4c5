"""Retain at a size that needs offload or partial retention (issue #42), on one CUDA GPU (written without one: its
GPU path has not run yet; the plan's estimate, printed first, is ~3 minutes on an H200, and past ``--max-minutes``
it times fewer rounds).

At FLUX.1-dev's block structure (``model.size=medium``: its double/single blocks at half width, 4 + 8 blocks, 512 px
-> 1024 image tokens, bfloat16, 8 samples, 9 of 10 steps trained; the config of ``gpu_schedules.sh``) Retain keeps
~4.2 GiB of graphs per trained step: ``lean plan`` counts ~40 GiB on the device against ~6 GiB for Recompute. The
budget is half of Retain's predicted peak (``--budget-gb`` to choose another), so Retain on the device needs ~2x what
it allows. One model, interleaved rounds (``lean bench schedules``' ``timed_rounds``), from the same weights:

    recompute              the baseline
    retain                 every trained step's graph kept on the device
    retain_offload         the same graphs in pinned host memory (train.retain.offload=host)
    retain_m<K/2>          the last K/2 steps' graphs kept, the rest recomputed (train.retain.steps=K/2)
    retain_m<K/2>_offload  both

Per variant: peak device memory (``torch.cuda.max_memory_allocated``, one untimed iteration), the median iteration
time after warm-up, the speedup over Recompute (median of each round's ratio) and its bound (``lean bench
schedules``' T / (T - q recompute_forward), q the kept share of the trained steps), and what the schedule reports of
its offload (``offload_moved_mb`` D2H, ``offload_fetched_mb`` H2D, ``offload_demand_fetches``,
``offload_exposed_d2h_ms``, ``offload_exposed_h2d_ms``: "not reported" where the iteration's metrics lack them).
Beside them the host link each way (a 1 GiB pinned copy, median of 3) and the float64 certificate of each Retain
variant at the tiny size (``lean.tools.equivalence``: its gradient and weights after the step equal Recompute's to
1e-10).

Claims checked (exit 1 if one fails): every certificate passes; with offload the peak is below the same m's on the
device. Writes OUT/retain_offload.json, OUT/retain_offload.md and OUT/measured.jsonl (each iteration as it ends).

    NEED_GPU=1 bash -c 'source benchmarks/gpu_env.sh && "$PY" benchmarks/gpu_retain_offload.py [--out DIR]
        [--repeats 3] [--warmup 1] [--budget-gb G] [--max-minutes 8] [--set KEY=VALUE ...]'
    python benchmarks/gpu_retain_offload.py --dry-run --out DIR    # the same code on the CPU, tiny size, seconds
                                                                   # (offload in copy mode; peaks not compared)
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: `lean` is this repository's

from lean.config import RunConfig  # noqa: E402
from lean.configure import load_config, validate  # noqa: E402
from lean.observe.metrics import live_bytes_heap, median  # noqa: E402
from lean.observe.outputs import write_json  # noqa: E402
from lean.observe.provenance import machine  # noqa: E402
from lean.plan.cost import host_link_speeds  # noqa: E402
from lean.sampling.sde import num_trained_steps  # noqa: E402
from lean.schedules import BASELINE  # noqa: E402
from lean.schedules.retain import ALL_STEPS, DEVICE, HOST  # noqa: E402
from lean.tools.bench.schedules import (  # noqa: E402
    RETAIN,
    BenchOptions,
    Subject,
    bench_config,
    measured_log,
    measured_retain,
    pinned,
    retained_share,
    speedup_bound,
    timed_rounds,
)
from lean.tools.equivalence import passes, run_equivalence  # noqa: E402

PARAMS = REPO / "params.yaml"
MEASURED = (  # gpu_schedules.sh's FLUX medium: ~40 GiB of kept graphs at 8 samples x 9 trained steps
    "model.family=flux",
    "model.size=medium",
    "model.resolution=512",
    "model.dtype=bfloat16",
    "model.lora_rank=32",
    "model.lora_alpha=64",
    "train.prompts_per_iteration=2",
    "train.group_size=4",
    "train.rollout_batch_size=8",
    "train.train_batch_size=8",
    "sample.num_steps=10",
    "sample.timestep_fraction=0.99",
    "sample.cfg=true",
)
DRY = ("model.size=tiny", "model.resolution=32", "model.dtype=float32", "sample.num_steps=4")
SMALL_BATCH = ("train.prompts_per_iteration=2", "train.group_size=2", "train.rollout_batch_size=2")
CERTIFICATE = (  # the tiny FLUX in float64, CFG and KL on, two rollout micro-batches (two offload groups per step)
    "model.size=tiny",
    "model.dtype=float64",
    "sample.num_steps=4",
    "sample.cfg=true",
    "algorithm.beta=0.01",
    *SMALL_BATCH,
    "train.train_batch_size=2",
    "train.schedule=retain",
)
OFFLOAD_METRICS = (
    "offload_moved_mb",
    "offload_fetched_mb",
    "offload_demand_fetches",
    "offload_exposed_d2h_ms",
    "offload_exposed_h2d_ms",
)
CERTIFICATE_S, LINK_S = 15.0, 5.0  # estimated seconds per certificate and for the link's copies (H200)
GIB = 2**30


@dataclass(frozen=True)
class Variant:
    """One measured configuration: a schedule, and for Retain whether it keeps the last K/2 steps' graphs only
    (``train.retain.steps``) and whether they wait in host memory (``train.retain.offload=host``)."""

    schedule: str
    half: bool = False
    offload: bool = False

    def kept(self, k: int) -> int | str:
        """m at K trained steps per sample (``train.retain.steps``)."""
        return max(1, k // 2) if self.half else ALL_STEPS

    def name(self, k: int) -> str:
        return self.schedule + f"_m{self.kept(k)}" * self.half + "_offload" * self.offload

    def config(self, cfg: RunConfig, k: int) -> RunConfig:
        """``cfg`` with this variant's ``train.retain`` keys, validated; a new config."""
        form = copy.deepcopy(cfg)
        form.train.retain = replace(form.train.retain, steps=self.kept(k), offload=HOST if self.offload else DEVICE)
        validate(measured_retain(form))
        return form


@dataclass
class Measured(Subject):
    """A variant under the check: a bench subject (its config on the shared trainer) and the schedule it runs."""

    schedule: str = BASELINE


VARIANTS = (  # Recompute, Retain on the device and offloaded, and both at m = K/2
    Variant(BASELINE),
    Variant(RETAIN),
    Variant(RETAIN, offload=True),
    Variant(RETAIN, half=True),
    Variant(RETAIN, half=True, offload=True),
)


def trained_steps(cfg) -> int:
    """K, the trained steps per sample of ``cfg``'s sampler."""
    s = cfg.sample
    return num_trained_steps(s.num_steps, s.timestep_fraction, s.timestep_fraction_of)


def host_link(device: torch.device, nbytes: int) -> dict:
    """GB/s each way of one ``nbytes`` pinned copy (``lean.plan.cost.host_link_speeds``, what ``lean train`` times
    for the plan); on a CPU there is no link (inf)."""
    speeds = host_link_speeds(device, nbytes / 2**20)
    how = "pinned cudaMemcpyAsync, median of 3" if device.type == "cuda" else "no link on a CPU"
    return {"bytes": nbytes, "how": how, **{f"{k}_gb_s": v * 2**20 / 1e9 for k, v in speeds.items()}}


def certificates() -> dict:
    """The float64 certificate of each Retain variant at the tiny size: its gradient and weights after one step
    against Recompute's (``lean.tools.equivalence``, no float64 twin: the baseline is the yardstick)."""
    base = load_config(PARAMS, CERTIFICATE)
    k, out = trained_steps(base), {}
    for v in VARIANTS[1:]:
        cfg = v.config(base, k)
        report = run_equivalence(cfg, reference=False)
        retain = report.get(RETAIN, {})
        out[v.name(k)] = {
            "passes": RETAIN in report and passes(report, cfg.model.torch_dtype),  # run, and equal
            **{key: retain.get(key) for key in ("max_rel_grad_diff", "cosine", "max_rel_param_diff_after_step")},
        }
    return out


def plan_estimate(base: Subject, k: int, options: BenchOptions, budget_mb: float) -> float:
    """Print what will run with the plan's predicted peaks and times (the probe's, on this device); the seconds."""
    pred = base.prediction
    t_rc, t_rt = pred[BASELINE]["time_iteration_s"], pred[RETAIN]["time_iteration_s"]
    m_rc, m_rt = pred[BASELINE]["peak_memory_mb"], pred[RETAIN]["peak_memory_mb"]
    trained = base.plan_input.batch.steps.trained
    rounds = 1 + options.warmup + options.repeats  # the memory pass, then the rounds
    total = LINK_S + CERTIFICATE_S * (len(VARIANTS) - 1)
    print(
        f"gpu_retain_offload: K = {k} trained steps per sample, budget {budget_mb / 1024:.1f} GiB; per variant 1 "
        f"memory + {options.warmup} warm-up + {options.repeats} timed iterations, then {len(VARIANTS) - 1} float64 "
        "certificates (tiny FLUX) and the host link"
    )
    for v in VARIANTS:
        q = 0.0 if v.schedule == BASELINE else retained_share(v.kept(k), trained)
        t, peak = t_rc - q * (t_rc - t_rt), m_rc + q * (m_rt - m_rc)  # linear in m (docs/design/retain-offload.md)
        where = "host" if v.offload else "device"
        print(
            f"  {v.name(k):22} q {q:.2f}, graphs on the {where:6} plan without offload: {t:6.2f} s/iteration, "
            f"peak {peak / 1024:6.1f} GiB"
        )
        total += rounds * t
    print(f"gpu_retain_offload: estimated {total / 60:.1f} min")
    return total


def fitted_repeats(estimate_s: float, options: BenchOptions, max_minutes: float) -> BenchOptions:
    """Fewer timed rounds (at least one) when the estimate would pass ``max_minutes``."""
    per_round = estimate_s / (1 + options.warmup + options.repeats)  # the fixed costs counted as rounds: cautious
    fit = int(max_minutes * 60 / per_round) - 1 - options.warmup
    if fit >= options.repeats:
        return options
    print(f"gpu_retain_offload: {options.repeats} timed rounds would pass {max_minutes} min: {max(1, fit)}")
    return replace(options, repeats=max(1, fit))


def measure(subjects: dict[str, Subject], options: BenchOptions, out: Path) -> tuple[dict, dict]:
    """Each variant's memory pass (one untimed iteration: its peak), then the interleaved timed rounds; the memory
    metrics and the timed rows per variant."""
    first = next(iter(subjects.values()))
    trainer, state = first.trainer, first.state
    log = measured_log(str(out), True)
    memory = {}
    with live_bytes_heap():  # on a CPU the resident set follows live tensors (the bench's memory pass)
        for name, subject in subjects.items():
            trainer.state.load_state_dict(state)
            memory[name] = subject.activate().trainer.iteration(0, subject.schedule).metrics
            log.append({"pass": "memory", "variant": name, **memory[name]})
    variants = {name: functools.partial(subject.iteration, subject.schedule) for name, subject in subjects.items()}
    rows = timed_rounds(trainer, state, options, log, variants)
    trainer.state.load_state_dict(state)
    return memory, rows


def summary(name: str, subject: Subject, memory: dict, rows: dict, budget_mb: float) -> dict:
    """One variant's row: peak, time, speedup over Recompute and its bound, the offload's figures."""
    base, mine = rows[BASELINE], rows[name]
    q = 0.0 if subject.schedule == BASELINE else subject.retained
    entry = {
        "schedule": subject.schedule,
        "retain_steps": subject.cfg.train.retain.steps,
        "retain_offload": subject.cfg.train.retain.offload,
        "kept_share": q,
        "peak_memory_mb": memory[name]["peak_memory_mb"],
        "fits_budget": memory[name]["peak_memory_mb"] <= budget_mb,
        "time_iteration_s": median(r["time_iteration_s"] for r in mine),
        "time_iteration_all_s": [r["time_iteration_s"] for r in mine],
        "speedup": median(b["time_iteration_s"] / r["time_iteration_s"] for b, r in zip(base, mine)),
        "speedup_bound": median(
            speedup_bound(b["time_iteration_s"], b.get("time_recompute_forward_s", 0.0), q) for b in base
        ),
    }
    reported = [key for key in OFFLOAD_METRICS if all(key in r for r in mine)]
    entry.update({key: median(r[key] for r in mine) for key in reported})
    if subject.cfg.train.retain.offload != DEVICE and len(reported) < len(OFFLOAD_METRICS):
        entry["not_reported"] = [key for key in OFFLOAD_METRICS if key not in reported]
    return entry


def claims(result: dict, device: torch.device) -> dict[str, bool | None]:
    """What the check shows: True / False, None where it cannot be shown here (peaks on a CPU, whose "host" is the
    same memory)."""
    out = {f"certificate {name}": cert["passes"] for name, cert in result["certificates"].items()}
    runs = result["variants"]
    for name, entry in runs.items():
        if entry["retain_offload"] == HOST:
            on_device = runs[name.removesuffix("_offload")]["peak_memory_mb"]
            below = entry["peak_memory_mb"] < on_device if device.type == "cuda" else None
            out[f"peak {name} < {name.removesuffix('_offload')}"] = below
    return out


def markdown(result: dict) -> str:
    """The short table of the results, the host link and the claims."""
    link, c = result["host_link"], result["config"]
    lines = [
        f"# Retain offload and partial retention: {c['family']}/{c['size']} {c['resolution']} px {c['dtype']}, "
        f"K = {c['trained_steps']}, {c['device']}",
        "",
        f"Budget {result['budget_mb'] / 1024:.1f} GiB. Host link ({link['how']}, {link['bytes'] / 2**20:.0f} MiB): "
        f"H2D {link['h2d_gb_s']:.1f} GB/s, D2H {link['d2h_gb_s']:.1f} GB/s.",
        "",
        "| variant | peak GiB | fits | iter s | speedup | bound | D2H GiB | H2D GiB | demand fetches | exposed D2H ms "
        "| exposed H2D ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def figure(entry: dict, key: str, scale: float = 1.0) -> str:
        return f"{entry[key] / scale:.2f}" if key in entry else "not reported"

    for name, e in result["variants"].items():
        offload = [figure(e, k, s) for k, s in zip(OFFLOAD_METRICS, (1024, 1024, 1, 1, 1))]
        if e["retain_offload"] == DEVICE:
            offload = ["-"] * len(OFFLOAD_METRICS)
        lines.append(
            f"| {name} | {e['peak_memory_mb'] / 1024:.2f} | {'yes' if e['fits_budget'] else 'no'} | "
            f"{e['time_iteration_s']:.3f} | {e['speedup']:.3f} | {e['speedup_bound']:.3f} | {' | '.join(offload)} |"
        )
    lines += ["", "| claim | holds |", "|---|---|"]
    lines += [
        f"| {k} | {'not checked here' if v is None else 'yes' if v else 'NO'} |" for k, v in result["claims"].items()
    ]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs/gpu_retain_offload", help="output folder")
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU at the tiny size, in seconds")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (medians)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds (the pinned arena is allocated in them)")
    p.add_argument("--budget-gb", type=float, default=None, help="device budget (default: half Retain's plan peak)")
    p.add_argument("--max-minutes", type=float, default=8.0, help="fewer timed rounds if the estimate passes it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="--set k=v")
    return p


def run(args: argparse.Namespace, device_sets: tuple[str, ...]) -> dict:
    """Plan, measure, certify; the result (its claims included)."""
    started = time.perf_counter()
    options = pinned_options(args)
    sets = [*device_sets, *args.overrides]
    base = Measured.build(bench_config(PARAMS, sets)[0])
    base.plan()
    k, device = trained_steps(base.cfg), base.trainer.world.device
    budget = args.budget_gb * 1024 if args.budget_gb else base.prediction[RETAIN]["peak_memory_mb"] / 2
    estimate = plan_estimate(base, k, options, budget)
    if device.type == "cuda":
        options = fitted_repeats(estimate, options, args.max_minutes)
    subjects = {
        v.name(k): Measured(
            v.config(base.cfg, k), base.trainer, base.state, plan_input=base.plan_input, schedule=v.schedule
        )
        for v in VARIANTS
    }
    memory, rows = measure(subjects, options, Path(args.out))
    c = base.cfg
    result = {
        "config": {
            **{key: getattr(c.model, key) for key in ("family", "size", "resolution", "dtype")},
            "trained_steps": k,
            "samples_per_process": len(base.plan_input.batch.prompts),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
            "repeats": options.repeats,
            "warmup": options.warmup,
        },
        "budget_mb": budget,
        "plan": base.prediction,
        "estimate_s": estimate,
        "variants": {name: summary(name, s, memory, rows, budget) for name, s in subjects.items()},
        "host_link": host_link(device, GIB if device.type == "cuda" else 16 * 2**20),
        "certificates": certificates(),
        "measured_on": machine(device),
    }
    result["claims"] = claims(result, device)
    result["wall_s"] = time.perf_counter() - started
    return result


def pinned_options(args: argparse.Namespace) -> BenchOptions:
    """The rounds asked for; torch's threads (one on a CPU) and no CPU pinning."""
    options = BenchOptions(
        repeats=args.repeats, warmup=args.warmup, threads=0 if torch.cuda.is_available() else 1, cores=0, flops=False
    )
    pinned(options)
    return options


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_retain_offload: no CUDA GPU visible: nothing to measure here (--dry-run runs the same code on the CPU "
            "at the tiny size)",
            file=sys.stderr,
        )
        return 2
    result = run(args, DRY + SMALL_BATCH if args.dry_run else MEASURED)
    out = Path(args.out)
    write_json(out / "retain_offload.json", result)
    table = markdown(result)
    (out / "retain_offload.md").write_text(table)
    print(table)
    failed = [claim for claim, holds in result["claims"].items() if holds is False]
    if failed:
        print(f"gpu_retain_offload: claims that fail: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
