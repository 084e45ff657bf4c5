"""lean.models.wan21_i2v and lean.models.wan22_i2v: Wan image-to-video (Wan2.1-I2V-14B-480P: one transformer that also
reads the image's CLIP states; Wan2.2-I2V-A14B: two experts split at sigma 0.9) against diffusers' own
WanImageToVideoPipeline on the same weights (the conditioning latent and mask beside the noisy latent, the CLIP
states, the text, each transformer call with CFG), the pipeline folder round trip, the exported LoRA in that pipeline,
the refusals, ``lean train`` with the reference frame in the evaluation grid, the float64 and bfloat16 certificates,
the published sizes and the Flow-Factory presets planned there.

One tiny float32 build per family (module-scoped) serves the tests that do not need float64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import FAST, lean_here, preset_value_lines, reference_gap, sets, spawn, uncited

from lean.config import ConfigError
from lean.config.prompts import read_prompts, reference_image
from lean.configure import load_config
from lean.models import Guidance, build_policy, build_scheduler, count_parameters, family_spec
from lean.models.checks import EDIT_PROMPTS
from lean.models.options import ModelConfig

FAMILIES = ("wan21_i2v", "wan22_i2v")
PRESETS = {"wan21_i2v": "flowfactory-grpo-wan21-i2v", "wan22_i2v": "flowfactory-grpo-wan22-i2v"}
PROMPTS = read_prompts(EDIT_PROMPTS)  # the bundled prompts, each with its image
ATOL = 1e-5  # float32


@pytest.fixture(scope="module", params=FAMILIES)
def policy(request):
    """The tiny float32 build of each family (5 frames), every adapter perturbed so that it matters."""
    built = build_policy(ModelConfig(family=request.param, num_frames=5), PROMPTS)
    built.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return built


def test_specs_and_sizes():
    one, two = family_spec("wan21_i2v"), family_spec("wan22_i2v")
    assert one.pipeline == two.pipeline == "WanImageToVideoPipeline" and one.reference_images and two.reference_images
    assert one.denoiser_folders == ("transformer",) and "image_encoder" in one.components
    assert two.denoiser_folders == ("transformer", "transformer_2") and two.boundary == 0.9
    assert "image_encoder" not in two.components and not two.processors
    assert one.runtime is two.runtime and one.scheduler["flow_shift"] == two.scheduler["flow_shift"] == 3.0
    for spec in (one, two):
        full = spec.size_config("full", "transformer")
        assert (full["in_channels"], full["out_channels"], full["num_layers"]) == (36, 16, 40)
    assert one.size_config("full", "transformer")["image_dim"] == 1280 and two.size_config("full", "transformer")[
        "image_dim"
    ] is None  # fmt: skip


def test_conditioning_latent_mask_and_clip_states(policy):
    """The reference is [mask; VAE latent of (image, black frames)]: the mask is 1 on latent frame 0 only; Wan2.1-I2V
    carries CLIP's states of the image in both CFG branches and its text padded to 512 tokens."""
    emb = policy.encode_prompts(PROMPTS[:2])
    frames, h, w = policy.runtime.noise_shape[1:]
    assert emb.reference.shape == (2, 20, frames, h, w)
    mask = emb.reference[:, :4]
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()
    assert torch.equal(emb.negative.reference, emb.reference)
    if policy.family == "wan21_i2v":
        assert emb.image.shape == (2, 17, 32) and torch.equal(emb.negative.image, emb.image)
        assert emb.tokens.shape[1] == 512 and not emb.tokens[:, policy.text_max_length :].any()
        assert (emb.image[0] - emb.image[1]).abs().max() > 1e-3  # each prompt's own image
    else:
        assert emb.image is None and emb.tokens.shape[1] == policy.text_max_length


