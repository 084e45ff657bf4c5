"""`lean train` end to end on CPU: both families, float64, the outputs a run must write."""

import json

import pytest
import torch
from helpers import lean_here, tiny
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


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    """``train`` of ``tiny(family, schedule, 2 iterations)``, once per (family, schedule) the module asks for (the
    FLUX Recompute run is read by two tests): returns (its history, its folder)."""
    runs = {}

    def run(family: str, schedule: str):
        if (family, schedule) not in runs:
            cfg = tiny(f"model.family={family}", f"train.schedule={schedule}", "train.iterations=2")
            out = tmp_path_factory.mktemp(f"{family}_{schedule}")
            runs[family, schedule] = (train(cfg, out=str(out)), out)
        return runs[family, schedule]

    return run


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_train_writes_metrics_and_lora(two_iterations, family):
    """Two iterations write metrics.json with every key (FLOPs by region), metrics.csv, and a finite LoRA."""
    history, run = two_iterations(family, "recompute")
    assert len(history) == 2
    metrics = json.loads((run / "metrics.json").read_text())
    for key in METRIC_KEYS:
        assert key in metrics, key
    assert len(metrics["reward_mean"]) == 2 and metrics["flops_per_iteration"] > 0
    assert metrics["flops_by_region"]["recompute_forward"] > 0 and metrics["flops_by_region"]["backward"] > 0
    lora = load_file(run / "lora.safetensors")
    assert lora and all(torch.isfinite(v).all() for v in lora.values())
    assert not (run / "lora_ema.safetensors").exists()  # only with ema.enabled (tests/test_ema.py)
    assert (run / "metrics.csv").read_text().count("\n") == 3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("schedule", ["recompute", "retain", "reweight"])
def test_float64_end_to_end(family, schedule, tmp_path):
    history = train(
        tiny(f"model.family={family}", "model.dtype=float64", f"train.schedule={schedule}", "algorithm.beta=0.01"),
        out=str(tmp_path),
    )
    assert all(torch.isfinite(torch.tensor(h["reward_mean"])) for h in history)
    latents = load_file(tmp_path / "rollout.safetensors")["latents"]
    assert latents.dtype == torch.float64


@pytest.mark.timeout(240)
def test_training_changes_the_adapter_and_learns_direction(two_iterations):
    """Two Retain updates, each on-policy (ratio 1, so the logged loss is -mean(A)), with a nonzero gradient (the run
    the FLOPs test below reads too)."""
    history, _ = two_iterations("flux", "retain")
    assert all(abs(h["ratio_mean"] - 1) < 1e-6 for h in history)
    assert history[-1]["grad_norm"] > 0


@pytest.mark.timeout(300)
def test_cli_train_default_params(tmp_path):
    """The README's `lean train` with a params file and overrides (the CLI in this process: `python -m lean.cli` starts
    in tests/test_config.py and test_reliability.py)."""
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  iterations: 1\n  prompts_per_iteration: 2\n  group_size: 2\nsample:\n  num_steps: 3\n")
    lean_here("train", "--params", str(params), "--set", "train.schedule=auto", "--out", str(tmp_path / "out"))
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["auto"]["choice"] in ("retain", "reweight") and metrics["schedule"] == metrics["auto"]["choice"]
    assert metrics["auto"]["layout"] in ("slice", "group")  # parallel.layout: auto, weighed too (shared: 2+ ranks)


@pytest.mark.timeout(120)
def test_a_prompt_drawn_twice_gives_two_different_groups():
    """More groups than prompts: the same prompt is drawn for two groups, whose trajectories must still differ."""
    from lean.parallel.distributed import World
    from lean.run.iteration import build_pipeline
    from lean.schedules import BASELINE, SCHEDULES

    cfg = tiny("train.prompts=[a red circle on a white background]", "train.prompts_per_iteration=2")
    pipeline = build_pipeline(cfg, World())
    rolled = pipeline.roll_out(0, SCHEDULES[BASELINE])
    assert [p for _, p, _ in rolled.batch.samples] == [0, 0, 0, 0]  # one prompt, groups 0 and 1
    group_0, group_1 = rolled.final[:2], rolled.final[2:]
    assert not torch.allclose(group_0, group_1)


# ---------------------------------------------------------------- FLOPs counted in the first iteration (#13 item 10)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["recompute", "retain", "reweight"])
def test_flops_counted_in_the_first_iteration_equal_an_extra_iterations(two_iterations, schedule):
    """`lean train` counts FLOPs during its first iteration; the numbers are those of the extra, undone iteration
    it used to run after the loop (``count_iteration_flops`` at the last iteration), and the counted iteration's
    times stay out of the summary's medians."""
    import csv

    from lean.train import Trainer, count_iteration_flops, needed_flops

    cfg = tiny(f"train.schedule={schedule}", "train.iterations=2")
    _, run = two_iterations("flux", schedule)
    metrics = json.loads((run / "metrics.json").read_text())
    trainer = Trainer(cfg)  # the previous procedure: the run's iterations, then one more under the counter
    for it in range(cfg.train.iterations):
        trainer.iteration(it, schedule)
    expected = count_iteration_flops(trainer, schedule, cfg.train.iterations - 1)
    assert metrics["flops_by_region"] == expected and expected["backward"] > 0
    assert metrics["flops_per_iteration"] == sum(expected.values())
    assert metrics["flops_needed_per_iteration"] == needed_flops(expected)
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["flops_counted"] for r in rows] == ["1", ""]
    assert metrics["time_iteration_s"] == float(rows[1]["time_iteration_s"])


