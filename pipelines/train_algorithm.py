"""Stage ``train_algorithm@<algorithm>``: one run of an algorithm on the workbench task, from the same base as the
``train`` stage's GRPO runs (``rl.run``), with the algorithm's own keys on top (``rl.<algorithm>.run``: its name, its
schedule: Retain where exact, else its own update, and what it needs to learn at this budget). GRPO itself is the
``train`` stage's ``retain`` run; the training notebook and the report put them side by side
(``eval_reward_gain_<algorithm>``).

    python -m pipelines.train_algorithm --algorithm nft --pretrained outputs/prepare/base [--params params.yaml]
                                        [--out outputs/algorithms/nft]

Writes what a ``train`` run writes (metrics.json, metrics.csv, eval.csv, eval/<iteration>/, lora.safetensors, ...).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lean.algorithms import ALGORITHMS
from lean.observe.outputs import write_csv
from lean.workbench.stage import begin_stage, stage_config
from pipelines.train import EVAL_COLUMNS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", required=True, choices=list(ALGORITHMS))
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--out", default=None, help="default: outputs/algorithms/<algorithm>")
    args = p.parse_args()
    from lean.train import train  # after the argument check: a wrong name answers at once

    out = Path(args.out or f"outputs/algorithms/{args.algorithm}")
    begin_stage(args.params)
    cfg = stage_config(args.params, "rl", pretrained=args.pretrained, variant=args.algorithm)
    if cfg.algorithm.name != args.algorithm:
        raise SystemExit(f"train_algorithm: rl.{args.algorithm}.run sets algorithm.name={cfg.algorithm.name}")
    history = train(cfg, out=str(out))
    if not cfg.eval.every:
        write_csv(out / "eval.csv", [], fields=EVAL_COLUMNS)
        (out / "eval").mkdir(exist_ok=True)
    print(f"train_algorithm[{args.algorithm}]: reward " + " ".join(f"{row['reward_mean']:.4f}" for row in history))


if __name__ == "__main__":
    main()
