"""lean.models: both families build, CFG batching, reference policy, dtypes, latents, pretrained round trip."""

import json

import pytest
import torch

from lean.config import DEFAULT_PROMPTS
from lean.models import Guidance, build_policy, count_parameters
from lean.models.options import ModelConfig
from lean.models.text import PromptEmbeds, train_tokenizer

FAMILIES = ["flux", "wan"]
B = 4


def make(family: str, **overrides):
    return build_policy(ModelConfig(family=family, **overrides), DEFAULT_PROMPTS)


# the family-agnostic checks every family's test module reruns (test_sd3.py, test_kontext.py, ...)
POLICY_CONTRACT = [
    "test_cfg_batch_equals_two_forwards",
    "test_uncond_grad",
    "test_reference_is_the_base_model",
    "test_float64_end_to_end",
    "test_init_latents_do_not_depend_on_batching",
]


def family_prompts(family: str) -> list[str]:
    """The prompts a family's checks condition on: lean's default text prompts, or for an edit-only family the bundled
    recolouring set (instructions with reference images; FLUX.2's edits are tests/test_flux2_edit.py's)."""
    from lean.config.prompts import read_prompts
    from lean.models import EDIT_PROMPTS, family_spec

    spec = family_spec(family)
    return read_prompts(EDIT_PROMPTS) if spec.reference_images and not spec.reference_optional else DEFAULT_PROMPTS


def inputs(policy, batch: int = B, seed: int = 0):
    x = policy.init_latents([torch.Generator().manual_seed(seed + b) for b in range(batch)])
    sigma = torch.linspace(0.2, 0.9, batch, dtype=policy.dtype)
    return x, sigma, policy.encode_prompts(family_prompts(policy.family)[:batch])


def perturbed(family: str, **overrides):
    policy = make(family, **overrides)
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    return policy


@pytest.mark.parametrize("family,shape", [("flux", (16, 64)), ("wan", (16, 2, 8, 8))])
def test_velocity_shape_and_latents(family, shape):
    policy = make(family)
    assert policy.latent_shape() == shape
    x, sigma, emb = inputs(policy)
    assert x.shape == (B, *shape) and x.dtype == torch.float32
    with torch.no_grad():
        v = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
    assert v.shape == x.shape and torch.isfinite(v).all()
    assert policy(x, sigma, emb).shape == x.shape  # forward is velocity


