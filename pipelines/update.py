"""Stage ``update@<schedule>``: one GRPO update from the persisted iteration (``lean.workbench.method.run_update``).

    python -m pipelines.update --schedule retain --pretrained outputs/prepare/base [--params params.yaml]
        [--rollout outputs/rollout] [--advantage outputs/advantage] [--out outputs/update/retain]

Recompute consumes the persisted steps; Retain and Reweight re-run the rollout in this process (a graph cannot cross
processes) and report whether it reproduced the persisted trajectory. Writes OUT/update.safetensors (gradient, weights
before and after the step) and OUT/metrics.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file, save_file

from lean.observe import tracking
from lean.observe.outputs import numbers, write_json
from lean.schedules import SCHEDULES
from lean.workbench.method import run_update
from lean.workbench.stage import begin_stage, stage_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", required=True, choices=list(SCHEDULES))
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--rollout", default="outputs/rollout")
    p.add_argument("--advantage", default="outputs/advantage")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    params = begin_stage(args.params)
    cfg = stage_config(args.params, "method", pretrained=args.pretrained, schedule=args.schedule)
    trajectory = load_file(Path(args.rollout) / "trajectory.safetensors")
    advantages = load_file(Path(args.advantage) / "advantages.safetensors")["advantages"]
    with tracking.start_run(f"update[{args.schedule}]", schedule=args.schedule, params=cfg.to_dict()) as run:
        tensors, summary = run_update(
            cfg, args.schedule, trajectory, advantages, float(params["method"]["perturb_std"])
        )
        run.log_metrics(numbers(summary))
    if summary.get("reproduces_trajectory") is False:
        raise SystemExit(f"update[{args.schedule}]: the re-run rollout differs from the persisted one: {summary}")
    out = Path(args.out or f"outputs/update/{args.schedule}")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "update.safetensors")
    write_json(out / "metrics.json", summary)
    print(f"update[{args.schedule}]: {summary}")


if __name__ == "__main__":
    main()
