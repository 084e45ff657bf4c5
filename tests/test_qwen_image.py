"""lean.models.qwen_image: Qwen-Image policies against diffusers' own QwenImagePipeline (prompt encoding, true CFG with
the norm rescale, the Euler ODE, decoding), the text mask, a pipeline folder saved by the diffusers class as
``model.pretrained``, folders of other families refused, LoRA targets, sizes, ``lean train`` on every schedule, the
float64 certificate, the exported LoRA in the diffusers pipeline, ``lean sample`` and the FlowGRPO preset.

One tiny float32 build (module-scoped) serves every test that does not need float64; the family-agnostic Policy
checks of test_models.py that hold under Qwen-Image's CFG are rerun for ``qwen_image``, and the two that assume
v = v_u + s (v_c - v_u) are restated with the per-token rescale.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import test_models as generic
import torch
from helpers import FAST, preset_value_lines, reference_gap, renorm, sets, train_every_schedule, uncited

from lean.cli import main
from lean.config import DEFAULT_PROMPTS, ConfigError
from lean.configure import load_config
from lean.export import LORA_WEIGHTS, sampling_settings, save_diffusers_lora
from lean.models import Guidance, build_policy, count_parameters, family_spec, time_shift
from lean.models.options import ModelConfig
from lean.models.qwen_image.model import PIPELINE_PREFIX_TOKENS, PROMPT_TEMPLATE, prefix_tokens
from lean.sampling.sde import ode_step, sigma_schedule
from lean.tools.sampling import SampleOptions, check_folders, load_pipeline

FAMILY = "qwen_image"
SCALE = 4.0
ATOL = 1e-5  # float32


def make(**overrides):
    return build_policy(ModelConfig(family=FAMILY, **overrides), DEFAULT_PROMPTS)


@pytest.fixture(scope="module")
def policy():
    """The shared tiny build (float32, fresh LoRA: B = 0)."""
    return make()


@pytest.fixture(scope="module")
def perturbed(policy):
    """A copy of the shared build with a non-zero LoRA."""
    p = copy.deepcopy(policy)
    p.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return p


@pytest.fixture(scope="module")
def folder(policy, tmp_path_factory):
    """The shared build as lean writes a pipeline folder (no scheduler/)."""
    path = tmp_path_factory.mktemp("qwen") / "base"
    policy.save_pretrained(path, adapter=False)
    return path


@pytest.fixture(scope="module")
def pipe(policy, folder):
    """diffusers' QwenImagePipeline from lean's folder as ``lean sample`` loads it, with the static shift of lean's
    dynamic one at 32 px (a static shift drops the scheduler's terminal stretch: lean's grids have none), so that
    both walk the same sigmas."""
    shift, _ = time_shift(FAMILY, None, None, policy.runtime.image_seq_len)
    return load_pipeline(folder, None, SampleOptions(device="cpu", shift=shift), FAMILY)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``lean train`` (tiny Qwen-Image, CLI) with each schedule, one iteration."""
    return train_every_schedule(tmp_path_factory.mktemp("runs"), FAMILY)


def inputs(policy, batch: int = 4, seed: int = 0):
    x = policy.init_latents([torch.Generator().manual_seed(seed + b) for b in range(batch)])
    sigma = torch.linspace(0.2, 0.9, batch, dtype=policy.dtype)
    return x, sigma, policy.encode_prompts(DEFAULT_PROMPTS[:batch])


# ---------------------------------------------------------------- the generic policy contract


@pytest.mark.parametrize(
    "check",
    ["test_reference_is_the_base_model", "test_init_latents_do_not_depend_on_batching"],
)
def test_policy_contract(check):
    getattr(generic, check)(FAMILY)


def test_float64_end_to_end():
    """test_models' float64 check, except that the last block's text-stream output (``attn.to_add_out``) feeds
    nothing (the transformer reads the image tokens only), so its LoRA has no gradient, as in FlowGRPO's run."""
    policy = generic.perturbed(FAMILY, dtype="float64")
    assert {p.dtype for p in policy.parameters()} == {torch.float64}  # transformer, LoRA, VAE, text encoders
    x, sigma, emb = inputs(policy)
    assert x.dtype == emb.tokens.dtype == torch.float64
    v = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
    assert v.dtype == torch.float64
    v.square().mean().backward()
    last = len(policy.transformer.get_base_model().transformer_blocks) - 1
    grads = {n: p.grad for n, p in policy.trainable_parameters()}
    dead = {n for n in grads if f"transformer_blocks.{last}.attn.to_add_out." in n}
    assert len(dead) == 2 and all(grads[n] is None for n in dead)
    live = [g for n, g in grads.items() if n not in dead]
    assert all(g is not None and g.dtype == torch.float64 and torch.isfinite(g).all() for g in live)
    assert sum(g.abs().sum() for g in live) > 0
    image = policy.decode(x[:1])
    assert image.dtype == torch.float32 and torch.isfinite(image).all()


