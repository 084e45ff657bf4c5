"""lean.models.wan22: Wan2.2-T2V-A14B's two experts (``transformer`` at sigma >= 0.875, ``transformer_2`` below)
against diffusers' WanPipeline with ``transformer_2``/``boundary_ratio`` on the same weights, the pipeline folder
round trip, the published size, every schedule, the float64 certificate and the two-file LoRA export.

The family-agnostic Policy checks of test_models.py are rerun here for ``wan22``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import test_models as generic
import torch
from helpers import lean_here

from lean.config import DEFAULT_PROMPTS
from lean.models import Guidance, build_policy, build_scheduler, count_parameters, family_spec
from lean.models.options import ModelConfig

BOUNDARY = 0.875


@pytest.fixture(scope="module")
def policy():
    """One tiny Wan2.2 policy for the module (both experts' LoRA perturbed so that the adapters matter)."""
    built = build_policy(ModelConfig(family="wan22"), DEFAULT_PROMPTS)
    built.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return built


@pytest.mark.parametrize("check", generic.POLICY_CONTRACT)
def test_policy_contract(check):
    getattr(generic, check)("wan22")


def test_the_spec_is_wan_with_two_experts_and_the_published_size():
    spec = family_spec("wan22")
    assert spec.denoiser_folders == ("transformer", "transformer_2") and spec.boundary == BOUNDARY
    assert spec.runtime is family_spec("wan").runtime and spec.pipeline == "WanPipeline"
    assert 14.0e9 < count_parameters("wan22", "full") < 14.5e9  # each expert: Wan2.1-T2V-14B's transformer


def transformer_calls(policy, pipe, **call) -> list[tuple]:
    """Run WanPipeline (latents, no CFG, seed 0) and record every call of each of the policy's denoisers:
    (denoiser index, hidden_states, timestep, encoder_hidden_states, output)."""
    calls = []

    def recorder(k):
        def hook(module, args, kwargs, output):
            calls.append((k, kwargs["hidden_states"], kwargs["timestep"], kwargs["encoder_hidden_states"], output[0]))

        return hook

    hooks = [net.register_forward_hook(recorder(k), with_kwargs=True) for k, net in enumerate(policy.denoisers)]
    try:
        with torch.no_grad():
            pipe(**call, guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        for h in hooks:
            h.remove()
    return calls


def test_each_expert_runs_on_its_side_of_the_boundary_as_in_the_wan_pipeline(policy, tmp_path):
    """WanPipeline's denoising loop (boundary_ratio 0.875, no CFG) on the policy's adapted experts: every transformer
    call is the expert lean picks for that sigma, and lean's velocity equals its output."""
    from diffusers import WanPipeline

    policy.save_pretrained(tmp_path, adapter=False)
    pipe = WanPipeline.from_pretrained(tmp_path, scheduler=build_scheduler("wan22", None))
    assert pipe.config.boundary_ratio == BOUNDARY
    pipe.transformer, pipe.transformer_2 = policy.denoisers  # the adapted weights
    size = {"height": policy.resolution, "width": policy.resolution}
    calls = transformer_calls(
        policy, pipe, prompt=list(DEFAULT_PROMPTS[:2]), **size, num_frames=5, num_inference_steps=4
    )
    assert {k for k, *_ in calls} == {0, 1}  # the four steps straddle the boundary
    emb = policy.encode_prompts(DEFAULT_PROMPTS[:2])
    for k, x, t, tokens, out in calls:
        sigma = t.to(policy.dtype) / 1000
        assert policy.denoiser_index(float(sigma[0])) == k
        with torch.no_grad():
            got = policy.velocity(x, sigma, dataclasses.replace(emb, tokens=tokens))
        torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)


def test_a_folder_saved_by_the_wan_pipeline_loads_as_model_pretrained(policy, tmp_path):
    """WanPipeline.save_pretrained of the random build (both experts, boundary_ratio) -> ``model.pretrained``: the
    same initial velocity on both sides of the boundary."""
    from diffusers import WanPipeline

    policy.save_pretrained(tmp_path / "lean", adapter=False)
    pipe = WanPipeline.from_pretrained(tmp_path / "lean", scheduler=build_scheduler("wan22", None))
    pipe.save_pretrained(tmp_path / "diffusers")
    assert json.loads((tmp_path / "diffusers" / "model_index.json").read_text())["boundary_ratio"] == BOUNDARY
    loaded = build_policy(ModelConfig(family="wan22", pretrained=str(tmp_path / "diffusers")), DEFAULT_PROMPTS)
    x, _, emb = generic.inputs(policy, batch=2)
    sigma = torch.tensor([0.95, 0.3], dtype=policy.dtype)
    with torch.no_grad(), policy.reference():  # the base weights: the folder holds no adapter
        expected = policy.velocity(x, sigma, emb)
    with torch.no_grad():
        got = loaded.velocity(x, sigma, loaded.encode_prompts(DEFAULT_PROMPTS[:2]))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_exported_lora_of_both_experts_loads_into_the_wan_pipeline(policy, tmp_path):
    """``lora/`` holds each expert's LoRA: ``pytorch_lora_weights.safetensors`` (transformer) and
    ``pytorch_lora_weights_transformer_2.safetensors`` (``load_into_transformer_2=True``); lean sample's loader loads
    both, and each expert then gives the policy's velocity on its side of the boundary."""
    from lean.export import save_policy_lora
    from lean.tools.sampling import SampleOptions, check_folders, load_pipeline

    base, lora = tmp_path / "base", tmp_path / "lora"
    policy.save_pretrained(base, adapter=False)
    save_policy_lora(policy, lora)
    assert sorted(p.name for p in lora.glob("*.safetensors")) == [
        "pytorch_lora_weights.safetensors",
        "pytorch_lora_weights_transformer_2.safetensors",
    ]
    assert check_folders(base, lora) == "wan22"  # a WanPipeline folder with transformer_2
    pipe = load_pipeline(base, lora, SampleOptions(device="cpu"), "wan22")
    x, _, emb = generic.inputs(policy, batch=2)
    sigma = torch.tensor([0.95, 0.3], dtype=policy.dtype)
    with torch.no_grad():
        expected = policy.velocity(x, sigma, emb)
        with policy.reference():
            base_v = policy.velocity(x, sigma, emb)
        for b, net in enumerate((pipe.transformer, pipe.transformer_2)):
            got = policy.runtime.forward(net, x[b : b + 1], sigma[b : b + 1], emb.index(b), None)
            torch.testing.assert_close(got, expected[b : b + 1], rtol=0, atol=1e-5)
            assert (expected[b] - base_v[b]).abs().max() > 1e-3  # the adapter matters


@pytest.mark.timeout(240)
def test_every_schedule_trains_across_the_boundary_and_the_certificate_passes(tmp_path):
    """`lean train` runs recompute, retain and reweight on a 3-step rollout whose trained steps (sigma 1 and 0.75)
    sit on both sides of the boundary, exporting both experts' LoRA; the float64 certificate passes."""
    from lean.sampling.sde import sigma_schedule

    sigmas = sigma_schedule(3, 3.0)[:-1]
    assert (sigmas >= BOUNDARY).any() and (sigmas < BOUNDARY).any()
    for schedule in ("recompute", "retain", "reweight"):
        lean_here(
            "train",
            *("--set", "model.family=wan22", "--set", f"train.schedule={schedule}", "--set", "train.iterations=1"),
            *("--set", "sample.num_steps=3", "--out", str(tmp_path / schedule)),
        )
        assert (tmp_path / schedule / "metrics.json").exists()
        assert (tmp_path / schedule / "lora" / "pytorch_lora_weights_transformer_2.safetensors").is_file()
    from safetensors.torch import load_file

    from lean.cli import main

    assert main(["export", "--run", str(tmp_path / "recompute"), "--out", str(tmp_path / "export")]) == 0
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors"):
        exported, trained = (load_file(tmp_path / d / name) for d in ("export", "recompute/lora"))
        assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    assert main(["export", "--run", str(tmp_path / "recompute"), "--out", str(tmp_path / "m"), "--merge"]) == 2
    eq = tmp_path / "eq"
    lean_here("equivalence", "--set", "model.family=wan22", "--set", "model.dtype=float64", "--out", str(eq))
    report = json.loads((eq / "equivalence.json").read_text())
    assert report["passes"]


def test_the_low_noise_expert_guides_at_its_own_scale(policy):
    """``sample.guidance_scale_2`` (WanPipeline's): each row's CFG scale is the one of the expert its sigma picks;
    ``lean sample`` passes it to the pipeline; a one-denoiser family refuses it in one line."""
    from lean.config import ConfigError
    from lean.configure import load_config
    from lean.export import sampling_settings

    emb = policy.encode_prompts(DEFAULT_PROMPTS[:2])
    x = torch.randn(2, *policy.init_latents([torch.Generator().manual_seed(0)]).shape[1:])
    sigma = torch.tensor([0.95, 0.5])  # the high-noise expert, then the low-noise one
    with torch.no_grad():
        v = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.0, guidance_scale_2=3.0))
        v_c = policy.velocity(x, sigma, emb)
        v_u = policy.velocity(x, sigma, policy.encode_prompts([""]).expand(2))
    for row, scale in enumerate((4.0, 3.0)):
        torch.testing.assert_close(v[row], v_u[row] + scale * (v_c[row] - v_u[row]), rtol=1e-5, atol=1e-5)
    cfg = load_config(None, ["model.family=wan22", "sample.guidance_scale=4", "sample.guidance_scale_2=3"])
    assert sampling_settings(cfg)["guidance_scale_2"] == 3.0
    with pytest.raises(ConfigError, match="one denoiser"):
        load_config(None, ["model.family=wan", "sample.guidance_scale_2=3"])


