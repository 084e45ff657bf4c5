"""lean.models.flux2 / flux2_klein: FLUX.2 [dev] and [klein] policies against diffusers' own Flux2Pipeline and
Flux2KleinPipeline (prompt encoding, guided Euler steps with the empirical time shift, BatchNorm-normalised decoding),
a folder the diffusers class saved loading as ``model.pretrained``, another family's folder refused, the published
sizes, the LoRA targets, and from the command line: every schedule trains, the float64 certificate passes, ``lean
export`` loads into the pipeline with ``load_lora_weights`` and ``lean sample`` draws from it.

One random tiny build per family (module-scoped :func:`built`); the other policies load its folders.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers import preset_value_lines, uncited

from lean.cli import main
from lean.config import DEFAULT_PROMPTS, ConfigError
from lean.configure import load_config
from lean.models import Guidance, build_policy, build_scheduler, count_parameters, time_shift
from lean.models.options import ModelConfig
from lean.models.precision import float64_scope
from lean.sampling.sde import ode_step, sigma_schedule

FAMILIES = ("flux2", "flux2_klein")
B = 2
STEPS = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per family, built on first use: the random tiny float32 policy (never mutated), with random BatchNorm
    statistics in its VAE so that the latent normalisation is not the identity; its folder as lean writes it; and
    that folder loaded by the diffusers pipeline class and saved again by it (``pipe_folder``)."""
    cache = {}

    def get(family: str) -> dict:
        if family not in cache:
            import diffusers

            policy = build_policy(ModelConfig(family=family), DEFAULT_PROMPTS)
            g = torch.Generator().manual_seed(5)
            bn = policy.vae.bn
            bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=g) * 0.3)
            bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=g) + 0.5)
            root = tmp_path_factory.mktemp(family)
            policy.save_pretrained(root / "lean", adapter=False)
            cls = getattr(diffusers, policy.pipeline_class)
            pipe = cls.from_pretrained(root / "lean", scheduler=build_scheduler(family, None))
            pipe.set_progress_bar_config(disable=True)
            pipe.save_pretrained(root / "diffusers")
            cache[family] = dict(policy=policy, folder=root / "lean", pipe=pipe, pipe_folder=root / "diffusers")
        return cache[family]

    return get


@pytest.fixture(scope="module")
def float64(built):
    """Per family: the diffusers-saved folder loaded as a float64 policy with a perturbed adapter."""
    cache = {}

    def get(family: str):
        if family not in cache:
            policy = build_policy(
                ModelConfig(family=family, pretrained=str(built(family)["pipe_folder"]), dtype="float64"), []
            )
            policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
            cache[family] = policy
        return cache[family]

    return get


def inputs(policy, seed: int = 0):
    x = policy.init_latents([torch.Generator().manual_seed(seed + b) for b in range(B)])
    sigma = torch.linspace(0.3, 0.8, B, dtype=policy.dtype)
    return x, sigma, policy.encode_prompts(DEFAULT_PROMPTS[:B])


def guidance(family: str, s: float) -> Guidance:
    """lean's velocity guidance for the pipeline's ``guidance_scale`` s: [dev]'s distilled-guidance embedding, or
    [klein]'s true CFG against the empty prompt."""
    return Guidance(guidance_embed=s) if family == "flux2" else Guidance(cfg=True, guidance_scale=s)


# ---------------------------------------------------------------- the policy contract (tests/test_models.py's checks)


