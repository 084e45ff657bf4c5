"""lean.export and lean.tools.sampling: diffusers' LoRA format round trip (SD3, FLUX), ``lean export`` (LoRA, --ema,
--merge on a random and on a pretrained base, full fine-tune), the run's sampling settings in every export and ``lean
sample`` without options drawing the run's eval images, ``lean sample`` (images, video frames), one-line errors."""

import inspect
import json

import numpy as np
import pytest
import torch
from helpers import tiny
from safetensors import safe_open
from safetensors.torch import load_file
from test_models import family_prompts

from lean.cli import main
from lean.config import DEFAULT_PROMPTS
from lean.export import LORA_WEIGHTS, SAMPLING_FILE, run_config, sampling_settings, save_diffusers_lora
from lean.models import FAMILIES, build_policy
from lean.models.options import ModelConfig
from lean.tools.sampling import SETTINGS, SampleOptions, check_folders, load_pipeline, takes_sigmas, with_run_defaults
from lean.train import train

ATOL = 1e-5  # float32
RUN = [
    "sample.num_steps=2",
    "ema.enabled=true",
    "model.lora_rank=4",
    "model.lora_alpha=3",
    "optimizer.lr=1.0",  # one step that moves the eval images visibly
]  # alpha / r = 0.75
EVAL = [  # evaluations (iterations 0 and 1) of two prompts whose settings all differ from sample.* and the pipeline's
    "eval.every=1",
    "eval.samples_per_prompt=1",
    f"eval.prompts=[{DEFAULT_PROMPTS[0]}, {DEFAULT_PROMPTS[1]}]",
    "eval.num_steps=3",
    "eval.guidance_scale=3.0",
    "eval.seed=3",
    "eval.use_ema=false",  # the trained weights: lora/, lean export without --ema
]


def inputs(policy, seed: int = 0):
    """Two latents, two sigmas, two prompts' embeddings (an editing family's: two edits)."""
    x = policy.init_latents([torch.Generator().manual_seed(seed + b) for b in range(2)])
    return x, torch.tensor([0.3, 0.8]), policy.encode_prompts(family_prompts(policy.family)[:2])


def assert_same_velocity(policy, transformer):
    """``transformer`` (a diffusers model) gives lean's policy velocity on the same inputs, and the adapter matters."""
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        expected = policy.velocity(x, sigma, emb)
        got = policy.runtime.forward(transformer, x, sigma, emb, None)
        with policy.reference():
            base = policy.velocity(x, sigma, emb)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    assert (expected - base).abs().max() > 100 * ATOL  # the trained weights change the velocity


def perturbed(**model):
    policy = build_policy(ModelConfig(**model), DEFAULT_PROMPTS)
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return policy