def pipeline_calls(policy, pipe, prompts, steps: int, scale: float) -> list[dict]:
    """Run WanImageToVideoPipeline (CFG at ``scale``, seed 0, the text padded as lean pads it) on each prompt's image
    and record every call of each of the policy's denoisers (its index and keyword arguments, its output)."""
    from PIL import Image

    from lean.config.prompts import conditioning_pixels

    calls = []

    def recorder(k):
        return lambda module, args, kwargs, output: calls.append({"k": k, **kwargs, "out": output[0]})

    hooks = [net.register_forward_hook(recorder(k), with_kwargs=True) for k, net in enumerate(policy.denoisers)]
    side = policy.resolution
    # the text length lean pads to: 512 where the transformer reads CLIP states, else model.text_max_length (Wan's)
    length = 512 if policy.runtime.reads_image else policy.text_max_length
    try:
        for prompt in prompts:
            pixels = conditioning_pixels(prompt, side, None)
            image = Image.fromarray((pixels.permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
            with torch.no_grad():
                pipe(image=image, prompt=str(prompt), height=side, width=side, num_frames=5, guidance_scale=scale,
                     num_inference_steps=steps, max_sequence_length=length, output_type="latent",
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    return calls


def test_every_transformer_call_is_the_wan_i2v_pipelines(policy, tmp_path, monkeypatch):
    """WanImageToVideoPipeline, loaded from the policy's saved folder (the image encoder and its CLIPImageProcessor
    too) with the adapted denoisers in: its condition (mask and latent), CLIP states and text are lean's, and lean's
    velocity of the expert it picks for each sigma is each call's output, in both CFG branches."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan_i2v

    # ftfy (not installed) repairs mis-decoded text; the prompts here are plain ASCII, which it leaves as they are
    monkeypatch.setattr(pipeline_wan_i2v, "ftfy", SimpleNamespace(fix_text=lambda text: text), raising=False)

    policy.save_pretrained(tmp_path, adapter=False)
    pipe = WanImageToVideoPipeline.from_pretrained(tmp_path, scheduler=build_scheduler(policy.family, None))
    if policy.family == "wan22_i2v":
        assert pipe.config.boundary_ratio == 0.9 and pipe.image_encoder is None
        pipe.transformer, pipe.transformer_2 = policy.denoisers
    else:
        pipe.transformer = policy.transformer
    prompt = PROMPTS[1]
    calls = pipeline_calls(policy, pipe, [prompt], steps=2, scale=5.0)  # sigma 1 and 0.75: both experts
    emb = policy.encode_prompts([prompt])
    experts = {c["k"] for c in calls}
    assert len(calls) == 4 and experts == ({0, 1} if policy.family == "wan22_i2v" else {0})  # 2 steps x 2 branches
    for n, call in enumerate(calls):
        hidden, sigma = call["hidden_states"], call["timestep"].to(policy.dtype) / 1000
        torch.testing.assert_close(hidden[:, 16:], emb.reference, rtol=0, atol=ATOL)
        branch = emb if n % 2 == 0 else emb.negative  # the conditional forward first, then the unconditional
        torch.testing.assert_close(call["encoder_hidden_states"], branch.tokens, rtol=0, atol=ATOL)
        if policy.family == "wan21_i2v":
            torch.testing.assert_close(call["encoder_hidden_states_image"], emb.image, rtol=0, atol=ATOL)
        assert policy.denoiser_index(float(sigma[0])) == call["k"]
        with torch.no_grad():
            got = policy.runtime.forward(policy.denoisers[call["k"]], hidden[:, :16], sigma, branch, None)
        torch.testing.assert_close(got, call["out"], rtol=ATOL, atol=ATOL)


def test_a_folder_the_pipeline_saves_loads_as_model_pretrained(policy, tmp_path):
    """WanImageToVideoPipeline.save_pretrained of lean's folder loads as ``model.pretrained``: the same base velocity
    (CFG) from the same prompts and images."""
    from diffusers import WanImageToVideoPipeline

    policy.save_pretrained(tmp_path / "lean", adapter=False)
    scheduler = build_scheduler(policy.family, None)
    pipe = WanImageToVideoPipeline.from_pretrained(tmp_path / "lean", scheduler=scheduler)
    pipe.save_pretrained(tmp_path / "diffusers")
    index = json.loads((tmp_path / "diffusers" / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    loaded = build_policy(ModelConfig(family=policy.family, num_frames=5, pretrained=str(tmp_path / "diffusers")), [])
    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)])
    sigma = torch.tensor([0.95, 0.3])
    guided = Guidance(cfg=True, guidance_scale=5.0)
    with torch.no_grad(), policy.reference():  # the base weights: the folder holds no adapter
        expected = policy.velocity(x, sigma, policy.encode_prompts(PROMPTS[:2]), guided)
    with torch.no_grad():
        got = loaded.velocity(x, sigma, loaded.encode_prompts(PROMPTS[:2]), guided)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_the_exported_lora_loads_into_the_i2v_pipeline(policy, tmp_path):
    """``save_policy_lora`` -> lean sample's loader: WanImageToVideoPipeline on the base folder with the exported LoRA
    (Wan2.2's second expert from its own file, ``load_into_transformer_2``); the denoiser the pipeline runs at each
    sigma then gives the policy's velocity with the image's condition, not the base's."""
    from lean.export import save_policy_lora
    from lean.tools.sampling import SampleOptions, check_folders, load_pipeline

    base, lora = tmp_path / "base", tmp_path / "lora"
    policy.save_pretrained(base, adapter=False)
    save_policy_lora(policy, lora)
    experts = len(policy.denoisers)
    assert len(list(lora.glob("*.safetensors"))) == experts
    assert check_folders(base, lora) == policy.family
    pipe = load_pipeline(base, lora, SampleOptions(device="cpu"), policy.family)
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    nets = (pipe.transformer, pipe.transformer_2)[:experts]
    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)])
    sigma = torch.tensor([0.95, 0.3])  # both sides of Wan2.2's boundary
    emb = policy.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        expected = policy.velocity(x, sigma, emb)
        with policy.reference():
            base_v = policy.velocity(x, sigma, emb)
        for b in range(2):
            net = nets[policy.denoiser_index(float(sigma[b]))]
            got = policy.runtime.forward(net, x[b : b + 1], sigma[b : b + 1], emb.index(b), None)
            torch.testing.assert_close(got, expected[b : b + 1], rtol=0, atol=ATOL)
            assert (expected[b] - base_v[b]).abs().max() > 1e-3  # the adapter matters


def test_text_prompts_and_missing_images_are_refused(tmp_path):
    (tmp_path / "text.txt").write_text("a red cube\n")
    for family in FAMILIES:
        with pytest.raises(ConfigError, match="every prompt needs one"):
            load_config(None, [f"model.family={family}", f"train.prompts_file={tmp_path / 'text.txt'}"])
        with pytest.raises(ConfigError, match="only edits"):
            load_config(None, [f"model.family={family}", "model.edit=false"])
    assert all(reference_image(p) for p in load_config(None, ["model.family=wan21_i2v"]).train.prompts)
    runtime = family_spec("wan21_i2v").runtime
    policy = build_policy(ModelConfig(family="wan21_i2v", num_frames=5), PROMPTS)
    x = policy.init_latents([torch.Generator().manual_seed(0)])
    with pytest.raises(ValueError, match="an image per prompt"):
        policy.velocity(x, torch.tensor([0.5]), policy.encode_prompts(["a red cube"]))
    wider = runtime(policy.transformer.config, policy.vae.config, 32, 9)  # 9 frames: 3 latent frames, not 2
    with pytest.raises(ValueError, match="conditioning latent"):
        wider.forward(policy.transformer, wider.noise_to_latents(torch.zeros(1, *wider.noise_shape)),
                      torch.tensor([0.5]), policy.encode_prompts(PROMPTS[:1]), None)  # fmt: skip


def _sequence_parallel_worker(rank: int, world: int, port: int, family: str, out: str) -> None:
    """Velocity and LoRA gradients (float64, CFG off, both sides of the boundary) on one process, then with the
    video tokens split over ``world`` ranks (Wan's Ulysses attention), in every overlap method."""
    from datetime import timedelta

    import torch.distributed as dist
    from test_sequence_parallel import _rel, _velocity_and_grads

    from lean.models.sequence_parallel import enable
    from lean.parallel.overlap.p2p import METHODS, Overlap

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        policy = build_policy(ModelConfig(family=family, dtype="float64", lora_ffn=True, num_frames=5), PROMPTS[:2])
        policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, *policy.latent_shape(), generator=g, dtype=torch.float64)
        sigma, emb = torch.tensor([0.95, 0.3], dtype=torch.float64), policy.encode_prompts(PROMPTS[:2])
        weights = torch.randn(x.shape, generator=g, dtype=torch.float64)
        v_ref, g_ref = _velocity_and_grads(policy, x, sigma, emb, weights)
        sp = enable(policy.networks(), policy.runtime, Overlap(METHODS[0]))
        result = {}
        for method in METHODS:
            sp.ov = Overlap(method)
            v, grads = _velocity_and_grads(policy, x, sigma, emb, weights)
            dist.all_reduce(grads)  # each rank's gradient is its share's
            result[method] = [_rel(v, v_ref), _rel(grads, g_ref)]
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_sequence_parallel_velocity_and_gradients_equal_one_process(tmp_path):
    """Two ranks split Wan2.1-I2V's video tokens (the condition joined to them before the patch embedding; the CLIP
    and text context whole on each rank): the velocity and the LoRA gradients are one process's."""
    spawn(_sequence_parallel_worker, 2, "wan21_i2v", str(tmp_path), deadline_s=140)
    for rank in range(2):
        for velocity, grads in json.loads((tmp_path / f"rank{rank}.json").read_text()).values():
            assert velocity < 1e-12 and grads < 1e-12