@pytest.mark.parametrize("family", FAMILIES)
def test_policy_contract(family, float64):
    """CFG as one [uncond, cond] batch, the detached / undetached unconditional branch, float64 end to end, and
    initial latents that do not depend on batching."""
    policy = float64(family)
    assert {p.dtype for p in policy.parameters()} == {torch.float64}
    x, sigma, emb = inputs(policy)
    uncond = policy.encode_prompts([""] * B)
    s = 3.0
    with torch.no_grad():
        batched = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=s))
        v_u = policy.velocity(x, sigma, uncond)
        v_c = policy.velocity(x, sigma, emb)
    torch.testing.assert_close(batched, v_u + s * (v_c - v_u), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(v_u, v_c)  # the prompt matters

    params = [p for _, p in policy.trainable_parameters()]
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)

    def grads(v):
        return torch.autograd.grad((v * w).sum(), params)

    def velocity(e, cfg=False, **kw):
        return policy.velocity(x, sigma, e, Guidance(cfg=cfg, guidance_scale=s, **kw))

    g_detached, g_c = grads(velocity(emb, cfg=True)), grads(s * velocity(emb))
    g_full = grads(velocity(emb, cfg=True, uncond_grad=True))
    g_mix = grads((1 - s) * velocity(uncond) + s * velocity(emb))
    for gd, gf, gc, gm in zip(g_detached, g_full, g_c, g_mix, strict=True):
        assert gd.dtype == torch.float64 and torch.isfinite(gf).all()
        torch.testing.assert_close(gd, gc, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(gf, gm, rtol=1e-9, atol=1e-12)
    assert sum((gf - gd).abs().sum() for gf, gd in zip(g_full, g_detached, strict=True)) > 1e-6

    gens = lambda: [torch.Generator().manual_seed(100 + b) for b in range(3)]  # noqa: E731
    torch.testing.assert_close(policy.init_latents(gens())[2:], policy.init_latents(gens()[2:]), rtol=0, atol=0)
    image = policy.decode(x[:1])
    assert image.shape == (1, 3, 32, 32) and image.dtype == torch.float32 and torch.isfinite(image).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_the_diffusers_pipeline(family, built):
    """Prompt encoding, 3 guided Euler steps on the pipeline's own sigma grid (empirical mu) and the decoded image
    equal diffusers' pipeline run on the same weights and initial noise."""
    from lean.models.flux2.model import bn_stats, unpack, unpatchify

    b = built(family)
    policy, pipe = b["policy"], b["pipe"]
    prompts = DEFAULT_PROMPTS[:B]
    tokens, text_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=policy.text_max_length)
    emb = policy.encode_prompts(prompts)
    torch.testing.assert_close(emb.tokens, tokens, rtol=0, atol=0)
    assert text_ids.shape == (B, policy.text_max_length, 4)

    x = policy.init_latents([torch.Generator().manual_seed(10 + k) for k in range(B)])
    s = 3.5
    res = policy.runtime.h * 2 * 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    call = dict(num_inference_steps=STEPS, guidance_scale=s, height=res, width=res, max_sequence_length=16)
    expected = pipe(prompt=prompts, latents=unpack(x, policy.runtime.h, policy.runtime.w), output_type="latent", **call)
    shift, source = time_shift(family, None, None, policy.runtime.image_seq_len, STEPS)
    assert "dynamic" in source
    sigmas = sigma_schedule(STEPS, shift, "uniform")  # the pipelines' linspace(1, 1/n, n), then 0
    with torch.no_grad():
        for i in range(STEPS):
            v = policy.velocity(x, sigmas[i].expand(B), emb, guidance(family, s))
            x = ode_step(v, x, sigmas, i)
    if family == "flux2_klein":  # Flux2KleinPipeline's "latent" output is the VAE's latent (denormalised)
        p = unpack(x, policy.runtime.h, policy.runtime.w)
        mean, std = bn_stats(policy.vae, p)
        torch.testing.assert_close(unpatchify(p * std + mean), expected.images, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(x, expected.images, rtol=1e-5, atol=1e-5)
    x0 = policy.init_latents([torch.Generator().manual_seed(10 + k) for k in range(B)])
    image = pipe(
        prompt=prompts, latents=unpack(x0, policy.runtime.h, policy.runtime.w), output_type="pt", **call
    ).images
    torch.testing.assert_close(policy.decode(x), image, rtol=1e-5, atol=1e-5)


def test_time_shift_is_the_pipelines_empirical_mu():
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    for n, steps in [(16, 4), (1024, 28), (4096, 50), (5000, 8)]:
        shift, source = time_shift("flux2_klein", None, None, n, steps)
        assert shift == pytest.approx(math.exp(compute_empirical_mu(n, steps)), rel=1e-12) and "dynamic" in source
    assert time_shift("flux2", None, 2.0, 1024) == (2.0, "sample.shift")
    with pytest.raises(ValueError, match="num_steps"):
        time_shift("flux2", None, None, 1024)


# ---------------------------------------------------------------- folders


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_the_pipeline_saved_loads_as_pretrained(family, built, float64):
    """The diffusers-saved folder (its chat template kept in the tokenizer) loads as ``model.pretrained`` and gives the
    random build's initial velocity exactly; its adapter-off reference is the pipeline's transformer."""
    b = built(family)
    loaded = build_policy(ModelConfig(family=family, pretrained=str(b["pipe_folder"])), [])
    assert loaded.tokenizers["tokenizer"].chat_template == b["policy"].tokenizers["tokenizer"].chat_template
    x, _, emb = inputs(b["policy"])
    one = torch.ones(B)
    with torch.no_grad():
        for p in (b["policy"], loaded):
            p.v1 = p.velocity(x, one, p.encode_prompts(DEFAULT_PROMPTS[:B]), guidance(family, 2.0))
    torch.testing.assert_close(loaded.v1, b["policy"].v1, rtol=0, atol=0)

    policy = float64(family)  # float64, perturbed adapter
    x, sigma, emb = inputs(policy)
    pipe = b["pipe"]
    with torch.no_grad():
        with policy.reference():
            ref = policy.velocity(x, sigma, emb)
        v = policy.velocity(x, sigma, emb)
        with float64_scope():  # as the policy computes in float64 (its rotary table too)
            got = policy.runtime.forward(pipe.transformer.double(), x, sigma, emb, None)
        pipe.transformer.float()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert (v - ref).abs().max() > 1e-4


@pytest.mark.parametrize("family,other", [("flux2", "flux2_klein"), ("flux2_klein", "flux2"), ("flux2", "sd3")])
def test_another_familys_folder_is_refused_in_one_line(family, other, built, tmp_path):
    folder = built(other)["folder"] if other in FAMILIES else tmp_path
    if other == "sd3":
        build_policy(ModelConfig(family="sd3"), DEFAULT_PROMPTS).save_pretrained(folder, adapter=False)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.family={family}", f"model.pretrained={folder}"])
    assert "\n" not in str(err.value) and f"not model.family={family}'s" in str(err.value)


# ---------------------------------------------------------------- architecture


def test_full_size_parameter_counts():
    """FLUX.2-dev's transformer: 32.2B parameters; FLUX.2-klein-9B's: 9.08B (meta device)."""
    assert count_parameters("flux2", "full") == pytest.approx(32.22e9, rel=1e-3)
    assert count_parameters("flux2_klein", "full") == pytest.approx(9.08e9, rel=1e-3)
    for family in FAMILIES:
        assert count_parameters(family, "tiny") < count_parameters(family, "small") < 1e7


@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_lora_targets_and_refusals(family, float64):
    """Flow-Factory's targets: every double-block attention projection and the single blocks' fused q, k, v + MLP
    input (their to_out stays frozen); model.lora_ffn adds the double blocks' MLPs. [dev] embeds its guidance, [klein]
    refuses one; no sequence parallelism (one line saying why)."""
    from lean.models import family_spec

    policy, spec = float64(family), family_spec(family)
    names = [n for n, _ in policy.trainable_parameters()]
    for layer in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        assert any(f"transformer_blocks.0.attn.{layer}.lora_A" in n for n in names), layer
    assert any("single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_B" in n for n in names)
    assert not any(".ff" in n or "single_transformer_blocks.0.attn.to_out" in n for n in names)
    mlps = [f"transformer_blocks.0.{f}.{p}" for f in ("ff", "ff_context") for p in ("linear_in", "linear_out")]
    assert all(re.fullmatch(spec.lora_targets(True), n) and not re.fullmatch(spec.lora_targets(False), n) for n in mlps)
    embedder = policy.transformer.get_base_model().time_guidance_embed.guidance_embedder
    assert (embedder is not None) == (family == "flux2") == spec.guidance_embed

    with pytest.raises(NotImplementedError, match="to_qkv_mlp_proj"):
        policy.runtime.shard_sequence(None, None)
    with pytest.raises(ConfigError, match="no sequence parallelism") as err:
        load_config(None, [f"model.family={family}", "parallel.sequence_parallel=2"])
    assert "\n" not in str(err.value)
    if family == "flux2_klein":
        with pytest.raises(ConfigError, match="guidance"):
            load_config(None, [f"model.family={family}", "sample.guidance_embed=4.0"])


# ---------------------------------------------------------------- the command line


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_cli_schedules_certificate_export_and_sample(family, built, tmp_path, monkeypatch):
    """`lean train` runs recompute, retain and reweight; `lean equivalence` passes in float64 at 1e-10; `lean export`
    writes a LoRA folder that, loaded with load_lora_weights, makes the pipeline's transformer compute the trained
    policy's velocity (not the base's); `lean sample` draws from the pipeline folder with it."""
    import diffusers

    from lean.export import LORA_WEIGHTS

    monkeypatch.chdir(tmp_path)
    guide = "sample.cfg=false" if family == "flux2" else "sample.cfg=true"  # Flux2Pipeline has no true CFG
    sets = [
        f"model.family={family}",
        guide,
        "train.prompts_per_iteration=2",
        "train.group_size=2",
        "train.rollout_batch_size=4",
        "train.train_batch_size=4",
        "sample.num_steps=3",
        "train.iterations=1",
        "optimizer.lr=0.1",
    ]
    for schedule in ("recompute", "retain", "reweight"):
        args = [a for s in [*sets, f"train.schedule={schedule}"] for a in ("--set", s)]
        assert main(["train", *args, "--out", schedule]) == 0
        metrics = json.loads((tmp_path / schedule / "metrics.json").read_text())
        assert metrics["schedule"] == schedule and all(math.isfinite(r) for r in metrics["reward_mean"])

    eq = [a for s in [f"model.family={family}", guide, "model.dtype=float64"] for a in ("--set", s)]
    assert main(["equivalence", *eq, "--out", "eq"]) == 0
    assert json.loads((tmp_path / "eq" / "equivalence.json").read_text())["passes"]

    assert main(["export", "--run", "recompute", "--out", "exported"]) == 0
    assert (tmp_path / "exported" / LORA_WEIGHTS).is_file()
    folder = built(family)["folder"]  # the same random transformer as the run's (its weights ignore the prompts)
    trained = build_policy(ModelConfig(family=family, pretrained=str(folder)), [])
    trained.load_lora(tmp_path / "recompute" / "lora.safetensors")
    pipe = getattr(diffusers, trained.pipeline_class).from_pretrained(folder, scheduler=build_scheduler(family, None))
    x, sigma, emb = inputs(trained)
    with torch.no_grad():
        before = trained.runtime.forward(pipe.transformer, x, sigma, emb, None)
        pipe.load_lora_weights(tmp_path / "exported")
        after = trained.runtime.forward(pipe.transformer, x, sigma, emb, None)
        expected = trained.velocity(x, sigma, emb)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
    assert (after - before).abs().max() > 1e-3

    (tmp_path / "prompts.txt").write_text(f"{DEFAULT_PROMPTS[0]}\n{DEFAULT_PROMPTS[1]}\n")
    sample = ["--pretrained", str(folder), "--lora", "exported", "--prompts-file", "prompts.txt", "--out", "samples"]
    assert main(["sample", *sample, "--num-steps", "2", "--resolution", "32"]) == 0
    records = [json.loads(line) for line in (tmp_path / "samples" / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all((tmp_path / "samples" / r["file"]).is_file() for r in records)


# ---------------------------------------------------------------- presets (Flow-Factory's recipes)

PRESETS = {"flowfactory-grpo-flux2": ("flux2", 32.22e9), "flowfactory-grpo-flux2-klein": ("flux2_klein", 9.08e9)}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_cite_every_value_and_plan_at_the_published_size(name, tmp_path):
    from lean.plan.cost import main as plan

    values = preset_value_lines(name)
    assert len(values) >= 40 and uncited(values) == []
    cfg = load_config(None, [], preset=name)
    family, published = PRESETS[name]
    assert cfg.model.family == family and cfg.model.lora_rank == 64 and cfg.model.lora_ffn
    assert (cfg.sample.guidance_embed == 4.0) == (family == "flux2") and not cfg.sample.cfg
    report = plan(cfg, out=str(tmp_path))["published_size"]
    assert report["transformer_parameters"] == pytest.approx(published, rel=1e-3)


def test_sample_refuses_true_cfg_for_flux2_dev_in_one_line():
    """Flux2Pipeline has no true CFG: a CFG-trained FLUX.2 [dev] run's settings cannot be drawn by it."""
    from lean.tools.sampling import SampleOptions

    with pytest.raises(ConfigError, match="Flux2Pipeline has no true CFG"):
        SampleOptions(true_cfg_scale=4.0).validate("flux2")
