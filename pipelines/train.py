"""Stage ``train@<schedule>``: a GRPO run of ``rl`` iterations from the pretrained base (``lean.train.train``, which
logs every iteration to MLflow when tracking is on).

    python -m pipelines.train --schedule retain --pretrained outputs/prepare/base [--params params.yaml]
        [--out outputs/train/retain]

Writes OUT/metrics.json, OUT/metrics.csv (one row per iteration: the reward curve), OUT/lora.safetensors (with
train.ema also OUT/lora_ema.safetensors), OUT/rollout.safetensors, OUT/config.json, and the evaluations
(``rl.run.eval``): OUT/eval.csv (one row per evaluation: the eval-reward curve) and OUT/eval/<iteration>/ (images,
grid, samples.csv). With evaluation off, eval.csv is its header alone and eval/ is empty: the stage's declared
outputs exist either way, and the report says there is nothing to show.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lean.outputs import write_csv
from lean.schedules import SCHEDULE_CHOICES
from lean.train import train
from lean.workbench.stage import begin_stage, stage_config

EVAL_COLUMNS = ["iteration", "eval_reward_mean", "eval_reward_std"]  # the header of an eval.csv without evaluations


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", required=True, choices=SCHEDULE_CHOICES)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    begin_stage(args.params)
    cfg = stage_config(args.params, "rl", pretrained=args.pretrained, schedule=args.schedule)
    out = Path(args.out or f"outputs/train/{args.schedule}")
    history = train(cfg, out=str(out))
    if not cfg.eval.every:
        write_csv(out / "eval.csv", [], fields=EVAL_COLUMNS)
        (out / "eval").mkdir(exist_ok=True)
    print(f"train[{args.schedule}]: reward " + " ".join(f"{row['reward_mean']:.4f}" for row in history))


if __name__ == "__main__":
    main()