def test_save_pretrained_round_trip(tmp_path):
    generic.test_save_pretrained_round_trip(FAMILY, tmp_path)


def test_cfg_is_renormalised_and_batches_as_two_forwards():
    """v = (v_u + s (v_c - v_u)) |v_c| / |.| per token; one [uncond, cond] batch (text rows of different lengths,
    padded and masked) equals two forwards; with grad on, v_u runs apart."""
    policy = generic.perturbed(FAMILY, dtype="float64")
    x, sigma, emb = inputs(policy)
    uncond = policy.encode_prompts([""] * len(x))
    with torch.no_grad():
        batched = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
        v_u = policy.velocity(x, sigma, uncond)
        v_c = policy.velocity(x, sigma, emb)
    split = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
    torch.testing.assert_close(batched, renorm(v_u, v_c, SCALE), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(split.detach(), batched, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(batched.norm(dim=-1), v_c.norm(dim=-1), rtol=1e-12, atol=0)
    assert (batched - (v_u + SCALE * (v_c - v_u))).abs().max() > 1e-3  # the rescale acts

    # uncond_grad: the gradient of the rescaled combination with v_u detached, or live
    params = [p for _, p in policy.trainable_parameters()]
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)

    def grads(v):  # the last block's to_add_out LoRA is unused (test_float64_end_to_end): zero
        g = torch.autograd.grad((v * w).sum(), params, allow_unused=True)
        return [torch.zeros_like(p) if d is None else d for d, p in zip(g, params, strict=True)]

    def vel(e, **kw):
        return policy.velocity(x, sigma, e, Guidance(guidance_scale=SCALE, **kw))

    detached, live = grads(vel(emb, cfg=True)), grads(vel(emb, cfg=True, uncond_grad=True))
    by_hand_detached = grads(renorm(vel(uncond).detach(), vel(emb), SCALE))
    by_hand_live = grads(renorm(vel(uncond), vel(emb), SCALE))
    for a, b, c, d in zip(detached, by_hand_detached, live, by_hand_live, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(c, d, rtol=1e-9, atol=1e-12)
    assert sum((a - c).abs().sum() for a, c in zip(detached, live)) > 1e-6


def test_text_mask_makes_the_velocity_independent_of_padding():
    """A prompt alone (its own length, mask of ones) and in a batch padded to a longer prompt give the same velocity."""
    policy = generic.perturbed(FAMILY, dtype="float64", text_max_length=32)
    short, long = "a cat", DEFAULT_PROMPTS[0] + " " + DEFAULT_PROMPTS[1]
    emb = policy.encode_prompts([short, long])
    alone = policy.encode_prompts([short])
    n = alone.tokens.shape[1]
    assert emb.tokens.shape[1] > n and alone.mask.all() and emb.mask[0, :n].all() and not emb.mask[0, n:].any()
    assert emb.tokens[0, n:].abs().max() == 0 and emb.mask.dtype == torch.long
    x, sigma = (
        policy.init_latents([torch.Generator().manual_seed(0)] * 2),
        torch.tensor([0.6, 0.6], dtype=torch.float64),
    )
    with torch.no_grad():
        padded = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
        single = policy.velocity(x[:1], sigma[:1], alone, Guidance(cfg=True, guidance_scale=SCALE))
        unmasked = policy.runtime.forward(policy.transformer, x, sigma, type(emb)(emb.tokens), None)
    torch.testing.assert_close(padded[:1], single, rtol=1e-10, atol=1e-12)
    assert (unmasked[:1] - policy.runtime.forward(policy.transformer, x, sigma, emb, None)[:1]).abs().max() > 1e-6


def test_architecture_lora_targets_and_template(policy):
    base = policy.transformer.get_base_model()
    assert type(base).__name__ == "QwenImageTransformer2DModel" and len(base.transformer_blocks) == 1
    assert type(policy.vae).__name__ == "AutoencoderKLQwenImage"
    assert type(policy.text_encoders["text_encoder"]).__name__ == "Qwen2_5_VLForConditionalGeneration"
    names = [n for n, _ in policy.trainable_parameters()]
    for layer in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        assert any(f"transformer_blocks.0.attn.{layer}.lora_A" in n for n in names), layer
    assert not any("_mlp" in n or "img_mod" in n or "txt_in" in n for n in names)
    ffn = family_spec(FAMILY).lora_targets(True)
    for module in ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"):
        assert re.fullmatch(ffn, f"transformer_blocks.7.{module}"), module  # FlowGRPO's MLP targets
    modules = [n for n, _ in base.named_modules()]
    flowgrpo = [
        n for n in modules if n.endswith(("attn.to_q", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.0.proj"))
    ]
    assert flowgrpo and all(re.fullmatch(ffn, n) for n in flowgrpo)
    # the template's prefix, counted with the tokenizer in use (the real Qwen2 tokenizer gives the pipeline's 34)
    tokenizer = policy.tokenizers["tokenizer"]
    drop = prefix_tokens(tokenizer)
    assert drop > 0 and PIPELINE_PREFIX_TOKENS == 34
    ids = tokenizer(PROMPT_TEMPLATE.format("a red cube"), add_special_tokens=False).input_ids
    assert ids[:drop] == tokenizer(PROMPT_TEMPLATE.split("{}")[0], add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="guidance"):
        policy.velocity(*inputs(policy, 1), Guidance(guidance_embed=3.5))
    with pytest.raises(ValueError, match="multiple of 8"):
        make(resolution=36)


def test_matches_qwen_image_pipeline(policy, pipe):
    """Prompt encoding, 3 true-CFG Euler steps (norm rescale, dynamic shift) and decoding equal diffusers'
    QwenImagePipeline on the same weights and sigmas."""
    prompts = DEFAULT_PROMPTS[:2]
    assert pipe.prompt_template_encode_start_idx == prefix_tokens(policy.tokenizers["tokenizer"])  # lean sample's
    tokens, mask = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=policy.text_max_length)
    neg, neg_mask = pipe.encode_prompt(["", ""], device="cpu", max_sequence_length=policy.text_max_length)
    emb, uncond = policy.encode_prompts(prompts), policy.encode_prompts(["", ""])
    torch.testing.assert_close(emb.tokens, tokens, rtol=0, atol=1e-6)
    torch.testing.assert_close(uncond.tokens, neg, rtol=0, atol=1e-6)
    for ours, theirs in ((emb.mask, mask), (uncond.mask, neg_mask)):  # the pipeline drops an all-ones mask
        assert torch.equal(ours, theirs) if theirs is not None else bool(ours.all())

    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)])
    kwargs = dict(
        prompt_embeds=tokens,
        prompt_embeds_mask=emb.mask,
        negative_prompt_embeds=neg,
        negative_prompt_embeds_mask=uncond.mask,
        true_cfg_scale=SCALE,
        num_inference_steps=3,
        height=32,
        width=32,
    )
    expected = pipe(latents=x.clone(), output_type="latent", **kwargs).images
    shift, source = time_shift(FAMILY, None, None, policy.runtime.image_seq_len)
    assert "dynamic" in source and shift == pytest.approx(math.exp(0.5 + 0.4 * (16 - 256) / (8192 - 256)))
    sigmas = sigma_schedule(3, shift, "uniform")
    torch.testing.assert_close(pipe.scheduler.sigmas.double(), sigmas, rtol=0, atol=1e-6)
    with torch.no_grad():
        for i in range(3):
            v = policy.velocity(x, sigmas[i].expand(2), emb, Guidance(cfg=True, guidance_scale=SCALE))
            x = ode_step(v, x, sigmas, i)
    torch.testing.assert_close(x, expected, rtol=ATOL, atol=ATOL)
    images = pipe(
        latents=policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)]), output_type="pt", **kwargs
    )
    torch.testing.assert_close(policy.decode(x), images.images, rtol=ATOL, atol=ATOL)


