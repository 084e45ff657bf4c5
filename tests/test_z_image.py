"""lean.models.z_image: Z-Image policies against diffusers' own ZImagePipeline (prompt encoding, CFG as the pipeline
scales it, the negated velocity and reversed time, the Euler ODE on the static-shift grid, decoding), the text mask,
LoRA targets, sizes, ``lean train``, the float64 certificate under the three schedules, and the Flow-Factory preset
planned at the published size.

One tiny float32 build (module-scoped) serves the tests that do not need float64.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from helpers import FAST, preset_value_lines, reference_gap, sets, uncited

from lean.cli import main
from lean.config import DEFAULT_PROMPTS
from lean.configure import load_config
from lean.export import LORA_WEIGHTS, sampling_settings
from lean.models import Guidance, build_policy, count_parameters, family_spec, time_shift
from lean.models.options import ModelConfig
from lean.sampling.sde import ode_step, sigma_schedule
from lean.tools.sampling import SampleOptions, load_pipeline

FAMILY = "z_image"
PRESET = "flowfactory-grpo-z-image"
SCALE = 3.0  # the pipeline's guidance_scale g; lean's CFG scale is 1 + g
ATOL = 1e-5  # float32


def make(**overrides):
    return build_policy(ModelConfig(family=FAMILY, **overrides), DEFAULT_PROMPTS)


@pytest.fixture(scope="module")
def policy():
    """The shared tiny build (float32) with a non-zero LoRA."""
    p = make()
    p.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return p


@pytest.fixture(scope="module")
def pipe(policy, tmp_path_factory):
    """diffusers' ZImagePipeline from lean's folder of the shared build (LoRA merged into a copy), as ``lean sample``
    loads it, with the published scheduler (static shift 3)."""
    merged = copy.deepcopy(policy)
    merged.transformer = merged.transformer.merge_and_unload()
    folder = tmp_path_factory.mktemp("zimage") / "base"
    merged.save_pretrained(folder, adapter=False)
    return load_pipeline(folder, None, SampleOptions(device="cpu"), FAMILY)


def inputs(policy, batch: int = 2, seed: int = 0):
    x = policy.init_latents([torch.Generator().manual_seed(seed + b) for b in range(batch)])
    sigma = torch.linspace(0.3, 0.9, batch, dtype=policy.dtype)
    return x, sigma, policy.encode_prompts(DEFAULT_PROMPTS[:batch])


def test_architecture_lora_targets_and_geometry(policy):
    base = policy.transformer.get_base_model()
    assert type(base).__name__ == "ZImageTransformer2DModel"
    assert type(policy.vae).__name__ == "AutoencoderKL"
    assert type(policy.text_encoders["text_encoder"]).__name__ == "Qwen3Model"
    assert policy.runtime.noise_shape == (16, 8, 8) and policy.runtime.image_seq_len == 16
    names = [n for n, _ in policy.trainable_parameters()]
    for stack in ("noise_refiner", "context_refiner", "layers"):  # Flow-Factory's suffixes reach every block
        for layer in ("to_q", "to_k", "to_v", "to_out.0"):
            assert any(f"{stack}.0.attention.{layer}.lora_A" in n for n in names), (stack, layer)
    assert not any("feed_forward" in n or "adaLN" in n or "cap_embedder" in n for n in names)
    ffn = family_spec(FAMILY).lora_targets(True)
    suffixes = ("attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                "feed_forward.w2", "feed_forward.w3")  # fmt: skip
    flowfactory = [n for n, _ in base.named_modules() if n.endswith(suffixes)]
    assert len(flowfactory) == 3 * 7 and all(re.fullmatch(ffn, n) for n in flowfactory)
    with pytest.raises(ValueError, match="guidance"):
        policy.velocity(*inputs(policy, 1), Guidance(guidance_embed=3.5))
    with pytest.raises(ValueError, match="multiple of 8"):
        make(resolution=36)


def test_matches_z_image_pipeline(policy, pipe):
    """Prompt encoding (hidden_states[-2] of the real tokens), 3 CFG Euler steps on the published static-shift grid
    (lean's scale 1 + g against the pipeline's guidance_scale g) and decoding equal diffusers' ZImagePipeline."""
    prompts = DEFAULT_PROMPTS[:2]
    emb, uncond = policy.encode_prompts(prompts), policy.encode_prompts(["", ""])
    theirs, negative = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=policy.text_max_length)
    for ours, rows in ((emb, theirs), (uncond, negative)):
        for b, row in enumerate(rows):
            n = int(ours.mask[b].sum())
            assert n == len(row) and not ours.mask[b, n:].any()
            torch.testing.assert_close(ours.tokens[b, :n], row, rtol=0, atol=1e-6)

    shift, source = time_shift(FAMILY, None, None, policy.runtime.image_seq_len)
    assert shift == 3.0 and "published" in source
    sigmas = sigma_schedule(3, shift, "uniform")
    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)])
    kwargs = dict(prompt=prompts, guidance_scale=SCALE, num_inference_steps=3, height=32, width=32)
    kwargs["max_sequence_length"] = policy.text_max_length
    with torch.no_grad():
        expected = pipe(latents=x.clone(), output_type="latent", **kwargs).images
        torch.testing.assert_close(pipe.scheduler.sigmas.double(), sigmas, rtol=0, atol=1e-6)
        for i in range(3):
            v = policy.velocity(x, sigmas[i].expand(2), emb, Guidance(cfg=True, guidance_scale=1 + SCALE))
            x = ode_step(v, x, sigmas, i)
        torch.testing.assert_close(x, expected, rtol=ATOL, atol=ATOL)
        images = pipe(latents=policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)]),
                      output_type="pt", **kwargs).images  # fmt: skip
    torch.testing.assert_close(policy.decode(x), images, rtol=ATOL, atol=ATOL)


