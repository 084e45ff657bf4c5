"""FLUX.2 [dev]'s sizes: tiny (tests), small (CPU bench) and full (black-forest-labs/FLUX.2-dev as published).

The transformer, VAE and text-encoder configs shared with FLUX.2 [klein] (``lean.models.flux2_klein.sizes``) are built
here: :func:`flux2_transformer` (``Flux2Transformer2DModel``) and :func:`flux2_vae` (``AutoencoderKLFlux2``). The text
encoder of [dev] is Mistral Small 3.1 (``Mistral3ForConditionalGeneration``: a Pixtral vision tower, a projector and
a Mistral language model whose config nests as ``text_config``); the pipeline stacks its hidden states 10, 20 and 30,
so the transformer's text width (``joint_attention_dim``) is 3 x the language model's, and every size keeps more
than 30 layers so that those indices mean what they mean in the published model (hidden state 30 is not the last,
normed one).
"""

from __future__ import annotations

from typing import Any

from lean.models.spec import Size

HIDDEN_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers


def flux2_transformer(
    double: int, single: int, heads: int, head_dim: int, text_dim: int, latent_channels: int, guidance: bool, **extra
) -> dict[str, Any]:
    """Flux2Transformer2DModel: ``double`` double-stream and ``single`` single-stream blocks over 2x2-patchified
    latents (4 x ``latent_channels`` inputs per token, patch_size 1), four rotary axes (t, h, w, l) of head_dim / 4
    each, MLP ratio 3, with (``guidance``) or without FLUX.2 [dev]'s distilled-guidance embedder."""
    return dict(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        mlp_ratio=3.0,
        axes_dims_rope=(head_dim // 4,) * 4,
        rope_theta=2000,
        guidance_embeds=guidance,
        **extra,
    )


def flux2_vae(channels: tuple[int, ...], layers_per_block: int, groups: int, latent_channels: int) -> dict[str, Any]:
    """AutoencoderKLFlux2: len(channels) levels (2^(len-1)x downsampling), quant convs, and the BatchNorm over the
    2x2-patchified latent (4 x ``latent_channels`` channels) whose running statistics normalise the policy's
    latents (eps 1e-4, as published)."""
    return dict(
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=layers_per_block,
        norm_num_groups=groups,
        latent_channels=latent_channels,
        use_quant_conv=True,
        use_post_quant_conv=True,
        batch_norm_eps=1e-4,
        batch_norm_momentum=0.1,
        patch_size=(2, 2),
    )


def mistral3(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, vision: dict
) -> dict:
    """Mistral3Config: the language model (``text_config``, a MistralConfig; the vocabulary is the tokenizer's) and
    the Pixtral vision tower (``vision_config``), which FLUX.2 text-to-image never runs."""
    return dict(
        text_config=dict(
            model_type="mistral",
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1.0e9},
            sliding_window=None,
        ),
        vision_config=dict(model_type="pixtral", **vision),
        spatial_merge_size=2,
        multimodal_projector_bias=False,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
    )


def _pixtral(hidden: int, layers: int, heads: int, image_size: int) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        head_dim=hidden // heads,
        image_size=image_size,
        patch_size=14,
    )


SIZES = {
    "tiny": Size(  # 32 px -> 8x8 latent (4x VAE) -> 4x4 = 16 tokens of 4 x 8 channels
        transformer=flux2_transformer(1, 1, heads=2, head_dim=16, text_dim=3 * 16, latent_channels=8, guidance=True),
        vae=flux2_vae((8, 16, 16), 1, 4, latent_channels=8),
        text_encoders=dict(text_encoder=mistral3(16, 32, 31, 2, 1, 8, _pixtral(16, 1, 2, 28))),
    ),
    "small": Size(  # 8x like the real one: 256 px -> 32x32 latent -> 16x16 = 256 tokens
        transformer=flux2_transformer(2, 4, heads=4, head_dim=32, text_dim=3 * 32, latent_channels=8, guidance=True),
        vae=flux2_vae((16, 32, 32, 32), 1, 8, latent_channels=8),
        text_encoders=dict(text_encoder=mistral3(32, 64, 31, 4, 2, 8, _pixtral(32, 1, 2, 28))),
    ),
    # black-forest-labs/FLUX.2-dev as published (transformer/, vae/, text_encoder/config.json; the transformer's are
    # also Flux2Transformer2DModel's defaults): 8 double + 48 single blocks, 48 heads x 128 = 6144 wide, 15360 = 3 x
    # 5120 text width, guidance-distilled: 32.2B parameters. VAE: AutoencoderKLFlux2's defaults (32 latent channels,
    # 8x). Text encoder: Mistral-Small-3.1-24B (40 layers, 5120 wide, GQA 32/8 heads of 128, rope theta 1e9; Pixtral
    # vision tower 24 x 1024, 1540 px images of 14 px patches).
    "full": Size(
        transformer=flux2_transformer(
            8,
            48,
            heads=48,
            head_dim=128,
            text_dim=15360,
            latent_channels=32,
            guidance=True,
            timestep_guidance_channels=256,
        ),
        vae=flux2_vae((128, 256, 512, 512), 2, 32, latent_channels=32),
        text_encoders=dict(text_encoder=mistral3(5120, 32768, 40, 32, 8, 128, _pixtral(1024, 24, 16, 1540))),
    ),
}