def test_lean_grid_is_the_published_schedulers_stretched_one():
    """Qwen-Image's scheduler_config.json sets shift_terminal 0.02: with sample.shift and sample.shift_terminal unset
    lean resolves both from it, and its grid is the scheduler's dynamically shifted, stretched one (what FlowGRPO's
    rollout walks); a static shift drops the stretch (lean sample then passes the stretched grid as sigmas)."""
    import numpy as np

    from lean.models import build_scheduler, terminal_stretch

    n, tokens = 10, 1024  # 512 px
    shift, _ = time_shift(FAMILY, None, None, tokens)
    terminal = terminal_stretch(FAMILY, None, None, None)
    assert terminal == 0.02 and terminal_stretch(FAMILY, None, 2.0, None) is None
    assert terminal_stretch(FAMILY, None, 2.0, 0.05) == 0.05
    scheduler = build_scheduler(FAMILY, None)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=math.log(shift))
    lean_grid = sigma_schedule(n, shift, "uniform", terminal)
    torch.testing.assert_close(scheduler.sigmas.double(), lean_grid, rtol=0, atol=1e-6)
    assert lean_grid[-2].item() == pytest.approx(0.02, abs=1e-7)
    static = build_scheduler(FAMILY, None, shift=2.0)
    static.set_timesteps(sigmas=[1.0, 0.5])
    assert static.config.shift_terminal is None and static.sigmas[-2].item() == pytest.approx(2 / 3, abs=1e-6)


