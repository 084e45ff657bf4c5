"""lean.models.kontext: FLUX.1 Kontext [dev] edits against diffusers' FluxKontextPipeline, the edit prompts (a reference
image per prompt), the family's refusals, export and the certificate.

The family-agnostic Policy checks of test_models.py are rerun here for ``kontext`` on the bundled edit prompts.
"""

from __future__ import annotations

import json

import pytest
import test_models as generic
import torch
from helpers import lean_here, write_edit_prompts

from lean.config import ConfigError
from lean.config.prompts import ImagePrompt, read_prompts, reference_pixels
from lean.configure import load_config
from lean.models import EDIT_PROMPTS, Guidance, build_policy, build_scheduler
from lean.models.options import ModelConfig

EDITS = read_prompts(EDIT_PROMPTS)


@pytest.fixture(scope="module")
def policy():
    """One tiny Kontext policy for the module (LoRA perturbed so that the adapter matters)."""
    built = build_policy(ModelConfig(family="kontext", lora_ffn=True), EDITS)
    built.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return built


@pytest.mark.parametrize("check", generic.POLICY_CONTRACT)
def test_policy_contract(check):
    getattr(generic, check)("kontext")


def test_save_pretrained_round_trip(tmp_path):
    generic.test_save_pretrained_round_trip("kontext", tmp_path)


def test_velocity_is_the_kontext_pipelines_transformer_call(policy, tmp_path):
    """Text encoding, the reference's latent tokens and positions, and the transformer call equal
    FluxKontextPipeline's on the same weights (its prepare_latents encodes the image)."""
    from diffusers import FluxKontextPipeline

    policy.save_pretrained(tmp_path, adapter=False)
    pipe = FluxKontextPipeline.from_pretrained(tmp_path, scheduler=build_scheduler("kontext", None))
    pipe.transformer = policy.transformer  # the adapted weights
    prompts = EDITS[:2]
    emb = policy.encode_prompts(prompts)
    tokens, pooled, text_ids = pipe.encode_prompt(
        [str(p) for p in prompts], None, device="cpu", max_sequence_length=policy.text_max_length
    )
    torch.testing.assert_close(emb.tokens, tokens, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.pooled, pooled, rtol=0, atol=1e-6)

    size = policy.resolution
    images = torch.stack([reference_pixels(p, size) for p in prompts]) * 2 - 1
    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)])
    channels = pipe.transformer.config.in_channels // 4
    latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        images, 2, channels, size, size, torch.float32, "cpu", None, x.clone()
    )
    torch.testing.assert_close(emb.reference, image_latents, rtol=0, atol=1e-6)
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        expected = pipe.transformer(
            hidden_states=torch.cat([latents, image_latents], dim=1),
            timestep=sigma,
            guidance=torch.full([2], 2.5),
            pooled_projections=pooled,
            encoder_hidden_states=tokens,
            txt_ids=text_ids,
            img_ids=torch.cat([latent_ids, image_ids]),
            return_dict=False,
        )[0][:, : latents.shape[1]]
        got = policy.velocity(x, sigma, emb, Guidance(guidance_embed=2.5))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_edit_cfg_keeps_the_reference_in_both_branches(policy):
    """CFG's unconditional branch of an edit is the empty instruction on the same reference image."""
    emb = policy.encode_prompts(EDITS[:2])
    assert torch.equal(emb.negative.reference, emb.reference)
    assert torch.equal(emb.negative.tokens, policy.encode_prompts([""]).tokens.expand(2, -1, -1))


def test_one_instruction_over_two_images_is_two_prompts(tmp_path):
    """Prompts are (instruction, image): the same instruction over two images is encoded twice."""
    a, b = ImagePrompt("make it snowy", tmp_path / "a.png"), ImagePrompt("make it snowy", tmp_path / "b.png")
    assert a != b and len({a, b}) == 2 and a == ImagePrompt("make it snowy", tmp_path / "a.png")
    assert str(a) == "make it snowy" and a != "make it snowy"


def test_prompt_files_with_images_and_the_refusals(tmp_path):
    """A .jsonl with "image" fields reads as edits; text prompts for Kontext, or edits for FLUX.1, are refused."""
    path = write_edit_prompts(tmp_path / "data")
    prompts = read_prompts(path)
    assert all(isinstance(p, ImagePrompt) for p in prompts) and prompts[0].image.endswith("images/0.png")
    cfg = load_config(None, ["model.family=kontext", f"train.prompts_file={path}"])
    assert cfg.train.prompts == prompts
    assert load_config(None, ["model.family=kontext"]).train.prompts == EDITS  # the bundled recolouring set
    with pytest.raises(ConfigError, match="edits reference images: every prompt needs one"):
        load_config(None, ["model.family=kontext", "train.prompts=[a red cube]"])
    with pytest.raises(ConfigError, match="carry a reference image, which model.family=flux cannot take"):
        load_config(None, ["model.family=flux", f"train.prompts_file={path}"])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "image": "missing.png"}) + "\n")
    with pytest.raises(ConfigError, match="is not an image file"):
        load_config(None, ["model.family=kontext", f"train.prompts_file={tmp_path / 'bad.jsonl'}"])