@pytest.fixture(scope="module")
def base_folders(tmp_path_factory):
    """Tiny pipeline folders as lean writes them (no scheduler/), per family, built on first use."""
    root, folders = tmp_path_factory.mktemp("bases"), {}

    def get(family: str):
        if family not in folders:
            folders[family] = root / family
            build_policy(ModelConfig(family=family), DEFAULT_PROMPTS).save_pretrained(folders[family], adapter=False)
        return folders[family]

    return get


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One iteration of ``lean train`` (tiny FLUX, random base, EMA on, alpha != rank), evaluated (:data:`EVAL`)."""
    out = tmp_path_factory.mktemp("run") / "out"
    train(tiny(*RUN, *EVAL), out=str(out))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_lora_folder_loads_into_the_diffusers_pipeline(family, base_folders, tmp_path):
    """load_lora_weights of the folder, then the pipeline's transformer equals lean's policy (alpha != rank)."""
    policy = perturbed(family=family, lora_rank=4, lora_alpha=3.0)
    save_diffusers_lora(policy.pipeline_class, policy.transformer, tmp_path / "lora")
    with safe_open(tmp_path / "lora" / LORA_WEIGHTS, "pt") as f:
        assert all(k.startswith("transformer.") and ".lora_" in k for k in f.keys())
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    assert metadata["transformer.lora_alpha"] == 3.0 and metadata["transformer.r"] == 4
    family_of = check_folders(base_folders(family), tmp_path / "lora")
    pipe = load_pipeline(base_folders(family), tmp_path / "lora", SampleOptions(device="cpu"), family_of)
    assert type(pipe).__name__ == policy.pipeline_class
    assert_same_velocity(policy, pipe.transformer)


def diffusers_name(lean_name: str) -> str:
    """What diffusers calls a trained parameter: ``transformer.<module>.lora_A.weight``."""
    return "transformer." + lean_name.removeprefix("base_model.model.").replace(".default.", ".")


@pytest.mark.timeout(240)
def test_train_writes_lora_folders_and_export_rewrites_them(run, tmp_path):
    """lora/ and lora_ema/ hold the trained and the EMA weights under diffusers' names; lean export writes the same."""
    for folder, weights, ema in (("lora", "lora.safetensors", []), ("lora_ema", "lora_ema.safetensors", ["--ema"])):
        trained, written = load_file(run / weights), load_file(run / folder / LORA_WEIGHTS)
        assert {diffusers_name(k): v for k, v in trained.items()}.keys() == written.keys()
        assert all(torch.equal(written[diffusers_name(k)], v) for k, v in trained.items())
        assert main(["export", "--run", str(run), "--out", str(tmp_path / folder), *ema]) == 0
        exported = load_file(tmp_path / folder / LORA_WEIGHTS)
        assert exported.keys() == written.keys() and all(torch.equal(exported[k], written[k]) for k in written)
    assert (run / "base.json").exists()  # a random base: its fingerprint for --merge


