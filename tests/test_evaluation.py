"""Evaluation during `lean train` (lean/evaluation.py): when it runs, what it writes and logs, fixed noise, the EMA
weights, video GIFs, the shares of data-parallel processes, and its config keys."""

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny
from PIL import Image

from lean import checkpoint
from lean.config import ConfigError
from lean.configure import load_config
from lean.evaluation import Evaluator, eval_iterations, eval_runtime, pad_share, share, unpad_shares
from lean.export import sampling_settings
from lean.models.footprint import component_config
from lean.models.registry import family_spec
from lean.observe import tracking
from lean.parallel.distributed import World
from lean.run.iteration import build_pipeline
from lean.train import Trainer, config_changes, eval_summary, evaluate, train

# two prompts x two samples, two Euler steps: an evaluation of the tiny model takes about a second
EVAL = (
    "eval.every=1",
    "eval.prompts=[a red circle on a white background, a green square on a black background]",
    "eval.samples_per_prompt=2",
    "eval.num_steps=2",
    "eval.batch_size=3",  # not a multiple of the 4 samples: the last batch is short
)

FASTER = ("sample.num_steps=2",)  # two rollout steps for the tests that train


def _pixels(folder, name="p001_s01.png"):
    with Image.open(folder / name) as image:
        return torch.tensor(list(image.getdata()))


def test_eval_iterations_and_shares():
    assert eval_iterations(0, 5) == []
    assert eval_iterations(2, 5) == [0, 2, 4, 5]
    assert eval_iterations(1, 2) == [0, 1, 2]
    assert eval_iterations(7, 3) == [0, 3]
    for n in range(1, 8):
        for size in (1, 2, 3):
            shares = [share(n, r, size) for r in range(size)]
            assert [i for s in shares for i in range(n)[s]] == list(range(n))  # contiguous, in rank order
            rows = torch.arange(n * 2, dtype=torch.float64).view(n, 2)
            padded = torch.cat([pad_share(rows[s], n, size) for s in shares])  # what World.gather returns
            assert torch.equal(unpad_shares(padded, n, size), rows)


