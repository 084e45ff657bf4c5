"""Qwen-Image's sizes: tiny (tests), small (CPU bench) and full (Qwen/Qwen-Image as published).

The full size is written from the published ``config.json`` files of the Hugging Face repository ``Qwen/Qwen-Image``
(from memory: nothing is downloaded here):

* ``transformer/config.json``: QwenImageTransformer2DModel, 60 dual-stream blocks, 24 heads x 128, joint_attention_dim
  3584 (Qwen2.5-VL-7B's width), in_channels 64 (2x2-packed 16-channel latents), out_channels 16, patch_size 2,
  axes_dims_rope (16, 56, 56), guidance_embeds false. Its ``pooled_projection_dim: 768`` is not a constructor argument
  of the diffusers class (ignored by ``from_config``), so the table leaves it out. ~20.4B parameters.
* ``vae/config.json``: AutoencoderKLQwenImage, base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], num_res_blocks 2,
  temperal_downsample [false, true, true] (8x spatial), and the per-channel ``latents_mean`` / ``latents_std`` below
  (the Wan2.1 VAE's statistics; also diffusers' defaults of the class).
* ``text_encoder/config.json``: Qwen2_5_VLForConditionalGeneration (Qwen2.5-VL-7B-Instruct): hidden 3584, 28 layers,
  28 heads, 4 key-value heads, intermediate 18944, vocabulary 152064, rope_theta 1e6, mrope_section [16, 24, 24],
  rms_norm_eps 1e-6; its vision tower: depth 32, hidden 1280, 16 heads, intermediate 3420, out_hidden_size 3584,
  patch 14, window 112, full attention in blocks 7, 15, 23, 31.

The smaller sizes shrink every width and depth and keep the structure (the vision tower too, so that the text
encoder builds and saves as the real class). A random build takes its vocabulary and special tokens from lean's own
tokenizer (``lean.models.build._random_components``), so ``vocab_size`` is not in these tables.
"""

from __future__ import annotations

from typing import Any

from lean.models.spec import Size

# vae/config.json of Qwen/Qwen-Image
LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip


def _mmdit(layers: int, heads: int, head_dim: int, text_dim: int, rope: tuple[int, int, int]) -> dict[str, Any]:
    """QwenImageTransformer2DModel: ``layers`` dual-stream blocks over 2x2-packed 16-channel latents (64 inputs, 16
    outputs per patch position); ``rope``: the rotary axes (frame, height, width), summing to ``head_dim``."""
    return dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        guidance_embeds=False,
        axes_dims_rope=rope,
    )


def _vae(base_dim: int, dim_mult: list[int], res_blocks: int, temporal: list[bool]) -> dict[str, Any]:
    """AutoencoderKLQwenImage (a causal 3-D VAE run on one frame): 16 latent channels, 2^len(temporal) spatial
    compression, the published latent statistics."""
    return dict(
        base_dim=base_dim,
        z_dim=16,
        dim_mult=dim_mult,
        num_res_blocks=res_blocks,
        attn_scales=[],
        temperal_downsample=temporal,
        dropout=0.0,
        latents_mean=LATENTS_MEAN,
        latents_std=LATENTS_STD,
    )


def _qwen2_5_vl(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, mrope: list[int], vision: dict[str, Any]
) -> dict[str, Any]:
    """Qwen2_5_VLConfig's arguments as its ``config.json`` spells them: the language model's flat (Qwen2_5_VLConfig
    routes them to its text config), the vision tower's in ``vision_config``. ``mrope``: the multimodal RoPE sections
    (temporal, height, width), summing to half the head dimension."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        hidden_act="silu",
        max_position_embeddings=128000,
        max_window_layers=layers,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": mrope},
        use_sliding_window=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        vision_config=vision,
    )


def _vision(depth: int, hidden: int, heads: int, intermediate: int, out: int, full: list[int]) -> dict[str, Any]:
    """Qwen2.5-VL's vision tower (unused by text-to-image: built so that the encoder is the real class)."""
    return dict(
        depth=depth,
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=intermediate,
        out_hidden_size=out,
        hidden_act="silu",
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=full,
        tokens_per_second=2,
    )


SIZES = {
    "tiny": Size(  # 32 px -> 8x8 latent (4x VAE) -> 16 image tokens
        transformer=_mmdit(1, heads=2, head_dim=16, text_dim=32, rope=(4, 6, 6)),
        vae=_vae(8, [1, 1, 1], 1, [False, True]),
        text_encoders=dict(
            text_encoder=_qwen2_5_vl(32, 1, 2, 1, 64, [2, 3, 3], _vision(1, 16, 2, 32, out=32, full=[0])),
        ),
    ),
    "small": Size(  # 256 px -> 32x32 latent (8x VAE, like the real one) -> 256 image tokens
        transformer=_mmdit(4, heads=4, head_dim=32, text_dim=64, rope=(8, 12, 12)),
        vae=_vae(16, [1, 2, 4, 4], 1, [False, True, True]),
        text_encoders=dict(
            text_encoder=_qwen2_5_vl(64, 2, 4, 2, 128, [2, 3, 3], _vision(1, 32, 2, 64, out=64, full=[0])),
        ),
    ),
    "full": Size(  # Qwen/Qwen-Image as published: 20.4B transformer, Qwen2.5-VL-7B-Instruct text encoder
        transformer=_mmdit(60, heads=24, head_dim=128, text_dim=3584, rope=(16, 56, 56)),
        vae=_vae(96, [1, 2, 4, 4], 2, [False, True, True]),
        text_encoders=dict(
            text_encoder=_qwen2_5_vl(
                3584, 28, 28, 4, 18944, [16, 24, 24], _vision(32, 1280, 16, 3420, out=3584, full=[7, 15, 23, 31])
            ),
        ),
    ),
}