@pytest.mark.parametrize("family", FAMILIES)
def test_init_latents_do_not_depend_on_batching(family):
    policy = make(family)
    gens = lambda: [torch.Generator().manual_seed(100 + b) for b in range(4)]  # noqa: E731
    batch = policy.init_latents(gens())
    alone = policy.init_latents(gens()[2:3])
    assert torch.equal(batch[2:3], alone)
    assert not torch.equal(batch[0], batch[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_cfg_batch_equals_two_forwards(family):
    policy = perturbed(family, dtype="float64")
    x, sigma, emb = inputs(policy)
    uncond = emb.negative if emb.negative is not None else policy.encode_prompts([""] * B)
    s = 3.0
    with torch.no_grad():
        batched = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=s))  # one [uncond, cond] forward
        v_u = policy.velocity(x, sigma, uncond)
        v_c = policy.velocity(x, sigma, emb)
    split = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=s))  # grad on: uncond runs apart, no grad
    torch.testing.assert_close(batched, v_u + s * (v_c - v_u), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(split.detach(), batched, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(v_u, v_c)  # the prompt matters


@pytest.mark.parametrize("family", FAMILIES)
def test_uncond_grad(family):
    """v = v_u + s (v_c - v_u): a detached v_u leaves d(s v_c); uncond_grad=True gives d((1-s) v_u + s v_c)."""
    policy = perturbed(family, dtype="float64")
    x, sigma, emb = inputs(policy)
    uncond = emb.negative if emb.negative is not None else policy.encode_prompts([""] * B)
    s = 2.5
    params = [p for _, p in policy.trainable_parameters()]
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)

    def grads(v):
        return torch.autograd.grad((v * w).sum(), params)

    def velocity(e, cfg=False, **kw):
        return policy.velocity(x, sigma, e, Guidance(cfg=cfg, guidance_scale=s, **kw))

    g_detached = grads(velocity(emb, cfg=True))
    g_full = grads(velocity(emb, cfg=True, uncond_grad=True))
    g_c = grads(s * velocity(emb))
    g_mix = grads((1 - s) * velocity(uncond) + s * velocity(emb))
    for gd, gf, gc, gm in zip(g_detached, g_full, g_c, g_mix):
        torch.testing.assert_close(gd, gc, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(gf, gm, rtol=1e-9, atol=1e-12)
    assert sum((gf - gd).abs().sum() for gf, gd in zip(g_full, g_detached)) > 1e-6  # the uncond half does matter


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_is_the_base_model(family):
    base = make(family)
    policy = perturbed(family)
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        v_base = base.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
        v_policy = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
        with policy.reference():
            v_ref = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
        v_after = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
    torch.testing.assert_close(v_ref, v_base, rtol=0, atol=0)  # B = 0 at init: the fresh adapter adds exact zeros
    assert (v_policy - v_ref).abs().max() > 1e-4
    assert torch.equal(v_after, v_policy)  # the adapter is back on


def test_full_finetune_trains_everything_and_keeps_a_reference():
    policy = make("flux", full_finetune=True)
    names = [n for n, _ in policy.trainable_parameters()]
    assert len(names) == len(list(policy.transformer.parameters())) and not any("lora" in n for n in names)
    x, sigma, emb = inputs(policy)
    with torch.no_grad():
        v0 = policy.velocity(x, sigma, emb)
        policy.perturb_lora_(0.01, torch.Generator().manual_seed(0))
        with policy.reference():
            torch.testing.assert_close(policy.velocity(x, sigma, emb), v0)
        assert not torch.allclose(policy.velocity(x, sigma, emb), v0)


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_end_to_end(family):
    policy = perturbed(family, dtype="float64")
    assert {p.dtype for p in policy.parameters()} == {torch.float64}  # transformer, LoRA, VAE, text encoders
    x, sigma, emb = inputs(policy)
    assert x.dtype == emb.tokens.dtype == torch.float64
    v = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
    assert v.dtype == torch.float64
    v.square().mean().backward()
    grads = [p.grad for _, p in policy.trainable_parameters()]
    assert all(g is not None and g.dtype == torch.float64 and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    image = policy.decode(x[:1])  # float64 3D convolutions are slow on CPU
    assert image.dtype == torch.float32 and torch.isfinite(image).all()


def test_bfloat16_keeps_diffusers_fp32_modules_and_round_trips(tmp_path):
    policy = perturbed("wan", dtype="bfloat16")
    trainable = {p.dtype for _, p in policy.trainable_parameters()}
    assert policy.dtype == torch.bfloat16 and trainable == {torch.float32}  # float32 masters (lean.config.dtypes)
    fp32 = {n for n, p in policy.transformer.named_parameters() if p.dtype == torch.float32 and not p.requires_grad}
    assert fp32 and all("time_embedder" in n or "scale_shift_table" in n or "norm" in n for n in fp32)
    assert policy.transformer.get_base_model().rope.freqs_cos.dtype == torch.float32
    policy.save_pretrained(tmp_path)
    loaded = build_policy(ModelConfig(family="wan", dtype="bfloat16", pretrained=str(tmp_path)), [])
    assert {n: p.dtype for n, p in loaded.named_parameters()} == {n: p.dtype for n, p in policy.named_parameters()}
    x, sigma, emb = inputs(policy, batch=2)
    with torch.no_grad():
        v = policy.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
        assert v.dtype == torch.bfloat16 and torch.isfinite(v).all()
        assert torch.equal(loaded.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5)), v)


@pytest.mark.parametrize("family,shape", [("flux", (2, 3, 32, 32)), ("wan", (2, 3, 5, 32, 32))])
def test_decode_range(family, shape):
    policy = make(family)
    image = policy.decode(inputs(policy, batch=2)[0])
    assert image.shape == shape and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1 and image.std() > 0.01


def test_lora_targets():
    flux_names = [n for n, _ in make("flux").trainable_parameters()]
    for layer in ("attn.to_q", "attn.to_out.0", "attn.add_k_proj", "attn.to_add_out"):
        assert any(f"transformer_blocks.0.{layer}.lora_B" in n for n in flux_names), layer
    assert any("single_transformer_blocks.0.attn.to_v.lora_A" in n for n in flux_names)
    assert not any(".ff." in n or "proj_mlp" in n for n in flux_names)
    ffn_names = [n for n, _ in make("flux", lora_ffn=True).trainable_parameters()]
    assert any(".ff.net.0.proj.lora_A" in n for n in ffn_names) and any("proj_mlp.lora_A" in n for n in ffn_names)
    wan = make("wan", lora_rank=4)
    wan_names = dict(wan.trainable_parameters())
    assert any("attn2.to_k.lora_A" in n for n in wan_names)  # the text-context projection
    assert all(p.shape[0] == 4 for n, p in wan_names.items() if "lora_A" in n)


def test_build_is_deterministic_and_transformer_ignores_the_prompt_list():
    a, b = make("flux"), make("flux")
    c = build_policy(ModelConfig(family="flux"), ["an entirely different prompt list"])
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert all(torch.equal(v, c.base_transformer_state_dict()[k]) for k, v in a.base_transformer_state_dict().items())
    assert all(torch.equal(v, c.lora_state_dict()[k]) for k, v in a.lora_state_dict().items())


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trip(family, tmp_path):
    policy = perturbed(family)
    policy.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"][0] == "diffusers" and (tmp_path / "vae" / "config.json").exists()
    assert all((tmp_path / name).is_dir() for name in index if not name.startswith("_"))
    loaded = build_policy(ModelConfig(family=family, pretrained=str(tmp_path)), ["unused"])
    assert [n for n, _ in loaded.trainable_parameters()] == [n for n, _ in policy.trainable_parameters()]
    x, sigma, emb = inputs(policy)
    assert torch.equal(loaded.encode_prompts(family_prompts(family)[:B]).tokens, emb.tokens)
    with torch.no_grad():
        for p in (policy, loaded):
            p.outputs = [p.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5)), p.decode(x)]
            with p.reference():
                p.outputs.append(p.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5)))
    for a, b in zip(policy.outputs, loaded.outputs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cache_dir_builds_once_and_matches(tmp_path):
    fresh = perturbed("wan")
    first = build_policy(ModelConfig(family="wan"), DEFAULT_PROMPTS, cache_dir=tmp_path)
    (folder,) = tmp_path.iterdir()
    assert (folder / "model_index.json").exists() and not (folder / "lora.safetensors").exists()
    second = build_policy(ModelConfig(family="wan"), DEFAULT_PROMPTS, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    for p in (first, second):
        p.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    x, sigma, emb = inputs(fresh)
    with torch.no_grad():
        expected = fresh.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5))
        for p in (first, second):
            torch.testing.assert_close(
                p.velocity(x, sigma, emb, Guidance(cfg=True, guidance_scale=4.5)), expected, rtol=0, atol=0
            )