def test_the_gpu_plan_counts_both_experts_resident_and_one_per_pass():
    """``lean plan --gpus``: both experts' weights are resident (a pass runs one: the same activations and FLOPs as
    Wan2.1 with one transformer of the experts' shape)."""
    from lean.configure import load_config
    from lean.plan.meta import meta_plan

    sets = ["model.size=tiny", "model.resolution=32", "model.num_frames=5", "train.prompts_per_iteration=2"]
    rows = {}
    for family in ("wan", "wan22"):
        report = meta_plan(load_config(None, [f"model.family={family}", *sets]), gpus=1, gpu_mem_gb=80)
        rows[family] = next(
            r
            for r in report["combinations"]
            if r["schedule"] == "recompute" and r["layout"] == "slice" and not r["gradient_checkpointing"]
        )
    lora = report["published_size"]["trainable_parameters"]  # one expert's adapter
    expert_mb = (count_parameters("wan22", "tiny") + 3 * lora) * 4 / 2**20  # float32 weights; LoRA, its moments
    assert rows["wan22"]["base_mb"] - rows["wan"]["base_mb"] == pytest.approx(expert_mb, rel=0.05)
    assert rows["wan22"]["activation_mb"] == pytest.approx(rows["wan"]["activation_mb"], rel=1e-9)
    assert rows["wan22"]["time_iteration_s"] == pytest.approx(rows["wan"]["time_iteration_s"], rel=1e-9)


