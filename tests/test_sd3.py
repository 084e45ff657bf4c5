"""lean.models.sd3: SD3.5-class policies against diffusers' own StableDiffusion3Pipeline, layout, LoRA targets, sizes.

The family-agnostic Policy checks of test_models.py (CFG batching, detached/undetached unconditional branch,
reference = base model, float64 end to end, save -> from_pretrained round trip) are rerun here for ``sd3``.
"""

import pytest
import test_models as generic
import torch

from lean.config import DEFAULT_PROMPTS
from lean.models import Guidance, build_policy, count_parameters
from lean.models.options import ModelConfig
from lean.sampling.sde import ode_step, sigma_schedule


def make(**overrides):
    return build_policy(ModelConfig(family="sd3", **overrides), DEFAULT_PROMPTS)


def pipeline_from(policy, folder):
    """diffusers' StableDiffusion3Pipeline loaded with ``from_pretrained`` from the folder lean writes."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    policy.save_pretrained(folder, adapter=False)
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    pipe.tokenizer_max_length = policy.text_encoders["text_encoder"].config.max_position_embeddings
    return pipe


@pytest.mark.parametrize("check", generic.POLICY_CONTRACT)
def test_policy_contract(check):
    getattr(generic, check)("sd3")


def test_save_pretrained_round_trip(tmp_path):
    generic.test_save_pretrained_round_trip("sd3", tmp_path)


def test_matches_stable_diffusion3_pipeline(tmp_path):
    """Prompt encoding, 3 guided Euler steps and decoding equal diffusers' pipeline run on the same weights."""
    policy = make()
    pipe = pipeline_from(policy, tmp_path)
    prompts = DEFAULT_PROMPTS[:2]
    tokens, neg_tokens, pooled, neg_pooled = pipe.encode_prompt(
        prompts,
        prompts,
        prompts,
        device="cpu",
        do_classifier_free_guidance=True,
        max_sequence_length=policy.text_max_length,
    )
    emb, uncond = policy.encode_prompts(prompts), policy.encode_prompts([""] * 2)
    torch.testing.assert_close(emb.tokens, tokens, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.pooled, pooled, rtol=0, atol=1e-6)
    torch.testing.assert_close(uncond.tokens, neg_tokens, rtol=0, atol=1e-6)
    torch.testing.assert_close(uncond.pooled, neg_pooled, rtol=0, atol=1e-6)

    x = policy.init_latents([torch.Generator().manual_seed(b) for b in range(2)])
    kwargs = dict(
        prompt_embeds=tokens,
        negative_prompt_embeds=neg_tokens,
        pooled_prompt_embeds=pooled,
        negative_pooled_prompt_embeds=neg_pooled,
        num_inference_steps=3,
        guidance_scale=4.5,
        height=policy.runtime.h * 8,
        width=policy.runtime.w * 8,
    )
    expected = pipe(latents=x.clone(), output_type="latent", **kwargs).images
    sigmas = sigma_schedule(3, 3.0)
    with torch.no_grad():
        for i in range(3):
            v = policy.velocity(x, sigmas[i].expand(2), emb, Guidance(cfg=True, guidance_scale=4.5))
            x = ode_step(v, x, sigmas, i)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        policy.decode(x),
        pipe.image_processor.postprocess(
            pipe.vae.decode(expected / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor)[0],
            output_type="pt",
        ),
        rtol=1e-5,
        atol=1e-5,
    )


def test_text_layout():
    """77-token (here: tiny CLIP context 16) CLIP-L | CLIP-G states, zero-padded to the T5 width, then T5 tokens."""
    policy = make(text_max_length=12)
    emb = policy.encode_prompts(DEFAULT_PROMPTS[:3])
    assert emb.tokens.shape == (3, 16 + 12, 48) and emb.pooled.shape == (3, 16 + 24)
    assert emb.tokens[:, :16, 40:].abs().max() == 0 and emb.tokens[:, :16, :40].abs().min() > 0
    assert emb.tokens[:, 16:, 40:].abs().max() > 0  # T5 states fill the full width
    assert not torch.allclose(emb.pooled[0], emb.pooled[1])


def test_architecture_and_lora_targets():
    policy = make(lora_rank=4)
    base = policy.transformer.get_base_model()
    blocks = base.transformer_blocks
    assert blocks[0].attn2 is not None and blocks[1].attn2 is None  # SD3.5 dual attention in the first layers
    assert type(blocks[0].attn.norm_q).__name__ == "RMSNorm"  # qk_norm="rms_norm"
    names = dict(policy.trainable_parameters())
    for layer in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        assert any(f"transformer_blocks.0.attn.{layer}.lora_A" in n for n in names), layer
    assert not any("attn2" in n or ".ff" in n for n in names)  # FlowGRPO's targets miss attn2 and the MLPs
    assert all(p.shape[0] == 4 for n, p in names.items() if "lora_A" in n)
    ffn = [n for n, _ in make(lora_ffn=True).trainable_parameters()]
    assert any(".ff.net.0.proj.lora_A" in n for n in ffn) and any(".ff_context.net.2.lora_B" in n for n in ffn)


def test_guards():
    policy = make()
    with pytest.raises(ValueError, match="guidance"):
        policy.velocity(*generic.inputs(policy)[:3], Guidance(guidance_embed=3.5))
    with pytest.raises(ValueError, match="patches per side"):
        make(resolution=1040)  # 130 latent rows -> 65 patches > the tiny table's 64


def test_full_size_parameter_count():
    """SD3.5 Medium's MMDiT-X: 2.24B parameters, plus a 384 x 384 x 1536 position table (a buffer) = the
    2.47B values of its published checkpoint; built on the meta device."""
    from lean.models.sd3 import SPEC

    n = count_parameters("sd3", "full")
    assert n == pytest.approx(2.243e9, rel=1e-3)
    arch = SPEC.sizes["full"].transformer
    table = arch["pos_embed_max_size"] ** 2 * arch["num_attention_heads"] * arch["attention_head_dim"]
    assert n + table == pytest.approx(2.47e9, rel=2e-3)
    assert count_parameters("sd3", "tiny") < count_parameters("sd3", "small") < 1e7