def test_pipeline_folder_loads_as_model_pretrained(policy, pipe, tmp_path):
    """A tiny pipeline saved with QwenImagePipeline.save_pretrained loads as model.pretrained and gives the initial
    velocity of the random build it came from."""
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline" and index["scheduler"][1] == "FlowMatchEulerDiscreteScheduler"
    cfg = load_config(None, [f"model.family={FAMILY}", f"model.pretrained={tmp_path / 'saved'}"])
    loaded = build_policy(cfg.model, [])
    x, _, emb = inputs(policy, 2)
    sigma = torch.ones(2)
    with torch.no_grad():
        expected = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
        got = loaded.velocity(
            x, sigma, loaded.encode_prompts(DEFAULT_PROMPTS[:2]), Guidance(cfg=True, guidance_scale=SCALE)
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_folders_of_other_families_are_refused_in_one_line(folder, tmp_path):
    other = tmp_path / "flux"
    other.mkdir()
    index = json.loads((folder / "model_index.json").read_text())
    index.update(_class_name="FluxPipeline", transformer=["diffusers", "FluxTransformer2DModel"])
    (other / "model_index.json").write_text(json.dumps(index))
    for family, path, words in (
        (FAMILY, other, "holds a FluxTransformer2DModel, not model.family=qwen_image's QwenImageTransformer2DModel"),
        ("flux", folder, "no [library, class] for text_encoder_2, tokenizer_2 (a FLUX pipeline)"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.family={family}", f"model.pretrained={path}"])
        assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="Qwen-Image has no sequence parallelism") as err:
        load_config(None, [f"model.family={FAMILY}", "parallel.sequence_parallel=2"])
    assert "\n" not in str(err.value)


def test_sizes_and_full_size_parameter_count():
    """Qwen/Qwen-Image's transformer: 60 blocks of width 3072, 20.43B parameters (the published "20B"), counted on
    the meta device."""
    n = count_parameters(FAMILY, "full")
    assert n == pytest.approx(20.43e9, rel=1e-3)
    assert count_parameters(FAMILY, "tiny") < count_parameters(FAMILY, "small") < 1e7


# ---------------------------------------------------------------- runs, the certificate, exports


def test_lean_train_runs_every_schedule(runs):
    for schedule, out in runs.items():
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["schedule"] == schedule and all(math.isfinite(r) for r in metrics["reward_mean"])
        assert json.loads((out / "config.json").read_text())["model"]["family"] == FAMILY
        assert (out / "lora" / LORA_WEIGHTS).is_file()


def test_float64_equivalence_passes_at_1e_10(tmp_path, capsys):
    args = ["equivalence", *sets(*FAST, f"model.family={FAMILY}", "model.dtype=float64"), "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["passes"] and "PASS" in capsys.readouterr().out
    assert reference_gap(report) < 1e-10


def test_lora_folder_loads_into_the_diffusers_pipeline(perturbed, folder, tmp_path):
    """diffusers' LoRA format (alpha != rank is kept in the metadata): load_lora_weights, then the pipeline's
    transformer is lean's policy, and the adapter changes its output."""
    policy = perturbed
    save_diffusers_lora(policy.pipeline_class, policy.transformer, tmp_path / "lora")
    family = check_folders(folder, tmp_path / "lora")
    base = load_pipeline(folder, None, SampleOptions(device="cpu"), family)
    loaded = load_pipeline(folder, tmp_path / "lora", SampleOptions(device="cpu"), family)
    x, sigma, emb = inputs(policy, 2)
    with torch.no_grad():
        expected = policy.velocity(x, sigma, emb)
        got = policy.runtime.forward(loaded.transformer, x, sigma, emb, None)
        without = policy.runtime.forward(base.transformer, x, sigma, emb, None)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    assert (got - without).abs().max() > 100 * ATOL


def test_export_and_sample(runs, folder, tmp_path):
    """lean export of a run writes a folder QwenImagePipeline.load_lora_weights takes (the trained weights change
    the transformer's output); lean sample draws with it, guiding with true_cfg_scale."""
    run = runs["recompute"]
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "exported")]) == 0
    settings = json.loads((tmp_path / "exported" / "lean_sampling.json").read_text())
    assert settings == sampling_settings(load_config(tree=json.loads((run / "config.json").read_text())))
    assert settings["pipeline"] == "QwenImagePipeline" and settings["guidance_scale"] is None
    assert settings["true_cfg_scale"] == 4.5 and settings["sigma_grid"] == "euler"
    family = check_folders(folder, tmp_path / "exported")
    base = load_pipeline(folder, None, SampleOptions(device="cpu"), family)
    pipe = load_pipeline(folder, tmp_path / "exported", SampleOptions(device="cpu"), family)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outs = [
            p.transformer(hidden_states=x, encoder_hidden_states=hidden, timestep=torch.tensor([0.5, 0.5]),
                          img_shapes=[(1, 4, 4)] * 2, return_dict=False)[0]
            for p in (base, pipe)
        ]  # fmt: skip
    assert (outs[0] - outs[1]).abs().max() > 0
    (tmp_path / "prompts.txt").write_text("a red cube\n")
    sample = ["sample", "--pretrained", str(folder), "--lora", str(tmp_path / "exported")]
    out = tmp_path / "samples"
    assert main([*sample, "--prompts-file", str(tmp_path / "prompts.txt"), "--out", str(out), "--num-steps", "2"]) == 0
    assert (out / "00000.png").is_file() and json.loads((out / "samples.jsonl").read_text())["prompt"] == "a red cube"