def test_lora_state_dict_and_file(tmp_path):
    policy, other = perturbed("flux"), make("flux")
    state = policy.lora_state_dict()
    assert list(state) == [n for n, _ in policy.trainable_parameters()]
    policy.save_lora(tmp_path / "a.safetensors")
    other.load_lora(tmp_path / "a.safetensors")
    assert all(torch.equal(v, other.lora_state_dict()[k]) for k, v in state.items())
    with pytest.raises(KeyError):
        other.load_lora_state_dict({k: v for k, v in list(state.items())[1:]})


def test_prompt_embeddings_are_cached_and_batch_free():
    policy = make("flux")
    emb = policy.encode_prompts(DEFAULT_PROMPTS[:3])
    again = policy.encode_prompts([DEFAULT_PROMPTS[2], DEFAULT_PROMPTS[0]])
    assert torch.equal(again.tokens, emb.index([2, 0]).tokens) and torch.equal(again.pooled, emb.pooled[[2, 0]])
    assert emb.tokens.shape == (3, 16, 32) and emb.pooled.shape == (3, 32)
    assert not emb.tokens.requires_grad and set(policy._prompt_cache) == set(DEFAULT_PROMPTS[:3])
    both = PromptEmbeds.cat([emb.index(0), emb.index(slice(1, 3))])
    assert torch.equal(both.tokens, emb.tokens) and len(both) == 3
    wan = make("wan", text_max_length=12)
    tokens = wan.encode_prompts(["a red circle", ""]).tokens
    assert tokens.shape == (2, 12, 32)
    assert tokens[0, :4].abs().sum(-1).min() > 0 and tokens[0, 4:].abs().max() == 0  # 3 words + eos, then padding
    assert tokens[1, 1:].abs().max() == 0  # the empty prompt is just eos


def test_guidance_embedding():
    flux = perturbed("flux")
    x, sigma, emb = inputs(flux)
    with torch.no_grad():
        plain = flux.velocity(x, sigma, emb)
        one = flux.velocity(x, sigma, emb, Guidance(guidance_embed=1.0))
        distilled = flux.velocity(x, sigma, emb, Guidance(guidance_embed=3.5))
    assert torch.equal(plain, one) and not torch.allclose(plain, distilled)
    wan = make("wan")
    with pytest.raises(ValueError, match="guidance"):
        wan.velocity(*inputs(wan), Guidance(guidance_embed=3.5))


def test_tokenizer_is_a_hf_folder(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer([*DEFAULT_PROMPTS, ""], max_length=16)
    shuffled = ["", *reversed(DEFAULT_PROMPTS), DEFAULT_PROMPTS[0]]
    assert tok.get_vocab() == train_tokenizer(shuffled, 16).get_vocab()  # a function of the prompt set
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    batch = ["A red circle", "a purple circle", ""]
    ids = loaded(batch, padding="max_length", max_length=6, truncation=True).input_ids
    assert ids == tok(batch, padding="max_length", max_length=6, truncation=True).input_ids
    eos, pad, unk = tok.eos_token_id, tok.pad_token_id, tok.unk_token_id
    assert ids[0][3:] == [eos, pad, pad] and ids[1][1] == unk and ids[2] == [eos] + [pad] * 5
    assert ids[0][:3] == [tok.get_vocab()[w] for w in ("a", "red", "circle")]


@pytest.mark.parametrize("family,published", [("flux", 11.9e9), ("wan", 1.42e9)])
def test_full_size_parameter_count(family, published):
    """FLUX.1-dev's transformer has 11.9B parameters, Wan2.1-T2V-1.3B's 1.42B (meta-device build)."""
    assert count_parameters(family, "full") == pytest.approx(published, rel=0.01)
    assert count_parameters(family, "tiny") < count_parameters(family, "small") < 1e7
