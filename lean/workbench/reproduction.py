"""Reproduction you can check: this run's headline figures against the committed reference, each within its band.

A fresh clone's ``dvc repro`` does not give the committed figures bit for bit: float32 kernels differ between CPUs,
the pretrained base differs in its last bits, and the RL runs, chaotic in those bits, end elsewhere (the committed
run's eval gain 0.230 is 0.176 on another machine). Whether that is a reproduction or a regression is decided here,
figure by figure:

    reference   ``reproduction/reference.json`` (params.yaml ``report.reference``): the headline figures of the
                committed run, the params they were made with and where the benchmarks were measured. Git keeps it;
                no stage writes it: ``python -m pipelines.report --pin`` refreshes it from ``outputs/``.
    bands       params.yaml ``report.bands``, one per figure family (a schedule's or method's figures share their
                family's band): ``abs`` (|value - reference| <= abs), ``rel`` (<= rel x |reference|), ``min`` /
                ``max`` (limits on the value itself), ``bound: true`` (the figure's own bound, read from the
                outputs: the certificates are checked against it, never against the reference), ``info: true``
                (shown beside the reference, never checked: timings that depend on the machine). The allowed range is
                the intersection of what a band lists.
    verdict     ``reproduced``: the params are the reference's, and every checked figure is inside its band;
                ``outside_band`` names each figure that is not, with its value, reference, band and allowed range.

The benchmark figures (``bench``, ``overlap``) carry where they were measured (``measured_on``,
``lean.observe.provenance``); the report says whether they were measured on this machine or are the committed ones from
another (``make bench`` re-measures them here).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import statistics
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lean.algorithms import ALGORITHMS
from lean.observe import provenance
from lean.observe.outputs import write_json
from lean.schedules import BASELINE, LEAN_SCHEDULES, RETAIN, SCHEDULES
from lean.workbench.time_to_reward import SAMPLES, run_time_to_reward

GRPO_RUN = LEAN_SCHEDULES[0]
"""GRPO's run among the algorithms side by side: the train stage's Retain run (the others: outputs/algorithms/)."""

REFERENCE = "reproduction/reference.json"
"""The committed reference (relative to the repository root), unless params.yaml ``report.reference`` says else."""

PARAM_SECTIONS = (
    "model",
    "sample",
    "reward",
    "train",
    "optimizer",
    "ema",
    "eval",
    "prepare",
    "method",
    "rl",
    "bench",
    "overlap",
)
"""The params.yaml sections the stages declare (dvc.yaml ``params``): a run with other values there is an experiment,
not a reproduction."""

MEASURED = {"bench": ("bench", "schedules.json"), "overlap": ("overlap", "metrics.json")}
"""The groups whose figures are measurements of the machine, and the output that records where (``measured_on``)."""

BAND_KEYS = ("abs", "rel", "min", "max", "bound", "info")

FAMILIES = {
    "vae_mse_final": ("prepare", "the base's autoencoder: reconstruction MSE at its last step"),
    "flow_loss_final": ("prepare", "the base's rectified-flow loss at its last step"),
    "certificate_passes": ("equivalence", "the float32 certificate passes (1)"),
    "certificate_rel_grad_diff": ("equivalence", "max relative gradient difference to the baseline"),
    "certificate_one_minus_cosine": ("equivalence", "1 - cosine of the gradient to the baseline's"),
    "bf16_certificate_passes": ("equivalence_bf16", "the bfloat16 certificate passes (1)"),
    "bf16_rel_l2": ("equivalence_bf16", "relative L2 distance to the float64 gradient"),
    "bf16_one_minus_cosine": ("equivalence_bf16", "1 - cosine to the float64 gradient"),
    "eval_reward_base": ("train", "the base model's eval (ODE, fixed noise) reward"),
    "eval_reward_gain": ("train", "eval reward after the RL run minus the base's"),
    "eval_gain_over_noise": ("train", "the eval gain in units of the base's eval-noise std"),
    "reward_mean": ("train", "the training-reward curve's mean over the iterations"),
    "reward_last10": ("train", "the training-reward curve's mean over its last 10 iterations"),
    "reward_curves_max_diff": ("train", "largest gap between a schedule's reward curve and the baseline's"),
    "algorithm_eval_reward_gain": ("train", "eval reward after an algorithm's run minus the base's"),
    "algorithm_gain_over_noise": ("train", "an algorithm's eval gain in units of the eval-noise std"),
    "algorithm_samples_to_reward": (
        "train",
        "a run's training samples until its eval reward reaches the base's + rl.time_to_reward_gain",
    ),
    "algorithm_time_to_reward": (
        "train",
        "a run's training CPU seconds until its eval reward reaches the base's + rl.time_to_reward_gain",
    ),
    "time_to_reward_ratio": (
        "train",
        "a run's training CPU seconds to reward / GRPO-Recompute's in the same run of the pipeline",
    ),
    "speedup_vs_bound": ("bench", "speedup over the baseline / its analytic bound"),
    "peak_memory_ratio": ("bench", "peak memory / the baseline's"),
    "time_iteration_s": ("bench", "seconds per iteration (the machine's speed)"),
    "memory_slope_vs_plan": ("bench", "Retain's resident growth per kept step / the plan's per-step term"),
    "optimizer_peak_vs_plan": ("bench", "the optimizer stage's measured peak / the plan's"),
    "sp_speedup": ("overlap", "sequence-parallel compute-only iteration: the baseline's time / this schedule's"),
    "overlap_exposed_ms": ("overlap", "exposed communication of the overlap ops on gloo, ms"),
    "sp_decode_ratio": (
        "overlap",
        "SP=2: each process's decode seconds with the split decode / every process decoding all",
    ),
}
"""Every headline figure family: (its stage, what it is); params.yaml ``report.bands`` is keyed by these."""


@dataclass(frozen=True)
class Figure:
    name: str
    family: str
    value: float
    bound: float | None = None
    """The figure's own bound (a certificate's tolerance), for ``bound: true`` bands."""

    @property
    def group(self) -> str:
        return FAMILIES[self.family][0]


# ---------------------------------------------------------------- the figures of a run


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class FigureSet:
    """The headline figures found so far, by name, in the order they were found (the report's row order)."""

    def __init__(self) -> None:
        self.figures: dict[str, Figure] = {}

    def add(self, name: str, family: str, value: Any, bound: Any = None) -> None:
        """Adds the figure if ``value`` is a number (an absent or malformed entry contributes none)."""
        number = _number(value)
        if number is not None:
            self.figures[name] = Figure(name, family, number, _number(bound))

    def add_eval_gain(self, run: Mapping[str, Any], name: str, gain_family: str, over_noise_family: str) -> None:
        """A run's eval reward gain, and the gain in units of the base's eval-noise std where that is known."""
        gain, noise = _number(run.get("eval_reward_gain")), _number(run.get("eval_reward_noise_std"))
        self.add(f"eval_reward_gain_{name}", gain_family, gain)
        if gain is not None and noise:
            self.add(f"eval_gain_over_noise_{name}", over_noise_family, gain / noise)

    def add_time_to_reward(self, folder: Path, name: str, gain: float, baseline_seconds: float | None) -> None:
        """A run's samples and CPU seconds to the base's eval reward + ``gain``, and its CPU seconds over
        ``baseline_seconds`` (GRPO-Recompute's in the same pipeline run)."""
        self.add(f"samples_to_reward_{name}", "algorithm_samples_to_reward", run_time_to_reward(folder, gain, SAMPLES))
        seconds = run_time_to_reward(folder, gain)
        self.add(f"time_to_reward_{name}", "algorithm_time_to_reward", seconds)
        if seconds is not None and baseline_seconds:
            self.add(f"time_to_reward_ratio_{name}", "time_to_reward_ratio", seconds / baseline_seconds)


def headline_figures(outputs: str | Path, params: Mapping[str, Any] | None = None) -> dict[str, Figure]:
    """The headline figures of the run under ``outputs``, by name; a stage whose output is absent contributes none.
    ``params`` (params.yaml) gives the time-to-reward target (``rl.time_to_reward_gain``); None: no times to reward."""
    outputs, found = Path(outputs), FigureSet()
    gain = _number(((params or {}).get("rl") or {}).get("time_to_reward_gain"))
    for stage_figures in (
        _prepare_figures,
        _certificate_figures,
        _bf16_certificate_figures,
        _schedule_run_figures,
        functools.partial(_algorithm_run_figures, time_to_reward_gain=gain),
        _bench_figures,
        _overlap_figures,
    ):
        stage_figures(outputs, found)
    return found.figures


def _prepare_figures(outputs: Path, found: FigureSet) -> None:
    if prepare := read_json(outputs / "prepare" / "metrics.json"):
        found.add("vae_mse_final", "vae_mse_final", prepare.get("vae_mse_final"))
        found.add("flow_loss_final", "flow_loss_final", prepare.get("flow_loss_final"))


def _certificate_figures(outputs: Path, found: FigureSet) -> None:
    """The float32 certificate: each schedule's gradient difference and 1 - cosine, with the certificate's bounds."""
    if not (certificate := read_json(outputs / "equivalence" / "equivalence.json")):
        return
    tolerance = certificate.get("tolerance") or {}
    found.add("certificate_passes", "certificate_passes", certificate.get("passes"))
    for s in LEAN_SCHEDULES:
        entry = certificate.get(s) or {}
        bound = tolerance.get("max_rel_grad_diff")
        found.add(f"certificate_rel_grad_diff_{s}", "certificate_rel_grad_diff", entry.get("max_rel_grad_diff"), bound)
        if (cosine := _number(entry.get("cosine"))) is not None:
            bound = tolerance.get("one_minus_cosine")
            found.add(f"certificate_one_minus_cosine_{s}", "certificate_one_minus_cosine", 1 - cosine, bound)


def _bf16_certificate_figures(outputs: Path, found: FigureSet) -> None:
    """The bfloat16 certificate: each schedule's distance and 1 - cosine to the float64 gradient."""
    if not (bf16 := read_json(outputs / "equivalence_bf16" / "metrics.json")):
        return
    tolerance = _number(bf16.get("bf16_tolerance"))
    found.add("bf16_certificate_passes", "bf16_certificate_passes", bf16.get("bf16_passes"))
    reference = (read_json(outputs / "equivalence_bf16" / "equivalence.json") or {}).get("reference") or {}
    for s in LEAN_SCHEDULES:
        found.add(f"bf16_rel_l2_{s}", "bf16_rel_l2", bf16.get(f"bf16_rel_l2_{s}"), tolerance)
        cosine = _number((reference.get(s) or {}).get("cosine"))
        if cosine is not None and tolerance is not None:  # lean.tools.equivalence.half_tolerance: (rel, rel^2 / 2)
            found.add(f"bf16_one_minus_cosine_{s}", "bf16_one_minus_cosine", 1 - cosine, tolerance**2 / 2)


def _schedule_run_figures(outputs: Path, found: FigureSet) -> None:
    """Each schedule's train run: its eval gain and reward curve, and the largest gap between the curves."""
    curves = {}
    for s in SCHEDULES:
        run = read_json(outputs / "train" / s / "metrics.json")
        if not run:
            continue
        if s == BASELINE:  # the same base and eval noise for every schedule
            found.add("eval_reward_base", "eval_reward_base", run.get("eval_reward_first"))
        found.add_eval_gain(run, s, "eval_reward_gain", "eval_gain_over_noise")
        curve = [float(v) for v in run.get("reward_mean") or [] if _number(v) is not None]
        if curve:
            curves[s] = curve
            found.add(f"reward_mean_{s}", "reward_mean", statistics.fmean(curve))
            found.add(f"reward_last10_{s}", "reward_last10", statistics.fmean(curve[-10:]))
    if BASELINE in curves and len(curves) > 1:
        found.add("reward_curves_max_diff", "reward_curves_max_diff", _largest_gap(curves))


def _largest_gap(curves: Mapping[str, list[float]]) -> float:
    """max over schedules and iterations of |curve - baseline's curve| (inf where the lengths differ)."""
    base = curves[BASELINE]
    return max(
        max(abs(a - b) for a, b in zip(curve, base)) if len(curve) == len(base) else math.inf
        for s, curve in curves.items()
        if s != BASELINE
    )


def _algorithm_run_figures(outputs: Path, found: FigureSet, time_to_reward_gain: float | None) -> None:
    """The algorithms side by side: GRPO's is the train stage's Retain run, the others its runs of rl.algorithms.
    Each one's eval gain and, given the target's gain, its time to reward: in samples (the same on every machine,
    checked), in CPU seconds and as a ratio to GRPO-Recompute's CPU seconds (the machine's, shown). A target never
    reached leaves the figure absent (the band then reports it missing)."""
    runs = {ALGORITHMS.default: outputs / "train" / GRPO_RUN}
    runs.update({p.name: p for p in sorted((outputs / "algorithms").glob("*")) if p.is_dir()})
    for name, folder in runs.items():
        if run := read_json(folder / "metrics.json"):
            found.add_eval_gain(run, name, "algorithm_eval_reward_gain", "algorithm_gain_over_noise")
    if time_to_reward_gain is None:
        return
    # and the recipe's runs (2 updates a rollout, its exact hybrid): time to reward only
    runs.update({p.name.replace("-", "_"): p for p in sorted((outputs / "train").glob("recipe-*"))})
    baseline_seconds = run_time_to_reward(outputs / "train" / BASELINE, time_to_reward_gain)
    for name, folder in runs.items():
        if read_json(folder / "metrics.json"):
            found.add_time_to_reward(folder, name, time_to_reward_gain, baseline_seconds)


def _bench_figures(outputs: Path, found: FigureSet) -> None:
    """The baseline's iteration time; each Lean schedule's speedup / its bound and peak memory / the baseline's; the
    memory curve's figures against the plan's (Retain's per-step slope, every schedule's optimizer stage)."""
    if not (bench := read_json(outputs / "bench" / "schedules.json")):
        return
    base = bench.get(BASELINE) or {}
    found.add(f"time_iteration_s_{BASELINE}", "time_iteration_s", base.get("time_iteration_s"))
    for s in LEAN_SCHEDULES:
        entry = bench.get(s) or {}
        speedup, bound = _number(entry.get("speedup")), _number(entry.get("speedup_bound"))
        if speedup is not None and bound:
            found.add(f"speedup_vs_bound_{s}", "speedup_vs_bound", speedup / bound)
        peak, base_peak = _number(entry.get("peak_memory_mb")), _number(base.get("peak_memory_mb"))
        if peak is not None and base_peak:
            found.add(f"peak_memory_ratio_{s}", "peak_memory_ratio", peak / base_peak)
    for s in (BASELINE, *LEAN_SCHEDULES):
        entry = bench.get(s) or {}
        measured, planned = _number(entry.get("optimizer_peak_mb")), _number(entry.get("plan_optimizer_peak_mb"))
        if measured is not None and planned:
            found.add(f"optimizer_peak_vs_plan_{s}", "optimizer_peak_vs_plan", measured / planned)
    retain = bench.get(RETAIN) or {}
    slope, planned = (retain.get("memory_curve") or {}).get("slope_mb"), _number(retain.get("plan_memory_slope_mb"))
    if _number(slope) is not None and planned:
        found.add(f"memory_slope_vs_plan_{RETAIN}", "memory_slope_vs_plan", slope / planned)


def _overlap_figures(outputs: Path, found: FigureSet) -> None:
    """Sequence parallelism's compute-only speedups, the overlap ops' exposed communication, the split decode ratio."""
    if not (overlap := read_json(outputs / "overlap" / "metrics.json")):
        return
    # lean.tools.bench.sequence_parallel.flat_metrics: sp_time_iteration_s_<schedule>_compute_only
    base = _number(overlap.get(f"sp_time_iteration_s_{BASELINE}_compute_only"))
    for s in LEAN_SCHEDULES:
        time = _number(overlap.get(f"sp_time_iteration_s_{s}_compute_only"))
        if base is not None and time:
            found.add(f"sp_speedup_{s}", "sp_speedup", base / time)
    for key, value in overlap.items():
        if key.startswith("overlap_exposed_ms_"):
            found.add(key, "overlap_exposed_ms", value)
    found.add("sp_decode_ratio", "sp_decode_ratio", _number(overlap.get("sp_decode_ratio")))


def measured_on(outputs: str | Path) -> dict[str, dict | None]:
    """Per measured group (``bench``, ``overlap``): the machine record its outputs carry (None: none)."""
    found = {}
    for group, parts in MEASURED.items():
        record = (read_json(Path(outputs).joinpath(*parts)) or {}).get("measured_on")
        found[group] = record if isinstance(record, dict) and record else None
    return found


# ---------------------------------------------------------------- the reference


def git_commit(cwd: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def pin(outputs: str | Path, params: Mapping[str, Any], path: str | Path = REFERENCE) -> dict:
    """Writes the reference at ``path`` from the run under ``outputs``: its headline figures, the params sections
    they depend on, where the benchmarks were measured (a group measured before provenance:
    ``lean.observe.provenance.UNKNOWN``, with the torch threads its config recorded) and the commit it was pinned at."""
    figures = headline_figures(outputs, params)
    records = measured_on(outputs)
    if records["bench"] is None:
        threads = ((read_json(Path(outputs) / "bench" / "schedules.json") or {}).get("config") or {}).get("threads")
        records["bench"] = provenance.unknown(**({} if threads is None else {"torch_threads": threads}))
    records = {group: record or provenance.unknown() for group, record in records.items()}
    reference = {
        "about": "The committed headline figures a run's report is checked against (params.yaml report.bands); "
        "refresh with `python -m pipelines.report --pin` when a run's figures become the new reference.",
        "pinned": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
        },
        "measured_on": records,
        "params": {k: params[k] for k in PARAM_SECTIONS if k in params},
        "figures": {name: figure.value for name, figure in figures.items()},
        "families": {name: figure.family for name, figure in figures.items()},
    }
    write_json(path, reference)
    return reference


def load_reference(path: str | Path) -> dict | None:
    reference = read_json(Path(path))
    return reference if reference and isinstance(reference.get("figures"), dict) else None


# ---------------------------------------------------------------- the check


def validate_bands(bands: Mapping[str, Any]) -> None:
    """Every band names a known figure family and only the keys :data:`BAND_KEYS`, with numbers (booleans for
    ``bound`` and ``info``); a ValueError names the first that does not."""
    for family, band in bands.items():
        where = f"report.bands.{family}"
        if family not in FAMILIES:
            raise ValueError(f"{where}: not a figure family (one of {', '.join(FAMILIES)})")
        if not isinstance(band, Mapping) or not band:
            raise ValueError(f"{where}: must be a mapping of {', '.join(BAND_KEYS)}")
        for key, value in band.items():
            if key not in BAND_KEYS:
                raise ValueError(f"{where}.{key}: not a band key (one of {', '.join(BAND_KEYS)})")
            if key in ("bound", "info"):
                if not isinstance(value, bool):
                    raise ValueError(f"{where}.{key}: must be true or false")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{where}.{key}: must be a number")
            elif key in ("abs", "rel") and value < 0:
                raise ValueError(f"{where}.{key}: must be >= 0")


def allowed_range(band: Mapping[str, Any], reference: float | None, bound: float | None) -> tuple[float, float, str]:
    """(low, high, what could not be applied) of a band around ``reference``, capped by the figure's ``bound``."""
    low, high, missing = -math.inf, math.inf, []
    for key in ("abs", "rel"):
        if key in band:
            if reference is None:
                missing.append(f"{key} needs a reference value")
                continue
            width = band[key] * (abs(reference) if key == "rel" else 1.0)
            low, high = max(low, reference - width), min(high, reference + width)
    if "min" in band:
        low = max(low, band["min"])
    if "max" in band:
        high = min(high, band["max"])
    if band.get("bound"):
        if bound is None:
            missing.append("the outputs state no bound")
        else:
            high = min(high, bound)
    return low, high, "; ".join(missing)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested mapping (an empty mapping below the top is a value of its own)."""
    if isinstance(tree, Mapping) and (tree or not prefix):
        return {k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def params_differences(reference: Mapping[str, Any], params: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The entries of :data:`PARAM_SECTIONS` whose value differs (``key: reference value -> this run's``), and those
    only one side has (``key: added`` / ``key: removed``: a key introduced with its default value changes nothing,
    and one that changes the run changes its figures, which the bands check)."""
    theirs = flatten({k: reference[k] for k in PARAM_SECTIONS if k in reference})
    ours = flatten({k: params[k] for k in PARAM_SECTIONS if k in params})
    differ = [
        f"{key}: {theirs[key]!r} -> {ours[key]!r}"
        for key in sorted(set(theirs) & set(ours))
        if theirs[key] != ours[key]
    ]
    one_side = [f"{key}: added" for key in sorted(set(ours) - set(theirs))]
    one_side += [f"{key}: removed" for key in sorted(set(theirs) - set(ours))]
    return differ, one_side


def check(
    outputs: str | Path,
    reference: Mapping[str, Any] | None,
    bands: Mapping[str, Any],
    params: Mapping[str, Any] | None = None,
    here: Mapping[str, Any] | None = None,
    reference_path: str | Path = REFERENCE,
) -> dict:
    """This run's headline figures against ``reference``, each within its band (module docstring); ``params``: the
    run's params.yaml (compared with the reference's, None: not compared); ``here``: this machine's record
    (``lean.observe.provenance.machine()`` when None). Returns the report (``outputs/report/reproduction.json``)."""
    validate_bands(bands)
    here = dict(here) if here is not None else provenance.machine()
    figures = headline_figures(outputs, params)
    ref_figures = dict((reference or {}).get("figures") or {})
    measured = measured_groups(outputs, figures, reference, here)
    ref_families = dict((reference or {}).get("families") or {})
    rows = [
        figure_row(name, figures.get(name), _number(ref_figures.get(name)), bands, measured, ref_families.get(name))
        for name in [*figures, *(n for n in ref_figures if n not in figures)]
    ]
    outside = [
        {k: row.get(k) for k in ("figure", "value", "reference", "band", "allowed", "note")}
        for row in rows
        if row["checked"] and row["inside"] is False
    ]
    compared = reference is not None and params is not None and isinstance(reference.get("params"), Mapping)
    differ, one_side = params_differences(reference["params"], params) if compared else ([], [])
    checked = [r for r in rows if r["checked"]]
    reasons = not_reproduced_reasons(reference is not None, reference_path, differ, bool(checked))
    result = {
        "reproduced": not reasons and not outside,
        "outside_band": outside,
        "reasons": reasons,
        "checked": len(checked),
        "inside": sum(1 for r in checked if r["inside"]),
        "reference": {
            "path": str(reference_path),
            "pinned": (reference or {}).get("pinned"),
        },
        "params_match": not differ if compared else None,
        "params_differ": differ,
        "params_one_side": one_side,
        "this_machine": here,
        "measured": measured,
        "figures": rows,
    }
    result["verdict"] = verdict(result)
    return result


def measured_groups(
    outputs: str | Path, figures: Mapping[str, Figure], reference: Mapping[str, Any] | None, here: Mapping[str, Any]
) -> dict[str, dict]:
    """Per measured group (``bench``, ``overlap``): where its figures were measured, whether that is ``here``,
    whether they are the reference's (``committed``) and the sentence the report shows of it."""
    ref_figures = (reference or {}).get("figures") or {}
    ref_records = (reference or {}).get("measured_on") or {}
    measured = {}
    for group, record in measured_on(outputs).items():
        names = [n for n, f in figures.items() if f.group == group]
        committed = bool(names) and all(_number(ref_figures.get(n)) == figures[n].value for n in names)
        if record is None and committed:  # the committed figures, from before provenance: the reference knows more
            record = ref_records.get(group)
        measured_here = provenance.same_machine(record, here)
        measured[group] = {
            "measured_on": record,
            "reference_measured_on": ref_records.get(group),
            "measured_here": measured_here,
            "committed": committed,
            "shows": measured_source(record, measured_here, committed),
        }
    return measured


def measured_source(record: dict | None, measured_here: bool | None, committed: bool) -> str:
    """Where a group's figures come from, in words (``measured_here`` None: the records cannot tell)."""
    where = provenance.describe(record)
    if measured_here:
        return f"measured on this machine ({where})"
    source = ("the committed figures, measured on " if committed else "measured on ") + where
    source += {False: ", another machine", None: ", perhaps another machine"}[measured_here]
    return source + ": `make bench` re-measures them here"


def figure_row(
    name: str,
    figure: Figure | None,
    reference: float | None,
    bands: Mapping[str, Any],
    measured: Mapping[str, dict],
    reference_family: str | None = None,
) -> dict[str, Any]:
    """The report's row of one figure (absent from this run: ``figure`` None, its family the reference's): its
    value, reference and band, and whether it was checked and is inside its band."""
    family = figure.family if figure else (reference_family if reference_family in FAMILIES else None)
    band = dict(bands.get(family) or {}) if family else {}
    row: dict[str, Any] = {
        "figure": name,
        "group": figure.group if figure else None,
        "what": FAMILIES[family][1] if family else None,
        "value": figure.value if figure else None,
        "reference": reference,
        "band": band or None,
    }
    row.update(band_check(figure, reference, band, family))
    if row["group"] in measured:
        row["measured_here"] = measured[row["group"]]["measured_here"]
    return row


def band_check(figure: Figure | None, reference: float | None, band: Mapping[str, Any], family: str | None) -> dict:
    """A row's ``checked``, ``inside`` and ``note``, and for a checked figure its ``allowed`` range and ``bound``
    (in the report's key order)."""
    if figure is None:
        if band.get("info"):
            return {"checked": False, "inside": None, "note": "missing from this run's outputs (shown, not checked)"}
        return {"checked": True, "inside": False, "note": "missing from this run's outputs"}
    if not band:
        return {"checked": False, "inside": None, "note": f"no band: params.yaml report.bands.{family}"}
    if band.get("info"):
        return {"checked": False, "inside": None, "note": "shown, not checked (machine-dependent)"}
    low, high, missing = allowed_range(band, reference, figure.bound)
    entries: dict[str, Any] = {"allowed": [_finite(low), _finite(high)]}
    if figure.bound is not None:
        entries["bound"] = figure.bound
    entries.update(checked=True, inside=math.isfinite(figure.value) and low <= figure.value <= high)
    if missing:
        unpinned = " (not in the reference: `python -m pipelines.report --pin`)" if reference is None else ""
        entries["note"] = missing + unpinned
    return entries


def not_reproduced_reasons(
    has_reference: bool, reference_path: str | Path, differ: list[str], any_checked: bool
) -> list[str]:
    """Why the run cannot count as a reproduction whatever its figures: no reference, other params, nothing checked."""
    reasons = []
    if not has_reference:
        reasons.append(f"no reference at {reference_path}: pin one with `python -m pipelines.report --pin`")
    if differ:
        reasons.append(f"params differ from the reference's in {len(differ)} entries (an experiment, not a rerun)")
    if not any_checked:
        reasons.append("no figure checked (params.yaml report.bands is empty?)")
    return reasons


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def verdict(result: Mapping[str, Any]) -> str:
    """One line: reproduced or not, what is outside its band, and which benchmark figures the report shows."""
    pinned = (result["reference"].get("pinned") or {}).get("git_commit") or "?"
    head = (
        f"reproduction: {'REPRODUCED' if result['reproduced'] else 'NOT REPRODUCED'}: {result['inside']}/"
        f"{result['checked']} figures inside their bands against {result['reference']['path']} ({pinned[:7]})"
    )
    parts = [head]
    if result["outside_band"]:
        parts.append(
            "outside: "
            + ", ".join(
                f"{o['figure']} {_fmt(o['value'])} (reference {_fmt(o['reference'])}, allowed "
                f"{_fmt((o.get('allowed') or [None, None])[0])}..{_fmt((o.get('allowed') or [None, None])[1])})"
                for o in result["outside_band"]
            )
        )
    parts.extend(result["reasons"])
    if result["params_differ"]:
        parts.append("params: " + ", ".join(d.split(":")[0] for d in result["params_differ"][:6]))
    shows: dict[str, list[str]] = {}
    for group, info in result["measured"].items():
        shows.setdefault(info["shows"], []).append(group)
    parts.extend(f"{' and '.join(groups)}: {text}" for text, groups in shows.items())
    return "; ".join(parts)


def report_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """What the report stage logs to MLflow beside the notebooks' metrics."""
    return {
        "reproduced": float(result["reproduced"]),
        "figures_outside_band": float(len(result["outside_band"])),
        "figures_checked": float(result["checked"]),
    }