@pytest.mark.timeout(240)
def test_export_merge_of_a_random_base(run, tmp_path, capsys):
    """The random base is rebuilt (its fingerprint checked) and merged; from_pretrained loads the folder, whose
    transformer is base + LoRA; a base that does not rebuild is refused in one line."""
    from diffusers import FluxPipeline

    assert main(["export", "--run", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    pipe = FluxPipeline.from_pretrained(tmp_path / "merged")
    shift = json.loads((run / "config.json").read_text())["sample"]["shift"]  # as the run resolved it
    assert pipe.scheduler.config.shift == shift and not pipe.scheduler.config.use_dynamic_shifting
    assert not any("lora" in name for name, _ in pipe.transformer.named_parameters())
    policy = build_policy(tiny(*RUN).model, tiny().train.prompts)
    policy.load_lora(run / "lora.safetensors")
    assert_same_velocity(policy, pipe.transformer)

    record = json.loads((run / "base.json").read_text())
    (tmp_path / "tampered").mkdir()
    for name in ("config.json", "lora.safetensors"):
        (tmp_path / "tampered" / name).write_bytes((run / name).read_bytes())
    (tmp_path / "tampered" / "base.json").write_text(json.dumps({**record, "base_sha256": "0" * 64}))
    capsys.readouterr()
    assert main(["export", "--run", str(tmp_path / "tampered"), "--out", str(tmp_path / "x"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be rebuilt exactly" in err and not (tmp_path / "x").exists()


@pytest.mark.timeout(240)
def test_exports_carry_the_runs_sampling_settings(run, tmp_path):
    """lean_sampling.json in lora/, lora_ema/, lean export's LoRA folder and --merge's pipeline folder: the settings of
    the run's evaluation in lean sample's terms; they fill lean sample's unset options, given ones win; an export
    without the file leaves the pipeline's defaults."""
    shift = json.loads((run / "config.json").read_text())["sample"]["shift"]  # as the run resolved it
    expected = {
        "pipeline": "FluxPipeline",
        "num_steps": 3,  # eval.num_steps, not sample.num_steps
        "guidance_scale": 1.0,  # FLUX's guidance embedding, as lean feeds it under CFG
        "guidance_scale_2": None,  # one denoiser
        "true_cfg_scale": 3.0,  # eval.guidance_scale
        "seed": 3,
        "resolution": 32,
        "width": None,  # square frames
        "num_frames": None,
        "shift": shift,
        "sigma_grid": "euler",
        "shift_terminal": None,  # FLUX.1's scheduler has no terminal stretch
        "reference_resolution": None,  # no edits
        "negative_prompt": None,  # the empty prompt
    }
    assert sampling_settings(run_config(run)) == expected
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "lora")]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    for folder in (run / "lora", run / "lora_ema", tmp_path / "lora", tmp_path / "merged"):
        assert json.loads((folder / SAMPLING_FILE).read_text()) == expected, folder

    merged = tmp_path / "merged"
    options, source = with_run_defaults(SampleOptions(), "flux", merged, None)
    assert {k: getattr(options, k) for k in SETTINGS} == {k: expected[k] for k in SETTINGS}
    assert source == merged / SAMPLING_FILE
    given = SampleOptions(num_steps=7, seed=0, shift=2.0)
    options, source = with_run_defaults(given, "flux", merged, tmp_path / "lora")
    assert (options.num_steps, options.seed, options.shift, options.resolution) == (7, 0, 2.0, 32)
    assert source == tmp_path / "lora" / SAMPLING_FILE  # the LoRA folder's first
    (merged / SAMPLING_FILE).unlink()  # an export from before lean_sampling.json
    assert with_run_defaults(SampleOptions(), "flux", merged, None) == (SampleOptions(seed=0), None)


def test_sigmas_pipelines_are_those_whose_call_takes_sigmas():
    import diffusers

    for family, spec in FAMILIES.items():
        call = getattr(diffusers, spec.pipeline).__call__
        assert takes_sigmas(family) == ("sigmas" in inspect.signature(call).parameters), family


def pixels(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("export", ["merged", "lora"])
def test_sample_without_options_draws_the_runs_eval_images(export, run, base_folders, tmp_path):
    """lean sample with no sampling options, on lean export --merge's folder or on the run's base with its lora/,
    draws the run's last eval images of the same prompts and seed: the run's resolution, eval steps, CFG, static
    shift, sigma grid (euler, not FluxPipeline's own) and eval noise. To 1/255: the pipeline runs CFG as two
    forwards of one row, the evaluation as one batch (float32 rounding; equal here). The trained weights matter:
    the base's eval images are further off."""
    if export == "merged":
        assert main(["export", "--run", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
        folders = ["--pretrained", str(tmp_path / "merged")]
    else:  # the random base lean train drew, as a pipeline folder
        folders = ["--pretrained", str(base_folders("flux")), "--lora", str(run / "lora")]
    prompts = json.loads((run / "config.json").read_text())["eval"]["prompts"]
    (tmp_path / "prompts.txt").write_text("".join(f"{p}\n" for p in prompts))
    assert main(["sample", *folders, "--prompts-file", str(tmp_path / "prompts.txt"), "--out", "samples"]) == 0
    for k in range(len(prompts)):
        got = pixels(tmp_path / "samples" / f"{k:05d}.png")
        evaluated, base = (pixels(run / "eval" / str(i) / f"p{k:03d}_s00.png") for i in (1, 0))
        assert got.shape == (32, 32, 3)
        assert np.abs(got - evaluated).max() <= 1, k
        assert np.abs(got - base).max() > 8, k
    assert np.abs(pixels(tmp_path / "samples" / "00000.png") - pixels(tmp_path / "samples" / "00001.png")).max() > 8


def fake_run(folder, policy, *overrides):
    """A run folder as lean train leaves it: config.json and the trained parameters."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny(*overrides).to_dict()))
    policy.save_lora(folder / "lora.safetensors")
    return folder


@pytest.mark.timeout(120)
def test_export_merge_of_a_pretrained_sd3_base(base_folders, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    base = base_folders("sd3")
    policy = perturbed(family="sd3", pretrained=str(base), lora_rank=4, lora_alpha=3.0)
    overrides = ["model.family=sd3", f"model.pretrained={base}", "model.lora_rank=4", "model.lora_alpha=3"]
    run = fake_run(tmp_path / "run", policy, *overrides)
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    assert_same_velocity(policy, StableDiffusion3Pipeline.from_pretrained(tmp_path / "merged").transformer)


@pytest.mark.timeout(120)
def test_export_of_a_full_finetune_is_the_transformer(base_folders, tmp_path):
    from diffusers import FluxTransformer2DModel

    base = base_folders("flux")
    policy = perturbed(pretrained=str(base), full_finetune=True)
    run = fake_run(tmp_path / "run", policy, f"model.pretrained={base}", "model.full_finetune=true")
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "transformer")]) == 0
    assert_same_velocity(policy, FluxTransformer2DModel.from_pretrained(tmp_path / "transformer"))


@pytest.mark.timeout(120)
def test_sample_writes_images(run, base_folders, tmp_path):
    """A lean base folder (no scheduler/) with the run's lora/: one PNG per prompt, in file order, and the index."""
    from PIL import Image

    (tmp_path / "prompts.txt").write_text("a red circle\n\na blue square on a green background\n")
    args = ["--pretrained", str(base_folders("flux")), "--lora", str(run / "lora"), "--prompts-file", "prompts.txt"]
    options = ["--num-steps", "2", "--resolution", "32", "--true-cfg-scale", "4.5", "--seed", "7"]
    assert main(["sample", *args, "--out", "samples", *options]) == 0
    records = [json.loads(line) for line in (tmp_path / "samples" / "samples.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["seed"]) for r in records] == [
        ("a red circle", 7),
        ("a blue square on a green background", 7),
    ]
    images = [Image.open(tmp_path / "samples" / r["file"]) for r in records]
    assert all(image.size == (32, 32) and image.mode == "RGB" for image in images)
    assert images[0].tobytes() != images[1].tobytes()


@pytest.mark.timeout(120)
def test_sample_writes_video_frames(base_folders, tmp_path):
    from PIL import Image

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a red circle", "tag": "x"}\n')
    args = ["--num-steps", "2", "--resolution", "32", "--num-frames", "5", "--out", "video"]
    assert main(["sample", "--pretrained", str(base_folders("wan")), "--prompts-file", "prompts.jsonl", *args]) == 0
    frames = sorted((tmp_path / "video" / "00000").iterdir())
    assert len(frames) == 5 and Image.open(frames[0]).size == (32, 32)
    assert Image.open(tmp_path / "video" / "00000.gif").n_frames == 5


@pytest.mark.parametrize(
    "argv,key",
    [
        (["sample", "--pretrained", "nowhere", "--prompts-file", "p.txt", "--out", "o"], "--pretrained"),
        (["sample", "--pretrained", "{flux}", "--lora", ".", "--prompts-file", "p.txt", "--out", "o"], "--lora"),
        (["sample", "--pretrained", "{flux}", "--prompts-file", "p.txt", "--out", "o", "--num-frames", "5"], "--num"),
        (["sample", "--pretrained", "{flux}", "--prompts-file", "missing.txt", "--out", "o"], "--prompts-file"),
        (["sample", "--pretrained", "{flux}", "--prompts-file", "p.txt", "--out", "o", "--sigma-grid", "x"], "--sigma"),
        (["sample", "--pretrained", "{flux}", "--prompts-file", "p.txt", "--out", "o", "--sigma-grid=euler"], "--sig"),
        (["export", "--run", ".", "--out", "o"], "--run"),
        (["export", "--run", "{rank2}", "--out", "o"], "--run"),  # weights of another rank than config.json's
    ],
)
def test_bad_arguments_are_one_config_error_line(argv, key, base_folders, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a red circle\n")
    if "{rank2}" in argv:
        fake_run(tmp_path / "rank2", perturbed(lora_rank=2))
    argv = [a.replace("{flux}", str(base_folders("flux"))).replace("{rank2}", "rank2") for a in argv]
    capsys.readouterr()  # what building the folders printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lean: config error: {key}")