def test_frames_of_another_width_than_height_are_the_wan_pipelines(tmp_path):
    """``model.width`` (Wan's 480 x 832): the latent is [C, F', H/8, W/8] and lean's velocity is the transformer's
    output inside WanPipeline's own loop at that height and width; a square-only family refuses the key."""
    from diffusers import WanPipeline

    from lean.config import ConfigError
    from lean.configure import load_config

    policy = build_policy(ModelConfig(family="wan", resolution=32, width=64, num_frames=5), DEFAULT_PROMPTS)
    channels, frames, h, w = policy.runtime.noise_shape
    assert w == 2 * h and policy.runtime.image_seq_len == frames * h * w // 4  # 1x2x2 patches
    policy.save_pretrained(tmp_path, adapter=False)
    pipe = WanPipeline.from_pretrained(tmp_path, scheduler=build_scheduler("wan", None))
    calls = transformer_calls(
        policy, pipe, prompt=list(DEFAULT_PROMPTS[:1]), height=32, width=64, num_frames=5, num_inference_steps=2
    )
    emb = policy.encode_prompts(DEFAULT_PROMPTS[:1])
    for _, x, t, tokens, out in calls:
        assert x.shape[1:] == policy.runtime.noise_shape
        with torch.no_grad():
            got = policy.velocity(x, t / 1000, dataclasses.replace(emb, tokens=tokens))
        torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="renders square frames"):
        load_config(None, ["model.family=flux", "model.width=64"])
