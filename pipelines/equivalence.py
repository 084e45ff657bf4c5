"""Stage ``equivalence``: the three updates' gradients compared tensor by tensor (the objective-equivalence
certificate; ``lean.workbench.method.compare_updates``).

    python -m pipelines.equivalence [--params params.yaml] [--updates outputs/update] [--out outputs/equivalence]

Writes OUT/equivalence.json (the certificate), OUT/metrics.json (max_rel_grad_diff_<schedule>, cosine_<schedule>,
passes) and OUT/per_tensor.csv (relative gradient difference of every trainable tensor per schedule). Fails when the
certificate does not pass.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file

from lean.observe import tracking
from lean.observe.outputs import numbers, write_csv, write_json
from lean.schedules import BASELINE, LEAN_SCHEDULES
from lean.workbench.method import compare_updates
from lean.workbench.stage import begin_stage, stage_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--updates", default="outputs/update")
    p.add_argument("--out", default="outputs/equivalence")
    args = p.parse_args()
    begin_stage(args.params)
    cfg = stage_config(args.params, "method")
    updates = {s: load_file(Path(args.updates) / s / "update.safetensors") for s in (BASELINE, *LEAN_SCHEDULES)}
    report = compare_updates(updates, cfg.model.torch_dtype)
    with tracking.start_run("equivalence", params={"model": {"dtype": cfg.model.dtype}}) as run:
        run.log_metrics({**numbers(report), "passes": float(report["passes"])})
        for schedule in LEAN_SCHEDULES:
            with run.child(f"equivalence[{schedule}]", schedule=schedule) as child:
                child.log_metrics(numbers(report[schedule]))
    out = Path(args.out)
    write_json(out / "equivalence.json", report)
    write_json(out / "metrics.json", {**numbers(report), "passes": report["passes"]})
    names = list(report[LEAN_SCHEDULES[0]]["rel_grad_diff_per_tensor"])
    write_csv(
        out / "per_tensor.csv",
        [{"tensor": n, **{s: report[s]["rel_grad_diff_per_tensor"][n] for s in LEAN_SCHEDULES}} for n in names],
    )
    print(
        f"equivalence: {'PASS' if report['passes'] else 'FAIL'} "
        + ", ".join(f"{s} max rel grad diff {report[s]['max_rel_grad_diff']:.2e}" for s in LEAN_SCHEDULES)
    )
    if not report["passes"]:
        raise SystemExit("equivalence: the certificate does not pass")


if __name__ == "__main__":
    main()
