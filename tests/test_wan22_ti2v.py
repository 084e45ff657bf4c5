"""lean.models.wan22_ti2v: Wan2.2-TI2V-5B in text-to-video mode against diffusers' WanPipeline with
``expand_timesteps=True`` on the same weights (the per-token timestep inside the pipeline's own denoising loop, CFG,
the Wan2.2 VAE's normalisation and decode), the geometry read from the VAE config (16x spatial as published), the
published size, the pipeline folders (TI2V told from Wan2.1 by its 48-channel VAE, either refused as the other), the
exported LoRA in the pipeline, and from the command line: every schedule trains, the float64 certificate passes, ``lean
plan`` counts the published size and ``lean sample`` draws.

One tiny build for the module (:func:`built`); the family-agnostic Policy checks of test_models.py are rerun here.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import test_models as generic
import torch
from helpers import sets, train_every_schedule

from lean.cli import main
from lean.config import DEFAULT_PROMPTS, ConfigError
from lean.configure import load_config
from lean.models import (
    Guidance,
    build_policy,
    build_scheduler,
    count_parameters,
    family_spec,
    pipeline_family,
    time_shift,
)
from lean.models.footprint import component_config
from lean.models.options import ModelConfig

FAMILY = "wan22_ti2v"
B = 2
FRAMES = 5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny build with a perturbed adapter (so that it matters), its folder as lean writes it (``lean``), and
    that folder loaded by WanPipeline with TI2V-5B's ``expand_timesteps`` and saved again by it (``diffusers``)."""
    from diffusers import WanPipeline

    policy = build_policy(ModelConfig(family=FAMILY), DEFAULT_PROMPTS)
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    root = tmp_path_factory.mktemp(FAMILY)
    policy.save_pretrained(root / "lean", adapter=False)
    pipe = WanPipeline.from_pretrained(root / "lean", scheduler=build_scheduler(FAMILY, None), expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(root / "diffusers")
    return dict(policy=policy, pipe=pipe, lean=root / "lean", diffusers=root / "diffusers")


def inputs(policy, seed: int = 0):
    x = policy.init_latents([torch.Generator().manual_seed(seed + b) for b in range(B)])
    return x, torch.tensor([0.9, 0.35], dtype=policy.dtype), policy.encode_prompts(DEFAULT_PROMPTS[:B])


@pytest.mark.parametrize("check", generic.POLICY_CONTRACT)
def test_policy_contract(check):
    getattr(generic, check)(FAMILY)


def test_the_spec_and_the_geometry_follow_the_vae_config():
    """Wan's spec with the TI2V runtime and sizes; the latent geometry comes from the VAE config: 48 channels, the
    published 16x spatial and 4x temporal factors at full size (8x spatial at tiny), Wan2.1's 8x unchanged."""
    from lean.models.wan.model import Wan
    from lean.models.wan22_ti2v.model import Wan22TI2V

    spec, wan = family_spec(FAMILY), family_spec("wan")
    assert spec.pipeline == "WanPipeline" and spec.denoiser_folders == ("transformer",) and spec.boundary is None
    assert issubclass(spec.runtime, Wan) and spec.runtime is Wan22TI2V and spec.sequence_parallel
    assert spec.scheduler["flow_shift"] == 5.0 and spec.lora_attention == wan.lora_attention
    assert time_shift(FAMILY, None, None, 8)[0] == 5.0  # sample.shift null: the published flow_shift
    assert 4.95e9 < count_parameters(FAMILY, "full") < 5.05e9  # Wan2.2-TI2V-5B's transformer: 5.00B

    def runtime(family: str, size: str, resolution: int, frames: int):
        s = family_spec(family)
        t, vae = (component_config(s, name, size) for name in ("transformer", "vae"))
        return s.runtime(t, vae, resolution, frames)

    full = runtime(FAMILY, "full", 960, 121)  # lean's square beside the published 704 x 1280, 121 frames
    assert full.noise_shape == (48, 31, 60, 60) and full.image_seq_len == 31 * 30 * 30
    tiny = runtime(FAMILY, "tiny", 32, FRAMES)
    assert tiny.latent_shape == (48, 2, 4, 4) and tiny.image_seq_len == 8
    assert runtime("wan", "full", 480, 81).noise_shape == (16, 21, 60, 60)  # Wan2.1: 8x spatial
    with pytest.raises(ValueError, match="multiple of 32"):
        runtime(FAMILY, "full", 720, 121)  # 45 latent rows would not patchify 2x2
    with pytest.raises(ConfigError, match="multiple of 32 pixels") as err:  # refused before anything is built
        load_config(None, [f"model.family={FAMILY}", "model.size=full", "model.resolution=720"])
    assert "\n" not in str(err.value)
    assert load_config(None, ["model.family=wan", "model.size=full", "model.resolution=720"]).model.resolution == 720


def test_the_velocity_is_the_transformer_inside_the_wan_pipeline_loop(built):
    """WanPipeline's own loop (expand_timesteps, CFG, UniPC at flow_shift 5) on the policy's adapted transformer:
    every call gets the timestep on each of its 8 video tokens, and lean's velocity of that call's input equals its
    output; lean decodes the final latents into the pipeline's video."""
    from diffusers import WanPipeline

    policy, pipe = built["policy"], built["pipe"]
    assert pipe.config.expand_timesteps and pipe.vae_scale_factor_spatial == 8
    pipe.transformer = policy.transformer  # the adapted weights
    calls, final = [], {}

    def hook(module, args, kwargs, output):
        calls.append((kwargs["hidden_states"], kwargs["timestep"], kwargs["encoder_hidden_states"], output[0]))

    def last(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    call = dict(
        prompt=list(DEFAULT_PROMPTS[:B]),
        height=policy.resolution,
        width=policy.resolution,
        num_frames=FRAMES,
        num_inference_steps=3,
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(0),
    )
    handle = policy.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            video = pipe(**call, output_type="pt", callback_on_step_end=last).frames
    finally:
        handle.remove()
    assert len(calls) == 6  # 3 steps x (conditional, unconditional)
    emb = policy.encode_prompts(DEFAULT_PROMPTS[:B])
    for x, t, tokens, out in calls:
        assert t.shape == (B, policy.runtime.image_seq_len) and (t == t[:, :1]).all()  # one timestep per token
        sigma = t[:, 0].to(policy.dtype) / 1000
        with torch.no_grad():
            got = policy.velocity(x, sigma, dataclasses.replace(emb, tokens=tokens))
        torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        decoded = policy.decode(final["latents"])
    torch.testing.assert_close(decoded, video.permute(0, 2, 1, 3, 4), rtol=1e-5, atol=1e-5)

    # WanPipeline without expand_timesteps (a folder whose index lacks it) gives the transformer one timestep per
    # sample: in text-to-video the same modulation on every token, the same video to float32 rounding
    plain = WanPipeline(**pipe.components)
    assert not plain.config.expand_timesteps
    plain.set_progress_bar_config(disable=True)
    with torch.no_grad():
        latents = plain(**{**call, "generator": torch.Generator().manual_seed(0)}, output_type="latent").frames
    torch.testing.assert_close(latents, final["latents"], rtol=1e-5, atol=1e-5)


def test_pipeline_folders_load_and_are_told_from_wan21(built, tmp_path):
    """The folder WanPipeline saved (expand_timesteps in its index) is a TI2V-5B folder, as is lean's own; it loads
    as ``model.pretrained`` with the random build's velocity to the bit. A Wan2.1 folder (16-channel VAE) is Wan's,
    and each is refused as the other in one line."""
    policy = built["policy"]
    for folder in ("diffusers", "lean"):  # lean writes FamilySpec.pipeline_config into its index too
        assert json.loads((built[folder] / "model_index.json").read_text())["expand_timesteps"] is True
    assert pipeline_family(built["diffusers"]) == pipeline_family(built["lean"]) == FAMILY
    loaded = build_policy(ModelConfig(family=FAMILY, pretrained=str(built["diffusers"])), DEFAULT_PROMPTS)
    x, sigma, emb = inputs(policy)
    with torch.no_grad(), policy.reference():  # the base weights: the folder holds no adapter
        expected = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.0))
    with torch.no_grad():
        got = loaded.velocity(
            x, sigma, loaded.encode_prompts(DEFAULT_PROMPTS[:B]), Guidance(cfg=True, guidance_scale=4.0)
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    wan = tmp_path / "wan"
    build_policy(ModelConfig(family="wan"), DEFAULT_PROMPTS).save_pretrained(wan, adapter=False)
    assert pipeline_family(wan) == "wan"
    for family, folder, holds in [(FAMILY, wan, "16-channel VAE (model.family=wan)"), ("wan", built["lean"], "48")]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.family={family}", f"model.pretrained={folder}"])
        assert "\n" not in str(err.value) and f"holds a {holds}" in str(err.value)
        assert f"not model.family={family}'s" in str(err.value)


def test_the_exported_lora_loads_into_the_wan_pipeline(built, tmp_path):
    """``save_policy_lora`` -> lean sample's loader (``load_lora_weights``): the pipeline's transformer then gives
    the policy's velocity, not the base's."""
    from lean.export import save_policy_lora
    from lean.tools.sampling import SampleOptions, check_folders, load_pipeline

    policy = built["policy"]
    save_policy_lora(policy, tmp_path / "lora")
    assert check_folders(built["diffusers"], tmp_path / "lora") == FAMILY
    pipe = load_pipeline(built["diffusers"], tmp_path / "lora", SampleOptions(device="cpu"), FAMILY)
    assert pipe.config.expand_timesteps
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        got = policy.runtime.forward(pipe.transformer, x, sigma, emb, None)
        expected = policy.velocity(x, sigma, emb)
        with policy.reference():
            base = policy.velocity(x, sigma, emb)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (expected - base).abs().max() > 1e-3  # the adapter matters


@pytest.mark.timeout(240)
def test_cli_schedules_certificate_export_plan_and_sample(built, tmp_path, capsys):
    """`lean train` runs recompute, retain and reweight (one iteration each); `lean equivalence` passes in float64 at
    1e-10; `lean export` writes a LoRA folder with which WanPipeline's transformer computes the trained policy's
    velocity; `lean plan` counts the published size on the meta device; `lean sample` draws a video with it."""
    from diffusers import WanPipeline

    runs = train_every_schedule(tmp_path, FAMILY)
    for schedule, folder in runs.items():
        assert json.loads((folder / "metrics.json").read_text())["schedule"] == schedule

    assert main(["equivalence", *sets(f"model.family={FAMILY}", "model.dtype=float64"), "--out", "eq"]) == 0
    assert json.loads((tmp_path / "eq" / "equivalence.json").read_text())["passes"]

    assert main(["export", "--run", str(runs["recompute"]), "--out", "exported"]) == 0
    base = built["diffusers"]  # the run's random transformer (its weights do not depend on the prompts)
    trained = build_policy(ModelConfig(family=FAMILY, pretrained=str(base)), DEFAULT_PROMPTS)
    trained.load_lora(runs["recompute"] / "lora.safetensors")
    pipe = WanPipeline.from_pretrained(base)
    x, sigma, emb = inputs(trained)
    with torch.no_grad():
        before = trained.runtime.forward(pipe.transformer, x, sigma, emb, None)
        pipe.load_lora_weights(tmp_path / "exported")
        after = trained.runtime.forward(pipe.transformer, x, sigma, emb, None)
        expected = trained.velocity(x, sigma, emb)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
    assert (after - before).abs().max() > 1e-6  # the trained adapter is not the identity

    capsys.readouterr()
    assert main(["plan", *sets(f"model.family={FAMILY}", "model.size=full"), "--out", "plan"]) == 0
    assert "wan22_ti2v/full is not built on a CPU" in capsys.readouterr().out

    (tmp_path / "prompts.txt").write_text(f"{DEFAULT_PROMPTS[0]}\n")
    args = ["--pretrained", str(base), "--lora", "exported", "--prompts-file", "prompts.txt"]
    options = ["--num-steps", "2", "--resolution", "32", "--num-frames", str(FRAMES), "--out", "video"]
    assert main(["sample", *args, *options]) == 0
    assert len(list((tmp_path / "video" / "00000").iterdir())) == FRAMES
