"""`lean train` end to end on CPU: both families, float64, the outputs a run must write."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import tiny
from safetensors.torch import load_file

from lean.train import train

METRIC_KEYS = [
    "reward_mean",
    "time_rollout_s",
    "time_reward_s",
    "time_advantage_s",
    "time_update_s",
    "time_iteration_s",
    "peak_memory_mb",
    "flops_per_iteration",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_train_writes_metrics_and_lora(tmp_path, family):
    history = train(tiny(f"model.family={family}", "train.iterations=2"), out=str(tmp_path / "run"))
    assert len(history) == 2
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in METRIC_KEYS:
        assert key in metrics, key
    assert len(metrics["reward_mean"]) == 2 and metrics["flops_per_iteration"] > 0
    assert metrics["flops_by_region"]["recompute_forward"] > 0 and metrics["flops_by_region"]["backward"] > 0
    lora = load_file(tmp_path / "run" / "lora.safetensors")
    assert lora and all(torch.isfinite(v).all() for v in lora.values())
    assert not (tmp_path / "run" / "lora_ema.safetensors").exists()  # only with train.ema (tests/test_ema.py)
    assert (tmp_path / "run" / "metrics.csv").read_text().count("\n") == 3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("schedule", ["recompute", "retain", "reweight"])
def test_float64_end_to_end(family, schedule, tmp_path):
    history = train(
        tiny(f"model.family={family}", "model.dtype=float64", f"train.schedule={schedule}", "train.beta=0.01"),
        out=str(tmp_path),
    )
    assert all(torch.isfinite(torch.tensor(h["reward_mean"])) for h in history)
    latents = load_file(tmp_path / "rollout.safetensors")["latents"]
    assert latents.dtype == torch.float64


@pytest.mark.timeout(240)
def test_training_changes_the_adapter_and_learns_direction(tmp_path):
    """Two updates move the LoRA weights; the logged loss equals -mean(A) on-policy (ratio 1)."""
    history = train(tiny("train.iterations=2", "train.schedule=retain", "train.lr=1e-3"), out=str(tmp_path))
    assert all(abs(h["ratio_mean"] - 1) < 1e-6 for h in history)
    assert history[-1]["grad_norm"] > 0


@pytest.mark.timeout(300)
def test_cli_train_default_params(tmp_path):
    """The README's `lean train` with a params file and overrides."""
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  iterations: 1\n  prompts_per_iteration: 2\n  group_size: 2\nsample:\n  num_steps: 3\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lean.cli",
            "train",
            "--params",
            str(params),
            "--set",
            "train.schedule=auto",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["auto"]["choice"] in ("retain", "reweight") and metrics["schedule"] == metrics["auto"]["choice"]


@pytest.mark.timeout(120)
def test_a_prompt_drawn_twice_gives_two_different_groups():
    """More groups than prompts: the same prompt is drawn for two groups, whose trajectories must still differ."""
    from lean.iteration import IterationPipeline
    from lean.models import build_policy
    from lean.schedules import BASELINE, SCHEDULES
    from lean.sde import sigma_schedule

    cfg = tiny("train.prompts=[a red circle on a white background]", "train.prompts_per_iteration=2")
    pipeline = IterationPipeline(
        build_policy(cfg.model, cfg.train.prompts),
        cfg,
        sigma_schedule(cfg.sample.num_steps, cfg.sample.shift, cfg.sample.sigma_grid),
    )
    rolled = pipeline.roll_out(0, SCHEDULES[BASELINE])
    assert [p for _, p, _ in rolled.batch.samples] == [0, 0, 0, 0]  # one prompt, groups 0 and 1
    group_0, group_1 = rolled.final[:2], rolled.final[2:]
    assert not torch.allclose(group_0, group_1)