def test_bundled_edit_set_is_the_recolouring_task(tmp_path):
    """The committed edit set is what lean.workbench.data.write_edit_dataset writes."""
    from lean.workbench.data import write_edit_dataset

    write_edit_dataset(tmp_path)
    assert (tmp_path / "train_metadata.jsonl").read_text() == EDIT_PROMPTS.read_text()
    for k in range(len(EDITS)):
        name = f"images/{k}.png"
        assert torch.equal(reference_pixels(ImagePrompt("", tmp_path / name), 64), reference_pixels(EDITS[k], 64))


@pytest.mark.timeout(180)
def test_every_schedule_trains_and_the_certificate_passes(tmp_path):
    """`lean train` runs recompute, retain and reweight on the bundled edits (recompute evaluated: its edits.png shows
    reference | base | trained); the float64 certificate passes."""
    for schedule in ("recompute", "retain", "reweight"):
        evaluated = ["--set", "eval.every=1", "--set", "eval.samples_per_prompt=1"] if schedule == "recompute" else []
        lean_here(
            "train",
            *("--set", "model.family=kontext", "--set", f"train.schedule={schedule}", "--set", "train.iterations=1"),
            *("--set", "sample.num_steps=3", *evaluated, "--out", str(tmp_path / schedule)),
        )
        assert (tmp_path / schedule / "metrics.json").exists()
    assert (tmp_path / "recompute" / "eval" / "1" / "edits.png").exists()
    lean_here(
        "equivalence", "--set", "model.family=kontext", "--set", "model.dtype=float64", "--out", str(tmp_path / "eq")
    )
    report = json.loads((tmp_path / "eq" / "equivalence.json").read_text())
    assert report["passes"]


@pytest.mark.timeout(120)
def test_exported_lora_loads_into_the_kontext_pipeline_which_samples_the_edits(policy, tmp_path):
    """The LoRA folder loads into FluxKontextPipeline (its transformer then gives the policy's velocity, which the
    adapter changes), and ``lean sample`` draws one edit per line of an edit prompt file, its reference recorded."""
    from test_export import assert_same_velocity

    from lean.export import save_diffusers_lora
    from lean.tools.sampling import SampleOptions, check_folders, load_pipeline, sample

    base, lora = tmp_path / "base", tmp_path / "lora"
    policy.save_pretrained(base, adapter=False)
    save_diffusers_lora(policy.pipeline_class, policy.transformer, lora)
    assert check_folders(base, lora) == "kontext"
    pipe = load_pipeline(base, lora, SampleOptions(device="cpu"), "kontext")
    assert type(pipe).__name__ == "FluxKontextPipeline"
    assert_same_velocity(policy, pipe.transformer)
    options = SampleOptions(device="cpu", num_steps=2, resolution=policy.resolution, guidance_scale=2.5)
    files = sample(base, lora, EDIT_PROMPTS, tmp_path / "samples", options)
    records = [json.loads(line) for line in (tmp_path / "samples" / "samples.jsonl").read_text().splitlines()]
    assert len(files) == len(EDITS) and all(f.exists() for f in files)
    assert [r["prompt"] for r in records] == [str(p) for p in EDITS]
    assert [r["image"] for r in records] == [p.image for p in EDITS]


def test_a_folder_saved_by_the_kontext_pipeline_loads_as_model_pretrained(policy, tmp_path):
    """FluxKontextPipeline.save_pretrained of the random build -> ``model.pretrained``: the same initial velocity."""
    from diffusers import FluxKontextPipeline

    policy.save_pretrained(tmp_path / "lean", adapter=False)
    pipe = FluxKontextPipeline.from_pretrained(tmp_path / "lean", scheduler=build_scheduler("kontext", None))
    pipe.save_pretrained(tmp_path / "diffusers")
    loaded = build_policy(ModelConfig(family="kontext", pretrained=str(tmp_path / "diffusers")), EDITS)
    x, sigma, _ = generic.inputs(loaded, batch=2)
    emb, emb_loaded = policy.encode_prompts(EDITS[:2]), loaded.encode_prompts(EDITS[:2])
    with torch.no_grad(), policy.reference():  # the base weights: the folder holds no adapter
        expected = policy.velocity(x, sigma, emb, Guidance(guidance_embed=2.5))
    with torch.no_grad():
        got = loaded.velocity(x, sigma, emb_loaded, Guidance(guidance_embed=2.5))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
