"""lean.models.qwen_image_edit: Qwen-Image-Edit policies against diffusers' QwenImageEditPipeline (prompt encoding with
the reference image through Qwen2.5-VL's vision tower, the reference's VAE tokens, the transformer call), its true CFG
with the norm rescale, a pipeline folder saved by the diffusers class as ``model.pretrained``, folders of other
families refused, the sizes, ``lean train`` on every schedule with edits.png, the float64 certificate, the exported
LoRA in the diffusers pipeline, ``lean sample`` and the FlowGRPO preset.

One tiny float32 build (module-scoped, LoRA perturbed) serves the pipeline checks; the family-agnostic Policy checks of
test_models.py that hold under Qwen's renormalised CFG are rerun for ``qwen_image_edit``.
"""

from __future__ import annotations

import json
import math

import pytest
import test_models as generic
import torch
from helpers import (
    FAST,
    preset_value_lines,
    reference_gap,
    renorm,
    sets,
    train_every_schedule,
    uncited,
    write_edit_prompts,
)

from lean.cli import main
from lean.config import ConfigError
from lean.config.prompts import read_prompts, reference_pixels
from lean.configure import load_config
from lean.export import LORA_WEIGHTS, save_diffusers_lora
from lean.models import EDIT_PROMPTS, Guidance, build_policy, count_parameters, family_spec
from lean.models.options import ModelConfig
from lean.models.qwen_image_edit.model import PIPELINE_PREFIX_TOKENS, prefix_tokens
from lean.tools.sampling import SampleOptions, check_folders, load_pipeline, sample

FAMILY = "qwen_image_edit"
EDITS = read_prompts(EDIT_PROMPTS)
SCALE = 4.0
ATOL = 1e-5  # float32


@pytest.fixture(scope="module")
def policy():
    """The shared tiny build (float32, MLP LoRA as FlowGRPO's targets), its LoRA perturbed so that it matters."""
    built = build_policy(ModelConfig(family=FAMILY, lora_ffn=True), EDITS)
    built.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return built


@pytest.fixture(scope="module")
def folder(policy, tmp_path_factory):
    """The shared build's base weights as lean writes a pipeline folder (no scheduler/)."""
    path = tmp_path_factory.mktemp("qwen_edit") / "base"
    policy.save_pretrained(path, adapter=False)
    return path


