"""Stage ``rollout``: one iteration's trajectories from the base policy, with gradients on the trained steps, the
rewards, and the per-step activation memory probe (``lean.workbench.method.run_rollout``).

    python -m pipelines.rollout --pretrained outputs/prepare/base [--params params.yaml] [--out outputs/rollout]

Writes OUT/trajectory.safetensors (what Recompute consumes: x_i, x_{i+1}, log p_old per trained step; the plan, x_T,
rewards), OUT/metrics.json and OUT/steps.csv (one row per sampling step).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import save_file

from lean.observe import tracking
from lean.observe.outputs import numbers, write_csv, write_json
from lean.workbench.method import run_rollout
from lean.workbench.stage import begin_stage, stage_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--pretrained", default=None, help="base model folder (the prepare stage's output)")
    p.add_argument("--out", default="outputs/rollout")
    args = p.parse_args()
    params = begin_stage(args.params)
    cfg = stage_config(args.params, "method", pretrained=args.pretrained)
    perturb = float(params["method"]["perturb_std"])
    with tracking.start_run("rollout", params=cfg.to_dict()) as run:
        tensors, summary, steps = run_rollout(cfg, perturb)
        run.log_metrics(numbers(summary))
        for row in steps:
            run.log_metrics({"activation_mb": row["activation_mb"]}, step=row["step"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "trajectory.safetensors")
    write_json(out / "metrics.json", summary)
    write_csv(out / "steps.csv", steps)
    print(
        f"rollout: reward {summary['reward_mean']:.4f} over {summary['samples']} samples, "
        f"{summary['activation_mb_per_trained_step']:.2f} MiB of activations per trained step"
    )


if __name__ == "__main__":
    main()
