"""Stage ``advantage``: group-relative advantages of the persisted rewards and their statistics.

    python -m pipelines.advantage [--params params.yaml] [--rollout outputs/rollout] [--out outputs/advantage]

Writes OUT/advantages.safetensors, OUT/metrics.json and OUT/samples.csv (group, reward, advantage per sample).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file, save_file

from lean.observe import tracking
from lean.observe.outputs import numbers, write_csv, write_json
from lean.workbench.method import run_advantage
from lean.workbench.stage import begin_stage, stage_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--rollout", default="outputs/rollout")
    p.add_argument("--out", default="outputs/advantage")
    args = p.parse_args()
    begin_stage(args.params)
    cfg = stage_config(args.params, "method")
    trajectory = load_file(Path(args.rollout) / "trajectory.safetensors")
    tensors, summary, rows = run_advantage(cfg, trajectory)
    with tracking.start_run(
        "advantage",
        params={"train": {"global_std": cfg.algorithm.global_std, "adv_clip_max": cfg.algorithm.adv_clip_max}},
    ) as run:
        run.log_metrics(numbers(summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "advantages.safetensors")
    write_json(out / "metrics.json", summary)
    write_csv(out / "samples.csv", rows)
    print(f"advantage: |A| <= {summary['advantage_abs_max']:.3f}, zero-std groups {summary['zero_std_fraction']:.0%}")


if __name__ == "__main__":
    main()