# ---------------------------------------------------------------- the sigma grid's shift from a pretrained folder


@pytest.fixture(scope="module")
def tiny_flux_folder(tmp_path_factory):
    """A tiny FLUX pipeline folder (no scheduler/ yet), as ``Policy.save_pretrained`` writes it."""
    from lean.models import build_policy

    cfg = tiny()
    folder = tmp_path_factory.mktemp("pretrained") / "flux"
    build_policy(cfg.model, cfg.train.prompts).save_pretrained(folder, adapter=False)
    return folder


def with_scheduler(folder, tmp_path, config: dict) -> str:
    """A copy of ``folder`` with ``config`` as its scheduler/scheduler_config.json."""
    import shutil

    copy = tmp_path / "pretrained"
    shutil.copytree(folder, copy)
    (copy / "scheduler").mkdir()
    (copy / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    return str(copy)


@pytest.mark.timeout(120)
def test_shift_comes_from_the_pretrained_scheduler_config_unless_set(tiny_flux_folder, tmp_path):
    from lean.sampling.sde import sigma_schedule
    from lean.train import Trainer

    folder = with_scheduler(
        tiny_flux_folder, tmp_path, {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 2.5}
    )
    for overrides, shift in (([], 2.5), (["sample.shift=1.5"], 1.5)):  # the user's value wins
        trainer = Trainer(tiny(f"model.pretrained={folder}", *overrides))
        s = trainer.cfg.sample
        assert s.shift == shift
        assert torch.equal(trainer.pipeline.sigmas, sigma_schedule(s.num_steps, shift, s.sigma_grid))
        assert ("scheduler_config.json" in trainer.pipeline.shift_source) == (not overrides)


@pytest.mark.timeout(120)
def test_flux_dynamic_shifting_gives_e_to_the_mu_of_the_run_token_count(tiny_flux_folder, tmp_path):
    """FluxPipeline's calculate_shift: mu linear in the image sequence length, base_shift at base_image_seq_len to
    max_shift at max_image_seq_len; the shift is e^mu."""
    import math

    from lean.train import Trainer

    scheduler = {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "shift": 3.0,  # unused with dynamic shifting
        "use_dynamic_shifting": True,
        "base_shift": 0.3,
        "max_shift": 1.2,
        "base_image_seq_len": 4,
        "max_image_seq_len": 64,
    }
    trainer = Trainer(tiny(f"model.pretrained={with_scheduler(tiny_flux_folder, tmp_path, scheduler)}"))
    tokens = trainer.policy.runtime.latent_shape[0]  # FLUX's packed image tokens: 32 px -> 8x8 latent -> 16
    assert tokens == 16
    mu = 0.3 + (1.2 - 0.3) * (tokens - 4) / (64 - 4)
    assert trainer.cfg.sample.shift == pytest.approx(math.exp(mu), rel=1e-12)


@pytest.mark.timeout(120)
def test_family_defaults_without_a_folder():
    """No folder: the family's published scheduler config (FLUX.1-dev's dynamic shift, SD3.5's and Wan's 3)."""
    import math

    from lean.models import time_shift

    assert time_shift("sd3", None, None, 4096) == (3.0, "SD3's published scheduler config")
    assert time_shift("wan", None, None, 100)[0] == 3.0
    assert time_shift("flux", None, None, 4096)[0] == pytest.approx(math.exp(1.15), rel=1e-12)
    assert time_shift("flux", None, 2.0, 4096) == (2.0, "sample.shift")


@pytest.mark.timeout(120)
def test_cli_banner_says_what_was_loaded_and_threads_apply(tiny_flux_folder, tmp_path, capsys):
    """The start-up line names the folder, the transformer's parameter counts and the shift with its source;
    config.json logs the resolved shift; --threads sets torch's threads."""
    from lean.cli import main

    folder = with_scheduler(tiny_flux_folder, tmp_path, {"shift": 2.5})
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  iterations: 1\n  prompts_per_iteration: 2\n  group_size: 2\nsample:\n  num_steps: 3\n")
    before = torch.get_num_threads()
    try:
        args = ["train", "--params", str(params), "--set", f"model.pretrained={folder}", "--threads", "1"]
        assert main([*args, "--out", str(tmp_path / "out")]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    banner = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("lean train:"))
    assert f"flux/tiny float32 from {folder}" in banner and "trained: LoRA r8" in banner
    assert "shift 2.5 (" in banner and "scheduler_config.json" in banner
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["sample"]["shift"] == 2.5 and config["train"]["threads"] == 1
    assert main(["train", "--params", str(params), "--threads", "0", "--out", str(tmp_path / "x")]) == 2
    assert "train.threads" in capsys.readouterr().err