@pytest.fixture(scope="module")
def pipe(folder):
    """diffusers' QwenImageEditPipeline from lean's folder, as ``lean sample`` loads it (lean's processor)."""
    return load_pipeline(folder, None, SampleOptions(device="cpu"), FAMILY)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``lean train`` (tiny, CLI, the bundled edits) with each schedule, one iteration; recompute evaluated."""
    return train_every_schedule(tmp_path_factory.mktemp("runs"), FAMILY, evaluated=("recompute",))


def inputs(policy, batch: int = 2):
    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(batch)])
    sigma = torch.linspace(0.3, 0.8, batch, dtype=policy.dtype)
    return x, sigma, policy.encode_prompts(EDITS[:batch])


# ---------------------------------------------------------------- the generic policy contract, CFG


@pytest.mark.parametrize("check", ["test_reference_is_the_base_model", "test_init_latents_do_not_depend_on_batching"])
def test_policy_contract(check):
    getattr(generic, check)(FAMILY)


def test_edit_cfg_is_renormalised_on_the_same_image():
    """float64: v = (v_u + s (v_c - v_u)) |v_c| / |.| per token with v_u the negative prompt on the same reference;
    one [uncond, cond] batch equals two forwards; every LoRA factor the velocity reaches gets a float64 gradient."""
    policy = generic.perturbed(FAMILY, dtype="float64")
    x, sigma, emb = inputs(policy)
    assert torch.equal(emb.negative.reference, emb.reference) and emb.tokens.dtype == torch.float64
    with torch.no_grad():
        batched = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
        v_u = policy.velocity(x, sigma, emb.negative)
        v_c = policy.velocity(x, sigma, emb)
    torch.testing.assert_close(batched, renorm(v_u, v_c, SCALE), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(v_u, v_c)  # the instruction matters
    split = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))  # grad on: v_u apart, no grad
    torch.testing.assert_close(split.detach(), batched, rtol=1e-9, atol=1e-9)
    split.square().mean().backward()
    grads = [p.grad for _, p in policy.trainable_parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float64 and torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------- against diffusers' QwenImageEditPipeline


def test_velocity_is_the_edit_pipelines_transformer_call(policy, pipe):
    """The edit's text states (template, the image through the processor and the vision tower, the system turn cut),
    the negative prompt on the same image, the reference's VAE tokens and the transformer call with both images'
    RoPE shapes equal QwenImageEditPipeline's on the same weights; the reference has its own resolution."""
    from PIL import Image

    side, size = policy.reference_resolution, policy.resolution
    assert (side, size) == (64, 32)  # tiny: references at twice the samples' side, as 1024 for FlowGRPO's 512
    assert pipe.prompt_template_encode_start_idx == prefix_tokens(policy.tokenizers["tokenizer"]) > 0
    assert PIPELINE_PREFIX_TOKENS == 64  # the pipeline's own count for the real Qwen2 tokenizer
    prompts = EDITS[:2]
    emb = policy.encode_prompts(prompts)
    images = []  # what lean's policy sees: the run's resolution, then the pipeline's own resize to the reference side
    for p in prompts:
        at_resolution = Image.fromarray((reference_pixels(p, size).permute(1, 2, 0) * 255).round().byte().numpy())
        images.append(pipe.image_processor.resize(at_resolution, side, side))
    for b, (prompt, image) in enumerate(zip(prompts, images, strict=True)):
        tokens, mask = pipe.encode_prompt([str(prompt)], image=[image], device="cpu")
        negative, _ = pipe.encode_prompt([policy.negative_prompt], image=[image], device="cpu")
        n = tokens.shape[1]
        assert mask is None and emb.mask[b, :n].all() and not emb.mask[b, n:].any()
        torch.testing.assert_close(emb.tokens[b : b + 1, :n], tokens, rtol=0, atol=1e-6)
        torch.testing.assert_close(emb.negative.tokens[b : b + 1, : negative.shape[1]], negative, rtol=0, atol=1e-6)
    assert emb.tokens.shape[1] > 4  # the vision tokens are kept: 64 px -> 56 px -> 2x2 merged patches

    pixels = pipe.image_processor.preprocess(images, side, side).unsqueeze(2)
    x, sigma, _ = inputs(policy)
    channels = pipe.transformer.config.in_channels // 4
    latents, image_latents = pipe.prepare_latents(pixels, 2, channels, size, size, torch.float32, "cpu", None, x)
    torch.testing.assert_close(emb.reference, image_latents, rtol=0, atol=1e-6)
    scale = pipe.vae_scale_factor
    img_shapes = [[(1, size // scale // 2, size // scale // 2), (1, side // scale // 2, side // scale // 2)]] * 2
    with torch.no_grad():
        expected = policy.transformer(  # the pipeline's call, on the adapted weights
            hidden_states=torch.cat([latents, image_latents], dim=1),
            timestep=sigma,
            encoder_hidden_states=emb.tokens,
            encoder_hidden_states_mask=emb.mask,
            img_shapes=img_shapes,
            return_dict=False,
        )[0][:, : latents.shape[1]]
        got = policy.velocity(x, sigma, emb)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


def test_pipeline_folder_loads_as_model_pretrained(policy, pipe, tmp_path):
    """A tiny pipeline saved with QwenImageEditPipeline.save_pretrained (processor folder included) loads as
    model.pretrained and gives the initial velocity of the random build it came from."""
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"] == [
        "transformers",
        "Qwen2VLProcessor",
    ]
    cfg = load_config(None, [f"model.family={FAMILY}", f"model.pretrained={tmp_path / 'saved'}"])
    loaded = build_policy(cfg.model, [])
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        with policy.reference():
            expected = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
        got = loaded.velocity(x, sigma, loaded.encode_prompts(EDITS[:2]), Guidance(cfg=True, guidance_scale=SCALE))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_folders_of_other_families_are_refused_in_one_line(folder, tmp_path):
    index = json.loads((folder / "model_index.json").read_text())
    for name, changes, family, words in (
        ("t2i", {"_class_name": "QwenImagePipeline"}, FAMILY, "no [library, class] for processor (a Qwen-Image-Edit"),
        ("edit", {}, "qwen_image", "holds a QwenImageEditPipeline (model.family=qwen_image_edit), not model.family=q"),
        ("flux", {"transformer": ["diffusers", "FluxTransformer2DModel"]}, FAMILY, "holds a FluxTransformer2DModel"),
    ):
        other = tmp_path / name
        other.mkdir()
        written = {**index, **changes}
        if name == "t2i":
            del written["processor"]
        (other / "model_index.json").write_text(json.dumps(written))
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.family={family}", f"model.pretrained={other}"])
        assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="Qwen-Image-Edit has no sequence parallelism") as err:
        load_config(None, [f"model.family={FAMILY}", "parallel.sequence_parallel=2"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="edits reference images: every prompt needs one"):
        load_config(None, [f"model.family={FAMILY}", "train.prompts=[a red cube]"])


def test_sizes_tokens_and_full_size_parameter_count(policy):
    """Qwen/Qwen-Image-Edit's transformer is Qwen-Image's: 20.43B parameters on the meta device; the references'
    resolutions; the random tokenizer's vision markers are the VL config's ids, after every trained word."""
    assert count_parameters(FAMILY, "full") == pytest.approx(20.43e9, rel=1e-3)
    spec = family_spec(FAMILY)
    assert [spec.sizes[s].reference_resolution for s in ("tiny", "small", "full")] == [64, 512, 1024]
    tokenizer, config = policy.tokenizers["tokenizer"], policy.text_encoders["text_encoder"].config
    ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.special_tokens]
    assert ids == list(range(len(tokenizer) - len(ids), len(tokenizer)))
    assert config.text_config.vocab_size == len(tokenizer)
    assert (config.image_token_id, config.vision_start_token_id) == (ids[4], ids[2])
    assert policy.tokenizers["processor"].tokenizer is tokenizer


# ---------------------------------------------------------------- runs, the certificate, exports


def test_lean_train_runs_every_schedule_on_the_bundled_edits(runs):
    for schedule, out in runs.items():
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["schedule"] == schedule and all(math.isfinite(r) for r in metrics["reward_mean"])
        assert (out / "lora" / LORA_WEIGHTS).is_file()
    assert (runs["recompute"] / "eval" / "1" / "edits.png").is_file()  # reference | base | trained


def test_float64_equivalence_passes_at_1e_10(tmp_path):
    args = ["equivalence", *sets(*FAST, f"model.family={FAMILY}", "model.dtype=float64"), "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and len(report["reference"]) == 3
    assert reference_gap(report) < 1e-10


def test_exported_lora_loads_into_the_edit_pipeline_which_samples_edits(policy, folder, runs, tmp_path):
    """The policy's LoRA in diffusers' format loads into QwenImageEditPipeline (its transformer then gives the policy's
    velocity); ``lean export`` of a run changes the pipeline's transformer output; ``lean sample`` draws an edit."""
    from test_export import assert_same_velocity

    save_diffusers_lora(policy.pipeline_class, policy.transformer, tmp_path / "lora")
    assert check_folders(folder, tmp_path / "lora") == FAMILY
    loaded = load_pipeline(folder, tmp_path / "lora", SampleOptions(device="cpu"), FAMILY)
    assert type(loaded).__name__ == "QwenImageEditPipeline"
    assert_same_velocity(policy, loaded.transformer)

    assert main(["export", "--run", str(runs["recompute"]), "--out", str(tmp_path / "exported")]) == 0
    settings = json.loads((tmp_path / "exported" / "lean_sampling.json").read_text())
    assert settings["pipeline"] == "QwenImageEditPipeline" and settings["true_cfg_scale"] is not None
    base = load_pipeline(folder, None, SampleOptions(device="cpu"), FAMILY)
    trained = load_pipeline(folder, tmp_path / "exported", SampleOptions(device="cpu"), FAMILY)
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        outs = [policy.runtime.forward(p.transformer, x, sigma, emb, None) for p in (base, trained)]
    assert (outs[0] - outs[1]).abs().max() > 0

    edits = write_edit_prompts(tmp_path / "data", count=1)
    out = tmp_path / "samples"
    files = sample(folder, tmp_path / "exported", edits, out, SampleOptions(device="cpu", num_steps=2))
    record = json.loads((out / "samples.jsonl").read_text())
    assert len(files) == 1 and files[0].is_file() and record["image"].endswith("images/0.png")


# ---------------------------------------------------------------- the FlowGRPO preset


def test_preset_cites_every_value_and_states_the_recipe():
    values = preset_value_lines("flowgrpo-qwen-image-edit")
    assert len(values) >= 40 and not uncited(values)
    cfg = load_config(None, [], preset="flowgrpo-qwen-image-edit")
    m, s, a, t = cfg.model, cfg.sample, cfg.algorithm, cfg.train
    assert (m.family, m.size, m.resolution, m.lora_rank, m.lora_alpha, m.lora_ffn) == (
        FAMILY,
        "full",
        512,
        64,
        128,
        True,
    )
    assert (s.num_steps, s.noise_level, s.guidance_scale, s.cfg, s.negative_prompt) == (10, 1.0, 4.0, True, " ")
    assert (a.beta, a.clip_range, t.group_size, t.prompts_per_iteration, t.optimizer_steps_per_iteration) == (
        0.0, 1e-4, 16, 32, 2
    )  # fmt: skip