# ---------------------------------------------------------------- runs, the certificates


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_lean_train_with_the_reference_in_the_evaluation_grid(family, tmp_path):
    """``lean train --set model.family=...`` (tiny): one iteration on the bundled prompts with their images (5
    frames), its evaluation at 9 frames (each image's conditioning latent encoded again at the eval's 3 latent
    frames) and its edits.png showing each prompt's reference image beside the samples."""
    from PIL import Image

    out = tmp_path / "run"
    evaluated = ("eval.every=1", "eval.samples_per_prompt=1", "eval.num_steps=2", "eval.num_frames=9")
    lean_here("train", *sets(*FAST, f"model.family={family}", *evaluated), "--out", str(out))
    metrics = json.loads((out / "metrics.json").read_text())
    assert all(math.isfinite(r) for r in metrics["reward_mean"])
    assert (out / "eval" / "1" / "edits.png").is_file()
    with Image.open(out / "eval" / "1" / "p000_s00.gif") as video:
        assert video.n_frames == 9


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_float64_certificate_passes_at_1e_10(family, tmp_path):
    """Retain and Reweight against Recompute in float64 (the rollout conditioned on each prompt's image)."""
    lean_here("equivalence", *sets(*FAST, f"model.family={family}", "model.dtype=float64"), "--out", str(tmp_path))
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and set(report["reference"]) == {"recompute", "retain", "reweight"}
    assert reference_gap(report) < 1e-10


