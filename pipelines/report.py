"""Stage ``report``: this run's headline figures against the committed reference (``lean.workbench.reproduction``),
then papermill executes the notebooks on the pipeline's outputs, side by side (one child process each,
``workbench.parallel_runs`` at once, ``lean.workbench.side_by_side``: a notebook's time is mostly its kernel's start
and imports, one core each); each notebook logs its figures and metrics to its own MLflow run (nested under this
stage's run), and the executed copy is added to that run.

    python -m pipelines.report [--params params.yaml] [--outputs outputs] [--out outputs/report] [--reference PATH]
    python -m pipelines.report --check      # the reproduction check alone (no notebooks): OUT/reproduction.json
    python -m pipelines.report --pin        # the reference := the headline figures under --outputs (commit it)
    python -m pipelines.report --notebook training [--parent-run-id ID]   # one notebook (what each child runs)

Writes OUT/reproduction.json (``reproduced``, ``outside_band``: each figure outside its band, and the per-figure table
with bands, references and where the benchmark figures were measured), OUT/notebooks/<name>.ipynb (executed),
OUT/notebooks/<name>.json (the notebook's metrics and run id), OUT/notebook_<name>.log (its child's output) and
OUT/metrics.json (every notebook's metrics, flat, with ``reproduced`` 1/0 and ``figures_outside_band``). Prints a
one-line verdict last. A run that does not reproduce the reference is a finding, not a failure: the stage succeeds
either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lean.observe import tracking
from lean.observe.outputs import write_json
from lean.workbench import reproduction
from lean.workbench.side_by_side import RunFailed, parallel_runs, run_side_by_side
from lean.workbench.stage import begin_stage

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def check_reproduction(params: dict, outputs: str, out: Path, reference: str) -> dict:
    """The reproduction check of the run under ``outputs``, written to OUT/reproduction.json."""
    section = params.get("report") or {}
    result = reproduction.check(
        outputs,
        reproduction.load_reference(reference),
        section.get("bands") or {},
        params=params,
        reference_path=reference,
    )
    write_json(out / "reproduction.json", result)
    return result


def notebook_parameters(params: dict, name: str) -> dict:
    """What a notebook reads from params.yaml beside the outputs (the training notebook: its time-to-reward target)."""
    gain = (params.get("rl") or {}).get("time_to_reward_gain")
    return {"time_to_reward_gain": gain} if name == "training" and gain is not None else {}


def execute_notebook(params: dict, name: str, outputs: str, out: Path, parent_run_id: str | None) -> None:
    """papermill executes notebooks/<name>.ipynb on ``outputs`` into OUT/notebooks/<name>.ipynb; the notebook writes
    its metrics and MLflow run id to OUT/notebooks/<name>.json."""
    import papermill

    papermill.execute_notebook(
        str(NOTEBOOKS / f"{name}.ipynb"),
        str(out / "notebooks" / f"{name}.ipynb"),
        cwd=str(NOTEBOOKS),
        progress_bar=False,
        parameters={
            "outputs": str(Path(outputs).resolve()),
            "track": tracking.enabled(),
            "parent_run_id": parent_run_id,
            "summary_path": str((out / "notebooks" / f"{name}.json").resolve()),
            **notebook_parameters(params, name),
        },
    )


def execute_side_by_side(args: argparse.Namespace, params: dict, names: list[str], parent_run_id: str | None) -> None:
    """Every notebook as a child process of this module (``--notebook``), ``workbench.parallel_runs`` at once."""
    out = Path(args.out)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    one = [
        sys.executable,
        "-m",
        "pipelines.report",
        "--params",
        args.params,
        "--outputs",
        args.outputs,
        "--out",
        args.out,
    ]
    one += ["--parent-run-id", parent_run_id] if parent_run_id else []
    commands = {name: [*one, "--notebook", name] for name in names}
    logs = {name: out / f"notebook_{name}.log" for name in names}
    try:
        run_side_by_side(commands, logs, parallel_runs(params, default=len(names)))
    except (RunFailed, ValueError) as err:
        raise SystemExit(f"report: {err}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--outputs", default="outputs", help="the pipeline's outputs, which the notebooks read")
    p.add_argument("--out", default="outputs/report")
    p.add_argument("--reference", default=None, help="the committed reference (default: params report.reference)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only the reproduction check; no notebooks, no MLflow")
    mode.add_argument("--pin", action="store_true", help="write the reference from --outputs' figures, then exit")
    mode.add_argument("--notebook", default=None, help="execute this notebook alone (no check, no report run)")
    p.add_argument("--parent-run-id", default=None, help="with --notebook: the report run to nest its MLflow run in")
    args = p.parse_args()

    params = begin_stage(args.params)
    if args.notebook is not None:
        execute_notebook(params, args.notebook, args.outputs, Path(args.out), args.parent_run_id)
        return
    section = params.get("report") or {}
    reference = args.reference or section.get("reference") or reproduction.REFERENCE
    out = Path(args.out)
    if args.pin:
        pinned = reproduction.pin(args.outputs, params, reference)
        print(f"report: pinned {len(pinned['figures'])} figures of {args.outputs} as the reference {reference}")
        return
    result = check_reproduction(params, args.outputs, out, reference)
    if args.check:
        print(result["verdict"], flush=True)
        return
    notebooks = out / "notebooks"
    metrics: dict[str, float] = {}
    with tracking.start_run("report", params={"report": section}) as run:
        execute_side_by_side(args, params, list(section.get("notebooks", [])), run.run_id)
        for name in section.get("notebooks", []):  # in params' order: the metrics as one process would merge them
            executed, summary_path = notebooks / f"{name}.ipynb", notebooks / f"{name}.json"
            summary = json.loads(summary_path.read_text())
            tracking.attach(summary["run_id"]).log_artifact(executed, "notebook")
            metrics.update(summary["metrics"])
            print(f"report: {name}: {len(summary['metrics'])} metrics", flush=True)
        metrics.update(reproduction.report_metrics(result))
        run.log_metrics(metrics)
        run.set_tags({"lean.reproduced": result["reproduced"]})
        run.log_artifact(out / "reproduction.json", "reproduction")
    write_json(out / "metrics.json", metrics)
    print(result["verdict"], flush=True)


if __name__ == "__main__":
    main()