# ---------------------------------------------------------------- the FlowGRPO preset


def test_preset_cites_every_value_and_states_the_recipe():
    values = preset_value_lines("flowgrpo-qwen-image")
    assert len(values) >= 40 and not uncited(values)
    cfg = load_config(None, [], preset="flowgrpo-qwen-image")
    m, s, a, t = cfg.model, cfg.sample, cfg.algorithm, cfg.train
    assert (m.family, m.size, m.resolution, m.lora_rank, m.lora_alpha, m.lora_ffn) == (
        FAMILY,
        "full",
        512,
        64,
        128,
        True,
    )
    assert (s.num_steps, s.noise_level, s.guidance_scale, s.cfg, s.sde_window, s.sde_window_max_start) == (
        10, 1.2, 4.0, True, 2, 3
    )  # fmt: skip
    assert (a.beta, a.clip_range, t.group_size, t.prompts_per_iteration, t.optimizer_steps_per_iteration) == (
        0.0, 1e-4, 16, 32, 2
    )  # fmt: skip
    shift, _ = time_shift(FAMILY, None, s.shift, 1024)  # 512 px: 32 x 32 packed tokens
    assert shift == pytest.approx(math.exp(0.5 + 0.4 * 768 / 7936))


def test_negative_prompt_is_cfgs_unconditional_branch(policy):
    """sample.negative_prompt (FlowGRPO's Qwen-Image: " ") is what CFG guides against; the pipeline sets it."""
    from helpers import tiny

    from lean.train import Trainer

    x, sigma, emb = inputs(policy, batch=2)
    try:
        policy.negative_prompt = "a red cube"
        with torch.no_grad():
            guided = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
            v_u = policy.velocity(x, sigma, policy.encode_prompts(["a red cube"] * 2))
            v_c = policy.velocity(x, sigma, emb)
            policy.negative_prompt = ""
            against_empty = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
    finally:
        policy.negative_prompt = ""
    torch.testing.assert_close(guided, renorm(v_u, v_c, SCALE), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(guided, against_empty)
    assert Trainer(tiny("sample.negative_prompt=blurry")).policy.negative_prompt == "blurry"


def test_terminal_stretch_refuses_nonsense_in_one_line():
    from lean.tools.sampling import SampleOptions

    with pytest.raises(ConfigError, match=r"sample\.shift_terminal.*must be in \(0, 1\)"):
        load_config(None, [f"model.family={FAMILY}", "sample.shift_terminal=1.5"])
    with pytest.raises(ConfigError, match="euler and uniform grids only"):
        load_config(
            None,
            [
                "model.family=wan",
                "sample.sigma_grid=unipc",
                "sample.sde_kind=flow_grpo_linear",
                "sample.shift_terminal=0.02",
            ],
        )
    with pytest.raises(ConfigError, match="set --sigma-grid"):
        SampleOptions(shift_terminal=0.02).validate(FAMILY)
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\)"):
        SampleOptions(shift_terminal=2.0, sigma_grid="uniform", shift=3.0).validate(FAMILY)
