"""Stage ``equivalence_bf16``: the certificate in bfloat16 (``lean.tools.equivalence.run_equivalence``): every
schedule's gradient against the float64 on-policy gradient of its own trajectories, and what rounding does to the
baseline's clipped surrogate.

    python -m pipelines.equivalence_bf16 [--params params.yaml] [--out outputs/equivalence_bf16]

The config is the ``method`` stages' with ``model.dtype: bfloat16`` (random weights: rounding, not learning, is what
is measured). Writes OUT/equivalence.json (the report) and OUT/metrics.json (flat: bf16_rel_l2_<schedule>,
bf16_tolerance, bf16_clipped_fraction, bf16_clipped_gradient_norm_fraction, bf16_passes). Fails when it does not pass.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lean.config.dtypes import dtype_name
from lean.observe import tracking
from lean.observe.outputs import write_json
from lean.tools.equivalence import half_tolerance, passes, run_equivalence
from lean.workbench.stage import begin_stage, stage_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default="outputs/equivalence_bf16")
    args = p.parse_args()
    begin_stage(args.params)
    cfg = stage_config(args.params, "method", dtype=dtype_name(torch.bfloat16))
    report = run_equivalence(cfg)
    report["passes"] = passes(report, cfg.model.torch_dtype)
    rounding = report["rounding"]
    metrics = {f"bf16_rel_l2_{s}": r["rel_norm_diff"] for s, r in report["reference"].items()}
    metrics.update(
        bf16_tolerance=half_tolerance(rounding["forward_error"])[0],
        bf16_clipped_fraction=rounding["rounding_clipped_fraction"],
        bf16_clipped_gradient_norm_fraction=rounding["clipped_gradient_norm_fraction"],
        bf16_ratio_max_dev=rounding["ratio_max_dev"],
        bf16_passes=float(report["passes"]),
    )
    with tracking.start_run("equivalence_bf16", params={"model": {"dtype": cfg.model.dtype}}) as run:
        run.log_metrics(metrics)
    out = Path(args.out)
    write_json(out / "equivalence.json", report)
    write_json(out / "metrics.json", metrics)
    print(
        "equivalence_bf16: "
        + ("PASS" if report["passes"] else "FAIL")
        + ", "
        + ", ".join(f"{k} {v:.3g}" for k, v in metrics.items())
    )
    if not report["passes"]:
        raise SystemExit("equivalence_bf16: the certificate does not pass")


if __name__ == "__main__":
    main()