def test_bad_eval_keys_are_one_line_errors(tmp_path):
    for override, key in [
        ("eval.every=-1", "eval.every"),
        ("eval.samples_per_prompt=0", "eval.samples_per_prompt"),
        ("eval.num_steps=0", "eval.num_steps"),
        ("eval.prompts=[]", "eval.prompts"),
        ("eval.noise_seeds=1", "eval.noise_seeds"),  # one seed has no spread
        ("eval.noise_seeds=-1", "eval.noise_seeds"),
        (f"eval.prompts_file={tmp_path / 'missing.txt'}", "eval.prompts_file"),
        ("eval.evry=1", "eval.evry"),
        ("eval.images_every=0", "eval.images_every"),
        ("train.memory_every=0", "train.memory_every"),
        ("eval.resolution=40", "eval.resolution"),  # a multiple of 16, as model.resolution
        ("eval.num_frames=0", "eval.num_frames"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert key in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "eval.txt").write_text("a blue circle on a red background\n\n")
    assert load_config(None, [f"eval.prompts_file={tmp_path / 'eval.txt'}"]).eval.prompts == [
        "a blue circle on a red background"
    ]


def test_resume_guard_reads_eval_keys():
    cfg = tiny("eval.every=2")
    before_eval = {k: v for k, v in cfg.to_dict().items() if k != "eval"}  # a checkpoint from before the section
    assert config_changes(before_eval, tiny()) == []
    assert config_changes(before_eval, cfg) == []  # eval.every changes where the run evaluates, not what it trains
    assert config_changes(cfg.to_dict(), tiny("eval.every=2", "eval.seed=1")) == ["eval.seed: 0 -> 1"]
    before_noise = {**cfg.to_dict(), "eval": {k: v for k, v in cfg.to_dict()["eval"].items() if k != "noise_seeds"}}
    assert config_changes(before_noise, cfg) == []  # a key added since the checkpoint: it ran with the default


@pytest.mark.timeout(240)
def test_train_evaluates_writes_grids_logs_to_mlflow_and_resumes(monkeypatch):
    """One iteration (evaluations 0 and 1), then --resume to two iterations (evaluation 2 only): eval.csv, the
    folders, metrics.json and MLflow hold each evaluation once."""
    monkeypatch.delenv("LEAN_TRACKING", raising=False)
    tracking.reset()
    tracking.configure(enabled=True, experiment="lean-test-eval")
    try:
        train(tiny(*EVAL, *FASTER, "checkpoint.every=1", "eval.noise_seeds=2"), out="out")
        saved = checkpoint.latest(Path("out/checkpoints"))["eval_history"]
        assert [row["iteration"] for row in saved] == [0, 1] and saved[0]["eval_reward_noise_std"] > 0
        train(
            tiny(*EVAL, *FASTER, "checkpoint.every=1", "eval.noise_seeds=2", "train.iterations=2"),
            out="out",
            resume=True,
        )
    finally:
        tracking.reset()
    with open("out/eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == [0, 1, 2]
    assert all(int(r["eval_samples"]) == 4 and 0 <= float(r["eval_reward_color_match"]) <= 1 for r in rows)
    for it in (0, 1, 2):
        folder = f"out/eval/{it}"
        assert sorted(os.listdir(folder)) == sorted(
            ["grid.png", "samples.csv", *(f"p{p:03d}_s{k:02d}.png" for p in range(2) for k in range(2))]
        )
        with Image.open(f"{folder}/grid.png") as grid:
            assert grid.width > 2 * 128 and grid.height > 2 * 128  # 32 px samples shown at 128 px, captions
    metrics = json.loads(open("out/metrics.json").read())
    assert metrics["eval_iterations"] == [0, 1, 2]
    assert metrics["eval_reward_gain"] == pytest.approx(
        float(rows[2]["eval_reward_mean"]) - float(rows[0]["eval_reward_mean"])
    )
    # the base model's noise figure, measured before the first iteration, survives the resume
    assert metrics["eval_reward_noise_std"] == pytest.approx(saved[0]["eval_reward_noise_std"])
    assert float(rows[0]["eval_reward_noise_std"]) == pytest.approx(saved[0]["eval_reward_noise_std"])

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("lean-test-eval")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    (run,) = client.search_runs([experiment.experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_reward_mean"))
    assert history == [(i, pytest.approx(float(r["eval_reward_mean"]))) for i, r in enumerate(rows)]
    for it in (0, 1, 2):
        logged = {a.path for a in client.list_artifacts(run.info.run_id, f"eval/{it}")}
        assert {f"eval/{it}/grid.png", f"eval/{it}/p000_s00.png", f"eval/{it}/samples.csv"} <= logged
    assert client.get_run(run.info.run_id).data.metrics["eval_reward_noise_std"] == pytest.approx(
        saved[0]["eval_reward_noise_std"]
    )
    images = client.list_artifacts(run.info.run_id, "images")
    assert len([a for a in images if a.path.endswith(".png") and "eval_grid" in a.path]) >= 3  # one per step


def test_images_every_is_a_multiple_of_every():
    with pytest.raises(ConfigError, match=r"eval.images_every.*multiple of eval.every=2: 4") as err:
        load_config(None, ["eval.every=2", "eval.images_every=5"])
    assert "\n" not in str(err.value)
    assert load_config(None, ["eval.every=2", "eval.images_every=4"]).eval.images_every == 4


@pytest.mark.timeout(120)
def test_a_curve_every_iteration_pictures_and_memory_when_due():
    """eval.every=1 with eval.images_every=2 over 3 iterations: an eval-reward row after each, the pictures at 0, 2
    and the last (3); train.memory_every=2 measures the peak at iterations 0 and 2 only, and the summary's peak is
    theirs."""
    cfg = tiny(*EVAL, *FASTER, "train.iterations=3", "eval.images_every=2", "train.memory_every=2")
    history = train(cfg, out="out")
    with open("out/eval.csv") as f:
        assert [int(r["iteration"]) for r in csv.DictReader(f)] == [0, 1, 2, 3]
    assert sorted(os.listdir("out/eval"), key=int) == ["0", "2", "3"]
    assert all("grid.png" in os.listdir(f"out/eval/{it}") for it in ("0", "2", "3"))
    peaks = [row["peak_memory_mb"] for row in history]
    assert [math.isnan(p) for p in peaks] == [False, True, False]
    assert json.loads(open("out/metrics.json").read())["peak_memory_mb"] == max(peaks[0], peaks[2])


@pytest.mark.timeout(120)
def test_the_base_models_noise_std_over_eval_seeds(tmp_path):
    """eval.noise_seeds=3: the base model's row holds the unbiased std of its mean eval reward under eval seeds 0, 1,
    2 (the evaluator's own score, seed by seed), finite and > 0, and the other seeds write no files; with 0 there is
    no noise figure at all."""
    cfg = tiny(*EVAL, "eval.noise_seeds=3")
    trainer = Trainer(cfg, World())
    evaluator = Evaluator(trainer.pipeline, tmp_path)
    rows = []
    evaluate(trainer, evaluator, 0, tracking.Run(), rows)
    noise = rows[0]["eval_reward_noise_std"]
    means = torch.tensor([evaluator.score(seed)[:, 0].mean().item() for seed in (0, 1, 2)], dtype=torch.float64)
    assert means[0].item() == pytest.approx(rows[0]["eval_reward_mean"])  # seed eval.seed is the evaluation itself
    assert math.isfinite(noise) and noise > 0 and noise == pytest.approx(means.std(unbiased=True).item())
    assert rows[0]["eval_noise_seeds"] == 3 and eval_summary(rows)["eval_reward_noise_std"] == noise
    assert os.listdir(tmp_path / "eval") == ["0"] and len(os.listdir(tmp_path / "eval" / "0")) == 2 + 4

    off, base = [], Trainer(tiny(*EVAL), World())  # eval.noise_seeds: 0
    evaluate(base, Evaluator(base.pipeline, tmp_path / "off"), 0, tracking.Run(), off)
    assert "eval_reward_noise_std" not in off[0] and "eval_reward_noise_std" not in eval_summary(off)
    assert all(math.isfinite(v) for v in eval_summary(off).values() if isinstance(v, float))


@pytest.mark.timeout(180)
def test_fixed_noise_and_the_ema_weights(tmp_path):
    """The same weights give the same images at every evaluation; after a step with EMA the evaluation sees the EMA
    weights (lean train's evaluate), which differ from the trained ones, and the trained ones are back after it."""
    cfg = tiny(*EVAL, *FASTER, "ema.enabled=true", "ema.every=1", "optimizer.lr=1e-2")
    trainer = Trainer(cfg, World())
    evaluator = Evaluator(trainer.pipeline, tmp_path)
    first = evaluator.evaluate(0)
    trainer.iteration(0, "recompute")
    trained = [p.detach().clone() for p in trainer.params]
    rows = []
    evaluate(trainer, evaluator, 1, tracking.Run(), rows)  # eval.use_ema: true
    assert rows[0]["eval_ema"] == 1 and all(torch.equal(p, q) for p, q in zip(trainer.params, trained))
    with trainer.state.ema_swapped_in(False) as swapped:
        raw = evaluator.evaluate(2)
    assert not swapped and raw["eval_reward_mean"] != rows[0]["eval_reward_mean"]
    assert not torch.equal(_pixels(tmp_path / "eval" / "1"), _pixels(tmp_path / "eval" / "2"))

    trainer.policy.load_lora_state_dict(trainer.state.ema_state_dict())  # the EMA weights as the trained ones
    assert evaluator.evaluate(3)["eval_reward_mean"] == rows[0]["eval_reward_mean"]
    with trainer.state.ema_swapped_in(True):  # EMA = trained: the images of evaluation 1 again
        evaluator.evaluate(4)
    for it in (3, 4):
        for name in ("p000_s00.png", "p001_s01.png", "grid.png"):
            assert torch.equal(_pixels(tmp_path / "eval" / "1", name), _pixels(tmp_path / "eval" / str(it), name))
    assert first["eval_reward_mean"] != raw["eval_reward_mean"]  # training changed the samples


@pytest.mark.timeout(120)
def test_video_samples_are_gifs_and_the_grid_shows_first_frames(tmp_path):
    cfg = tiny("model.family=wan", *EVAL, "eval.samples_per_prompt=1")
    evaluator = Evaluator(build_pipeline(cfg, World()), tmp_path)
    row = evaluator.evaluate(0)
    folder = tmp_path / "eval" / "0"
    assert sorted(os.listdir(folder)) == ["grid.png", "p000_s00.gif", "p001_s00.gif", "samples.csv"]
    with Image.open(folder / "p000_s00.gif") as gif:
        assert gif.is_animated and gif.n_frames == cfg.model.num_frames and gif.size == (32, 32)
    with Image.open(folder / "grid.png") as grid:
        assert grid.height >= 2 * 128
    with open(folder / "samples.csv") as f:
        rewards = [float(r["reward"]) for r in csv.DictReader(f)]
    assert sum(rewards) / 2 == pytest.approx(row["eval_reward_mean"])


def _magnified_in(grid: Image.Image, sample: Image.Image, factor: int) -> bool:
    """Whether ``sample`` magnified ``factor`` times (nearest, as the grid's cells) is pasted somewhere in the first
    row of ``grid``."""
    side = sample.width * factor
    target = np.asarray(sample.convert("RGB").resize((side, side), Image.Resampling.NEAREST))
    rows = np.asarray(grid.convert("RGB"))[4 : 4 + side]  # the first row of cells starts at the grid's padding
    return any(np.array_equal(rows[:, x : x + side], target) for x in range(grid.width - side + 1))


@pytest.mark.timeout(60)
def test_eval_resolution_apart_from_the_training_one(tmp_path):
    """eval.resolution=64 on a 32 px run: the eval samples, their grid cells and lean sample's default are 64 px;
    the rollout's images stay 32 px, before and after an evaluation."""
    cfg = tiny(*EVAL, *FASTER, "eval.prompts=[a red circle on a white background]", "eval.resolution=64")
    trainer = Trainer(cfg, World())
    evaluator = Evaluator(trainer.pipeline, tmp_path)
    evaluator.evaluate(0)
    folder = tmp_path / "eval" / "0"
    with Image.open(folder / "p000_s00.png") as sample, Image.open(folder / "grid.png") as grid:
        assert sample.size == (64, 64)
        assert _magnified_in(grid, sample, 2)  # a 64 px cell shown at 128 px (a 32 px one would be magnified 4x)
    result = trainer.iteration(0, "recompute")
    assert trainer.policy.decode(result.final).shape[-2:] == (32, 32)  # the rollout: the training resolution
    assert sampling_settings(cfg)["resolution"] == 64  # lean sample draws as the evaluation did
    assert sampling_settings(tiny())["resolution"] == 32
    assert eval_runtime(trainer.policy, tiny("eval.resolution=32")) is None  # the training's: nothing swapped


def test_eval_geometry_is_refused_where_the_family_cannot_take_it():
    """The family's rules, as the training geometry gets them: one line each."""
    for overrides, key in [
        (["model.family=wan", "eval.num_frames=6"], "eval.num_frames"),  # Wan's VAE: 4k + 1 frames
        (["eval.num_frames=9"], "eval.num_frames"),  # FLUX makes images
        (["model.family=wan", "model.width=64", "eval.resolution=64"], "eval.resolution"),  # square frames only
        (
            ["model.family=wan22_ti2v", "model.size=small", "model.resolution=64", "eval.resolution=48"],
            "eval.resolution",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, ["model.size=tiny", *overrides])
        assert err.value.key == key and "\n" not in str(err.value), overrides
    # the runtime's own check (Wan2.2-TI2V's 32 px tokens at size small), made when the evaluator builds it
    cfg = load_config(None, ["model.family=wan22_ti2v", "model.size=small", "model.resolution=64"])
    cfg.eval.resolution = 48  # past the config's rule: the runtime refuses it too
    spec = family_spec("wan22_ti2v")
    configs = [component_config(spec, name, "small", None) for name in (spec.denoiser_folders[0], "vae")]
    policy = type("Policy", (), {"spec": spec, "denoisers": [type("T", (), {"config": configs[0]})], "vae": None})()
    policy.vae = type("V", (), {"config": configs[1]})()
    with pytest.raises(ConfigError, match="eval.resolution=48") as err:
        eval_runtime(policy, cfg)
    assert "\n" not in str(err.value)


@pytest.mark.timeout(60)
def test_video_evaluates_at_its_own_frames_and_side(tmp_path):
    cfg = tiny("model.family=wan", *EVAL, "eval.samples_per_prompt=1", "eval.num_frames=9", "eval.resolution=64")
    evaluator = Evaluator(build_pipeline(cfg, World()), tmp_path)
    evaluator.evaluate(0)
    with Image.open(tmp_path / "eval" / "0" / "p000_s00.gif") as gif:
        assert gif.n_frames == 9 and gif.size == (64, 64) and cfg.model.num_frames == 5
    assert evaluator.policy.latent_shape()[-2:] != evaluator.runtime.latent_shape[-2:]  # the training's is back
    assert {k: sampling_settings(cfg)[k] for k in ("resolution", "num_frames")} == {"resolution": 64, "num_frames": 9}


@pytest.mark.timeout(60)
def test_an_edit_evaluates_with_its_reference_at_the_eval_side(tmp_path):
    """Kontext conditions on the reference at the samples' side: the eval's reference latents have 4x the training's
    tokens at twice the side, each cached apart, and the training's are untouched."""
    cfg = tiny("model.family=kontext", *EVAL, "eval.prompts=null", "eval.samples_per_prompt=1", "eval.resolution=64")
    pipeline = build_pipeline(cfg, World())
    prompt = cfg.train.prompts[0]
    before = pipeline.policy.encode_prompts([prompt]).reference
    evaluator = Evaluator(pipeline, tmp_path)
    evaluator.evaluate(0)
    with Image.open(tmp_path / "eval" / "0" / "p000_s00.png") as sample:
        assert sample.size == (64, 64) and (tmp_path / "eval" / "0" / "edits.png").exists()
    with pipeline.policy.at_geometry(evaluator.runtime, 64):
        at_eval = pipeline.policy.encode_prompts([prompt]).reference
    assert at_eval.shape[1] == 4 * before.shape[1]
    assert torch.equal(pipeline.policy.encode_prompts([prompt]).reference, before)