@pytest.mark.timeout(120)
def test_bfloat16_certificate_runs(tmp_path):
    lean_here("equivalence", *sets(*FAST, "model.family=wan21_i2v", "model.dtype=bfloat16"), "--out", str(tmp_path))
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and all(0 < r["rel_norm_diff"] < 0.2 for r in report["reference"].values())


# ---------------------------------------------------------------- the Flow-Factory presets


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_preset_cites_every_value_and_plans_at_the_published_size(family, tmp_path):
    from lean.plan.cost import main as plan

    values = preset_value_lines(PRESETS[family])
    assert len(values) >= 40 and uncited(values) == []
    cfg = load_config(None, [], preset=PRESETS[family])
    m, s = cfg.model, cfg.sample
    assert (m.family, m.size, m.num_frames, m.lora_rank, m.lora_alpha, m.text_max_length) == (
        family, "full", 5, 64, 128, 512
    )  # fmt: skip
    published = {"wan21_i2v": (240, 10, 5.0, 3), "wan22_i2v": (480, 8, 3.5, 1)}[family]  # i2v.yaml
    assert (m.resolution, s.num_steps, s.guidance_scale, s.sde_window_max_start) == published
    report = plan(cfg, out=str(tmp_path))["published_size"]
    # Wan2.1-I2V-14B: T2V-14B's 14.29B plus every block's CLIP keys and the image embedder (the published "14B"
    # checkpoint holds 16.4B); each Wan2.2-I2V-A14B expert: T2V-14B's with 36 input channels
    expected = {"wan21_i2v": 16.395e9, "wan22_i2v": 14.289e9}[family]
    assert report["transformer_parameters"] == count_parameters(family, "full") == pytest.approx(expected, rel=1e-3)
    assert report["trainable_parameters"] > 0
