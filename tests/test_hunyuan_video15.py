"""lean.models.hunyuan_video15: HunyuanVideo-1.5 text-to-video policies against diffusers' own HunyuanVideo15Pipeline
(both text encoders, the transformer calls inside the pipeline's loop with its guider's CFG, the Euler ODE on its
shifted grid, decoding), the packed text masks, a pipeline folder saved by the diffusers class as
``model.pretrained``, the published size, ``lean train`` on every schedule, the float64 certificate and the exported
LoRA in the pipeline's transformer.

One tiny float32 build (module-scoped, fresh LoRA) serves the pipeline comparisons, one float64 build (perturbed
LoRA) the exactness checks; the family-agnostic Policy checks of test_models.py that hold are rerun for
``hunyuan_video15``, and the float64 one is restated (the last block's text-stream output feeds nothing).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import test_models as generic
import torch
from helpers import FAST, reference_gap, sets, train_every_schedule

from lean.cli import main
from lean.config import DEFAULT_PROMPTS, ConfigError
from lean.configure import load_config
from lean.export import LORA_WEIGHTS, save_diffusers_lora
from lean.models import (
    Guidance,
    build_policy,
    build_scheduler,
    count_parameters,
    family_spec,
    pipeline_family,
    time_shift,
)
from lean.models.hunyuan_video15.model import (
    GLYPH_MAX_LENGTH,
    PIPELINE_PREFIX_TOKENS,
    SYSTEM_MESSAGE,
    glyph_text,
    prefix_tokens,
)
from lean.models.options import ModelConfig
from lean.sampling.sde import ode_step, sigma_schedule

FAMILY = "hunyuan_video15"
SCALE = 6.0  # the published guider's guidance_scale
ATOL = 1e-5  # float32
GLYPH = 'a red sign that says "lean"'  # quoted text: the byT5 stream
PROMPTS = [DEFAULT_PROMPTS[0], GLYPH]
VOCABULARY = [*DEFAULT_PROMPTS, GLYPH]


def make(**overrides):
    return build_policy(ModelConfig(family=FAMILY, **overrides), VOCABULARY)


def generators(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + b) for b in range(n)]


@pytest.fixture(scope="module")
def policy():
    """The shared tiny build (float32, fresh LoRA: B = 0, so the policy is its base)."""
    return make()


@pytest.fixture(scope="module")
def policy64():
    """A float64 build with a non-zero LoRA."""
    built = make(dtype="float64")
    built.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return built


@pytest.fixture(scope="module")
def folder(policy, tmp_path_factory):
    """The shared build as lean writes a pipeline folder (no scheduler/, no guider/)."""
    path = tmp_path_factory.mktemp("hunyuan") / "base"
    policy.save_pretrained(path, adapter=False)
    return path


@pytest.fixture(scope="module")
def pipe(policy, folder):
    """diffusers' HunyuanVideo15Pipeline from lean's folder with the published scheduler (shift 5) and guider (CFG
    6.0), its template crop counted with lean's tokenizer and its Qwen prompt length lean's ``model.text_max_length``
    (the real ones: 108 and 1000)."""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(
        folder, scheduler=build_scheduler(FAMILY, None), guider=ClassifierFreeGuidance(guidance_scale=SCALE)
    )
    assert pipe.prompt_template_encode_start_idx == PIPELINE_PREFIX_TOKENS and pipe.tokenizer_max_length == 1000
    pipe.prompt_template_encode_start_idx = prefix_tokens(policy.tokenizers["tokenizer"])
    pipe.tokenizer_max_length = policy.text_max_length
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- the generic policy contract


@pytest.mark.parametrize(
    "check",
    [
        "test_cfg_batch_equals_two_forwards",
        "test_reference_is_the_base_model",
        "test_init_latents_do_not_depend_on_batching",
    ],
)
def test_policy_contract(check):
    getattr(generic, check)(FAMILY)


def test_uncond_grad(policy64):
    """test_models' check with the last block's unused ``to_add_out`` LoRA (test_float64_end_to_end) counted as a
    zero gradient: a detached v_u leaves d(s v_c); uncond_grad=True gives d((1 - s) v_u + s v_c)."""
    policy, s = policy64, 2.5
    x, sigma, emb = generic.inputs(policy, batch=2)
    uncond = policy.encode_prompts([""] * 2)
    params = [p for _, p in policy.trainable_parameters()]
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)

    def grads(v):
        g = torch.autograd.grad((v * w).sum(), params, allow_unused=True)
        return [torch.zeros_like(p) if d is None else d for d, p in zip(g, params, strict=True)]

    def velocity(e, cfg=False, **kw):
        return policy.velocity(x, sigma, e, Guidance(cfg=cfg, guidance_scale=s, **kw))

    g_detached, g_full = grads(velocity(emb, cfg=True)), grads(velocity(emb, cfg=True, uncond_grad=True))
    g_c, g_mix = grads(s * velocity(emb)), grads((1 - s) * velocity(uncond) + s * velocity(emb))
    for gd, gf, gc, gm in zip(g_detached, g_full, g_c, g_mix, strict=True):
        torch.testing.assert_close(gd, gc, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(gf, gm, rtol=1e-9, atol=1e-12)
    assert sum((gf - gd).abs().sum() for gf, gd in zip(g_full, g_detached)) > 1e-6  # the uncond half does matter


def test_float64_end_to_end(policy64):
    """test_models' float64 check, except that the last block's text-stream output (``attn.to_add_out``) feeds
    nothing (the transformer returns the video tokens only), so its LoRA has no gradient."""
    policy = policy64
    assert {p.dtype for p in policy.parameters()} == {torch.float64}  # transformer, LoRA, VAE, both text encoders
    x, sigma, emb = generic.inputs(policy, batch=2)
    assert x.dtype == emb.tokens.dtype == torch.float64
    v = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
    assert v.dtype == torch.float64
    v.square().mean().backward()
    last = len(policy.transformer.get_base_model().transformer_blocks) - 1
    grads = {n: p.grad for n, p in policy.trainable_parameters()}
    dead = {n for n in grads if f"transformer_blocks.{last}.attn.to_add_out." in n}
    assert len(dead) == 2 and all(grads[n] is None for n in dead)
    live = [g for n, g in grads.items() if n not in dead]
    assert all(g is not None and g.dtype == torch.float64 and torch.isfinite(g).all() for g in live)
    assert sum(g.abs().sum() for g in live) > 0
    policy.zero_grad(set_to_none=True)
    video = policy.decode(x[:1])
    assert video.shape == (1, 3, 5, 32, 32) and video.dtype == torch.float32 and torch.isfinite(video).all()


# ---------------------------------------------------------------- against HunyuanVideo15Pipeline


def test_text_conditioning_is_the_pipelines(policy, pipe):
    """Both encoders as the pipeline runs them: Qwen2.5-VL's hidden_states[-3] after the chat template's prefix, the
    byT5 states of the quoted text; lean keeps each row's real tokens (the pipeline pads to its maximum lengths)."""
    assert pipe.system_message == SYSTEM_MESSAGE and pipe.tokenizer_2_max_length == GLYPH_MAX_LENGTH
    tokenizer = policy.tokenizers["tokenizer"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": "a red cube"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == f"<|im_start|>system\n{SYSTEM_MESSAGE}<|im_end|>\n<|im_start|>user\na red cube<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    assert glyph_text(GLYPH) == 'Text "lean". ' and glyph_text(DEFAULT_PROMPTS[0]) is None
    width = policy.runtime.text_dim
    for prompts in (PROMPTS, [""]):
        tokens, mask, glyphs, glyph_mask = pipe.encode_prompt(prompts, device="cpu", batch_size=len(prompts))
        emb = policy.encode_prompts(prompts)
        assert emb.mask.dtype == torch.long and set(emb.mask.unique().tolist()) <= {0, 1, 2, 3}
        for b in range(len(prompts)):
            n, g = int((emb.mask[b] % 2).sum()), int((emb.mask[b] // 2).sum())
            assert n == int(mask[b].sum()) and mask[b, :n].all() and g == int(glyph_mask[b].sum())
            torch.testing.assert_close(emb.tokens[b, :n, :width], tokens[b, :n], rtol=0, atol=1e-6)
            torch.testing.assert_close(emb.tokens[b, :g, width:], glyphs[b, :g], rtol=0, atol=1e-6)
            assert emb.tokens[b, n:, :width].abs().sum() == 0 and emb.tokens[b, g:, width:].abs().sum() == 0
    assert int((policy.encode_prompts([GLYPH]).mask // 2).sum()) > 0  # the quoted text reaches byT5


def test_velocity_is_the_pipelines_transformer_call_and_its_loop(policy, pipe):
    """HunyuanVideo15Pipeline's denoising loop (3 steps, its guider's CFG, shift 5): every transformer call (the
    conditional and the unconditional batch) is lean's on lean's own prompt embeddings (the pipeline's zero condition
    channels and its 729 zero image tokens are T2V's: lean appends the former and passes none of the latter), and
    lean's CFG Euler steps on the "uniform" grid land on the pipeline's latents."""
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((kwargs, out[0])), with_kwargs=True
    )
    x = policy.init_latents(generators(2))
    try:
        with torch.no_grad():
            expected = pipe(
                prompt=PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=3, latents=x.clone(),
                output_type="latent",
            ).frames  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 6  # 3 steps x (conditional, unconditional)
    emb, uncond = policy.encode_prompts(PROMPTS), policy.encode_prompts(["", ""])
    channels = policy.runtime.channels
    for k, (kwargs, out) in enumerate(calls):
        hidden = kwargs["hidden_states"]
        assert hidden.shape[1] == 2 * channels + 1 and hidden[:, channels:].abs().max() == 0
        assert kwargs["image_embeds"].shape[1] == 729 and kwargs["image_embeds"].abs().max() == 0
        sigma = kwargs["timestep"] / 1000
        with torch.no_grad():
            got = policy.runtime.forward(policy.transformer, hidden[:, :channels], sigma, (emb, uncond)[k % 2], None)
        torch.testing.assert_close(got, out, rtol=ATOL, atol=ATOL)

    shift, source = time_shift(FAMILY, None, None, policy.runtime.image_seq_len)
    assert shift == 5.0 and "published" in source
    sigmas = sigma_schedule(3, shift, "uniform")
    torch.testing.assert_close(pipe.scheduler.sigmas.double(), sigmas, rtol=0, atol=1e-6)
    with torch.no_grad():
        for i in range(3):
            x = ode_step(
                policy.velocity(x, sigmas[i].expand(2), emb, Guidance(cfg=True, guidance_scale=SCALE)), x, sigmas, i
            )
    torch.testing.assert_close(x, expected, rtol=ATOL, atol=ATOL)


def test_decoding_is_the_pipelines(policy, pipe):
    """One Euler step and the VAE decode, one video (the class's mid-block attention mask broadcasts wrongly for
    several videos in one call, so lean decodes them one at a time)."""
    x = policy.init_latents(generators(1, seed=7))
    with torch.no_grad():
        frames = pipe(
            prompt=PROMPTS[:1],
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=1,
            latents=x.clone(),
            output_type="pt",
        ).frames  # fmt: skip  [1, F, 3, H, W] in [0, 1]
        sigmas = sigma_schedule(1, 5.0, "uniform")
        v = policy.velocity(x, sigmas[:1], policy.encode_prompts(PROMPTS[:1]), Guidance(cfg=True, guidance_scale=SCALE))
        video = policy.decode(ode_step(v, x, sigmas, 0))
    assert video.shape == (1, 3, 5, 32, 32)
    torch.testing.assert_close(video, frames.permute(0, 2, 1, 3, 4), rtol=ATOL, atol=ATOL)


def test_masks_make_the_velocity_independent_of_padding(policy64):
    """A prompt alone (its own lengths) and in a batch padded to a longer prompt with glyph text give the same
    velocity; dropping the masks changes it."""
    short = "a cat"
    emb, alone = policy64.encode_prompts([short, GLYPH]), policy64.encode_prompts([short])
    n = alone.tokens.shape[1]
    assert emb.tokens.shape[1] > n and (alone.mask == 1).all() and (emb.mask[0, n:] == 0).all()
    x = policy64.init_latents(generators(1) * 2)
    sigma = torch.tensor([0.6, 0.6], dtype=torch.float64)
    with torch.no_grad():
        padded = policy64.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=SCALE))
        single = policy64.velocity(x[:1], sigma[:1], alone, Guidance(cfg=True, guidance_scale=SCALE))
        unmasked = policy64.runtime.forward(
            policy64.transformer, x, sigma, type(emb)(emb.tokens, mask=torch.ones_like(emb.mask)), None
        )
    torch.testing.assert_close(padded[:1], single, rtol=1e-10, atol=1e-12)
    assert (unmasked[:1] - policy64.runtime.forward(policy64.transformer, x, sigma, emb, None)[:1]).abs().max() > 1e-6


def test_pipeline_folder_loads_as_model_pretrained(policy, pipe, tmp_path):
    """HunyuanVideo15Pipeline.save_pretrained of the random build (with its scheduler and guider) is recognised,
    loads as model.pretrained and gives the velocity of the build it came from, bit for bit."""
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideo15Pipeline" and index["guider"][1] == "ClassifierFreeGuidance"
    assert pipeline_family(tmp_path / "saved") == FAMILY
    cfg = load_config(None, [f"model.family={FAMILY}", f"model.pretrained={tmp_path / 'saved'}"])
    assert time_shift(FAMILY, cfg.model.pretrained, None, 32)[0] == 5.0  # its scheduler_config.json
    loaded = build_policy(cfg.model, [])
    x = policy.init_latents(generators(2))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        expected = policy.velocity(x, sigma, policy.encode_prompts(PROMPTS), Guidance(cfg=True, guidance_scale=SCALE))
        got = loaded.velocity(x, sigma, loaded.encode_prompts(PROMPTS), Guidance(cfg=True, guidance_scale=SCALE))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_lora_folder_loads_into_the_pipelines_transformer(policy, folder, tmp_path):
    """HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42 (no load_lora_weights): lean writes diffusers' LoRA
    file all the same (alpha 16 != rank 8 in its metadata), which the pipeline's transformer loads with
    ``load_lora_adapter``; it then is lean's policy, and the adapter changes its output."""
    from diffusers import HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    assert not hasattr(HunyuanVideo15Pipeline, "load_lora_weights")
    perturbed = copy.deepcopy(policy)
    perturbed.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    save_diffusers_lora(perturbed.pipeline_class, perturbed.transformer, tmp_path / "lora")
    assert (tmp_path / "lora" / LORA_WEIGHTS).is_file()
    base = HunyuanVideo15Transformer3DModel.from_pretrained(folder / "transformer")
    adapted = HunyuanVideo15Transformer3DModel.from_pretrained(folder / "transformer")
    adapted.load_lora_adapter(tmp_path / "lora", prefix="transformer", weight_name=LORA_WEIGHTS)
    x = policy.init_latents(generators(2))
    sigma, emb = torch.tensor([0.8, 0.3]), perturbed.encode_prompts(PROMPTS)
    with torch.no_grad():
        expected = perturbed.velocity(x, sigma, emb)
        got = perturbed.runtime.forward(adapted, x, sigma, emb, None)
        without = perturbed.runtime.forward(base, x, sigma, emb, None)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    assert (got - without).abs().max() > 100 * ATOL


# ---------------------------------------------------------------- the spec, sizes, refusals


def test_spec_sizes_and_the_published_size(capsys):
    """The 480p T2V transformer: 54 blocks of width 2048, 8.33B parameters (meta device), as lean.plan.cost's
    published-size count prints it; lean plan's meta-device probe refuses the family in one line."""
    from lean.plan import cost as plan

    spec = family_spec(FAMILY)
    assert spec.pipeline == "HunyuanVideo15Pipeline" and spec.vae.temporal_compression == 4 and not spec.true_cfg
    assert spec.scheduler["shift"] == 5.0 and not spec.scheduler["use_dynamic_shifting"]
    assert count_parameters(FAMILY, "full") == pytest.approx(8.3266e9, rel=1e-4)
    assert count_parameters(FAMILY, "tiny") < count_parameters(FAMILY, "small") < 2e7
    full = spec.sizes["full"]
    assert (full.transformer["in_channels"], full.vae["latent_channels"], full.vae["spatial_compression_ratio"]) == (
        65, 32, 16
    )  # fmt: skip
    plan.main(load_config(None, [f"model.family={FAMILY}", "model.size=full"]))
    assert "hunyuan_video15/full is not built on a CPU; on the meta device its transformer has 8.33B" in (
        capsys.readouterr().out
    )
    # lean plan's meta-device probe cannot run the transformer (its forward reads tensor values): one line
    assert main(["plan", *sets(f"model.family={FAMILY}", "model.size=full")]) == 2
    err = capsys.readouterr().err
    assert "the meta device cannot run HunyuanVideo15Transformer3DModel" in err and len(err.strip().splitlines()) == 1


def test_refusals_are_one_line(folder, tmp_path):
    other = tmp_path / "wan"
    other.mkdir()
    index = json.loads((folder / "model_index.json").read_text())
    index.update(_class_name="WanPipeline", transformer=["diffusers", "WanTransformer3DModel"])
    (other / "model_index.json").write_text(json.dumps(index))
    for family, path, words in (
        (
            FAMILY,
            other,
            "holds a WanTransformer3DModel, not model.family=hunyuan_video15's HunyuanVideo15Transformer3D",
        ),
        ("wan", folder, "holds a HunyuanVideo15Transformer3DModel, not model.family=wan's WanTransformer3DModel"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.family={family}", f"model.pretrained={path}"])
        assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="HunyuanVideo-1.5 has no sequence parallelism") as err:
        load_config(None, [f"model.family={FAMILY}", "parallel.sequence_parallel=2"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="4k\\+1 frames"):
        load_config(None, [f"model.family={FAMILY}", "model.num_frames=4"])
    with pytest.raises(ValueError, match="guidance"):
        policy = build_policy(ModelConfig(family=FAMILY), VOCABULARY)
        policy.velocity(*generic.inputs(policy, 1), Guidance(guidance_embed=3.5))


# ---------------------------------------------------------------- runs, the certificate, exports


@pytest.mark.timeout(900)
def test_every_schedule_trains_the_certificate_passes_and_exports(tmp_path, capsys):
    """``lean train`` runs recompute, retain and reweight (one iteration each, writing lora/); the float64 certificate
    passes at 1e-10; lean export writes the LoRA folder and refuses --merge in one line (lean holds no guider)."""
    runs = train_every_schedule(tmp_path, FAMILY)
    for schedule, out in runs.items():
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["schedule"] == schedule and all(math.isfinite(r) for r in metrics["reward_mean"])
        assert (out / "lora" / LORA_WEIGHTS).is_file()
    eq = tmp_path / "eq"
    assert main(["equivalence", *sets(*FAST, f"model.family={FAMILY}", "model.dtype=float64"), "--out", str(eq)]) == 0
    report = json.loads((eq / "equivalence.json").read_text())
    assert report["passes"] and "PASS" in capsys.readouterr().out
    for schedule in ("retain", "reweight"):
        assert report[schedule]["max_rel_grad_diff"] < 1e-10
    assert reference_gap(report) < 1e-10
    assert main(["export", "--run", str(runs["recompute"]), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / LORA_WEIGHTS).is_file()
    capsys.readouterr()
    args = ["export", "--run", str(runs["recompute"]), "--out", str(tmp_path / "merged"), "--merge"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "HunyuanVideo15Pipeline also takes guider" in err and len(err.strip().splitlines()) == 1