def test_export_hands_the_pipeline_its_own_guidance_scale_and_sample_draws(pipe, tmp_path):
    """lean's CFG scale s is ZImagePipeline's guidance_scale g + 1 (test_matches_z_image_pipeline): lean export writes
    g = s - 1, and 0 (the pipeline's no-CFG) for a run without CFG; ``lean sample`` draws with the pipeline."""
    guided = load_config(None, [f"model.family={FAMILY}", "sample.cfg=true", "sample.guidance_scale=4.5"])
    assert sampling_settings(guided)["guidance_scale"] == 3.5 and sampling_settings(guided)["true_cfg_scale"] is None
    assert sampling_settings(load_config(None, [], preset=PRESET))["guidance_scale"] == 0.0  # default.yaml:54
    folder = tmp_path / "base"
    pipe.save_pretrained(folder)
    (tmp_path / "prompts.txt").write_text("a red cube\n")
    out = tmp_path / "samples"
    args = ["sample", "--pretrained", str(folder), "--prompts-file", str(tmp_path / "prompts.txt"), "--out", str(out)]
    assert main([*args, "--num-steps", "2", "--resolution", "32", "--guidance-scale", "0"]) == 0
    assert (out / "00000.png").is_file()


def test_pipeline_folder_loads_as_model_pretrained(policy, pipe, tmp_path):
    """A folder saved by ZImagePipeline.save_pretrained loads as model.pretrained: its fresh LoRA (B = 0) gives the
    velocity of the shared build whose LoRA the folder has merged."""
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline" and index["text_encoder"] == ["transformers", "Qwen3Model"]
    loaded = build_policy(
        load_config(None, [f"model.family={FAMILY}", f"model.pretrained={tmp_path / 'saved'}"]).model, []
    )
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        expected = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.0))
        got = loaded.velocity(
            x, sigma, loaded.encode_prompts(DEFAULT_PROMPTS[:2]), Guidance(cfg=True, guidance_scale=4.0)
        )
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


def test_text_mask_makes_the_velocity_independent_of_padding():
    """A prompt alone (its own length) and in a batch padded to a longer prompt give the same velocity; without the
    mask (the padding read as text) it changes."""
    policy = make(dtype="float64", text_max_length=32)
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    short, long = "a cat", DEFAULT_PROMPTS[0] + " " + DEFAULT_PROMPTS[1]
    emb, alone = policy.encode_prompts([short, long]), policy.encode_prompts([short])
    n = alone.tokens.shape[1]
    assert emb.tokens.shape[1] > n and alone.mask.all() and not emb.mask[0, n:].any()
    x = policy.init_latents([torch.Generator().manual_seed(0)] * 2)
    sigma = torch.tensor([0.6, 0.6], dtype=torch.float64)
    with torch.no_grad():
        padded = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.0))
        single = policy.velocity(x[:1], sigma[:1], alone, Guidance(cfg=True, guidance_scale=4.0))
        unmasked = policy.runtime.forward(policy.transformer, x, sigma, type(emb)(emb.tokens), None)
        masked = policy.runtime.forward(policy.transformer, x, sigma, emb, None)
    torch.testing.assert_close(padded[:1], single, rtol=1e-10, atol=1e-12)
    assert (unmasked[:1] - masked[:1]).abs().max() > 1e-6


