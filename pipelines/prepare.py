"""Stage ``prepare``: the synthetic data set and the pretrained base policy (``lean.workbench.data``,
``lean.workbench.pretrain``).

    python -m pipelines.prepare [--params params.yaml] [--out outputs/prepare]

Writes OUT/base/ (a diffusers pipeline folder that ``model.pretrained`` loads), OUT/metrics.json, and the loss
curves OUT/vae_loss.csv, OUT/flow_loss.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from lean.observe import tracking
from lean.observe.outputs import write_csv, write_json
from lean.workbench.pretrain import PretrainConfig, pretrain
from lean.workbench.stage import begin_stage, stage_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default="outputs/prepare")
    args = p.parse_args()
    params = begin_stage(args.params)
    model = stage_config(args.params).model
    cfg = PretrainConfig.from_dict(params.get("prepare") or {})
    out = Path(args.out)
    start = time.perf_counter()
    with tracking.start_run(
        "prepare", params={"model": dataclasses.asdict(model), "prepare": dataclasses.asdict(cfg)}
    ) as run:

        def log(phase: str, metrics: dict, step: int) -> None:
            if step % 10 == 0:
                run.log_metrics(metrics, step=step)

        result = pretrain(model, cfg, out / "base", log=log)
        summary = {**result["summary"], "seconds": time.perf_counter() - start}
        run.log_metrics(summary)
    write_json(out / "metrics.json", summary)
    write_csv(out / "vae_loss.csv", [{"step": i, "vae_mse": v} for i, v in enumerate(result["vae_mse"])])
    write_csv(out / "flow_loss.csv", [{"step": i, "flow_loss": v} for i, v in enumerate(result["flow_loss"])])
    print(f"prepare: {summary}")


if __name__ == "__main__":
    main()