def test_float64_gradients_reach_every_lora_factor():
    policy = make(dtype="float64")
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    assert {p.dtype for p in policy.parameters()} == {torch.float64}
    x, sigma, emb = inputs(policy)
    v = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.0))
    assert v.dtype == torch.float64
    v.square().mean().backward()
    grads = [p.grad for _, p in policy.trainable_parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_sizes_and_full_size_parameter_count():
    """Z-Image's transformer: width 3840, 30 + 2 + 2 blocks, 6.15B parameters (the published "6B"), counted on the
    meta device."""
    assert count_parameters(FAMILY, "full") == pytest.approx(6.155e9, rel=1e-3)
    assert count_parameters(FAMILY, "tiny") < count_parameters(FAMILY, "small") < 1e7


# ---------------------------------------------------------------- runs, the certificate


def test_lean_train_trains_one_iteration(tmp_path):
    """``lean train --set model.family=z_image`` (tiny, CLI): one iteration, a finite reward, the LoRA written."""
    out = tmp_path / "run"
    assert main(["train", *sets(*FAST, f"model.family={FAMILY}"), "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["schedule"] == "recompute" and all(math.isfinite(r) for r in metrics["reward_mean"])
    assert json.loads((out / "config.json").read_text())["model"]["family"] == FAMILY
    assert (out / "lora" / LORA_WEIGHTS).is_file()


def test_float64_equivalence_passes_at_1e_10(tmp_path, capsys):
    args = ["equivalence", *sets(*FAST, f"model.family={FAMILY}", "model.dtype=float64"), "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and "PASS" in capsys.readouterr().out
    assert set(report["reference"]) == {"recompute", "retain", "reweight"}
    assert reference_gap(report) < 1e-10


# ---------------------------------------------------------------- the Flow-Factory preset


def test_preset_cites_every_value_and_plans_at_the_published_size(tmp_path):
    from lean.plan.cost import main as plan

    values = preset_value_lines(PRESET)
    assert len(values) >= 40 and uncited(values) == []
    cfg = load_config(None, [], preset=PRESET)
    m, s, a, t = cfg.model, cfg.sample, cfg.algorithm, cfg.train
    assert (m.family, m.size, m.resolution, m.lora_rank, m.lora_alpha, m.lora_ffn) == (
        FAMILY,
        "full",
        512,
        64,
        128,
        True,
    )
    assert (s.num_steps, s.noise_level, s.cfg, s.sde_window, s.sde_window_min_start, s.sde_window_max_start) == (
        6, 0.7, False, 1, 1, 3
    )  # fmt: skip
    assert (a.clip_range, a.beta, t.group_size, t.prompts_per_iteration) == (1e-4, 0.0, 16, 48)
    assert time_shift(FAMILY, None, s.shift, 1024)[0] == 3.0  # the published static shift
    report = plan(cfg, out=str(tmp_path))["published_size"]
    assert report["transformer_parameters"] == pytest.approx(6.155e9, rel=1e-3)
    assert report["trainable_parameters"] > 0


def test_the_meta_plan_extrapolated_from_shallow_stacks_is_the_whole_count():
    """``lean plan --gpus`` probes on the meta device with the three stacks (noise refiner, context refiner, layers)
    cut short and extrapolates: every figure equals the count of the whole depth (small: 1 + 1 + 4 blocks)."""
    from lean.plan.meta import block_runs, depth_extrapolated, meta_input, meta_probe

    inp = meta_input(load_config(None, [f"model.family={FAMILY}", "model.size=small", "model.resolution=32"]), 1)
    net = inp.policy.denoisers[0].get_base_model()
    assert [n for _, _, n in block_runs(net, family_spec(FAMILY).block_lists)] == [1, 1, 4]
    whole = meta_probe(inp, flops_per_s=1e12)
    extrapolated = depth_extrapolated(inp, lambda i: meta_probe(i, flops_per_s=1e12))
    assert whole["activation_mb"] > 0 and whole.keys() == extrapolated.keys()
    for key, value in whole.items():
        if isinstance(value, float):
            assert extrapolated[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
