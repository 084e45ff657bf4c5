"""HunyuanVideo-1.5's sizes: tiny (tests), small (CPU bench) and full (the published 480p text-to-video model).

The full size, and where each value was checked:

* ``transformer/config.json``: HunyuanVideo15Transformer3DModel as diffusers' conversion script writes the 480p T2V
  transformer (``TRANSFORMER_CONFIGS["480p_t2v"]`` of huggingface/diffusers scripts/convert_hunyuan_video1_5_to_
  diffusers.py, read through the code search): 54 dual-stream blocks, 16 heads x 128, 2 token-refiner blocks, patch
  1 x 1 x 1, in_channels 65 (32 latent + 32 condition-latent + 1 mask channels), out_channels 32, Qwen2.5-VL text
  width 3584, byT5 width 1472, SigLIP image width 1152, rope (16, 56, 56) at theta 256, target_size 640,
  task_type t2v. These are also the class's defaults (but task_type, "i2v" there). 8.33B parameters.
* ``vae/config.json``: AutoencoderKLHunyuanVideo15 with the class's defaults (the conversion script builds
  ``AutoencoderKLHunyuanVideo15()``): 32 latent channels, block_out_channels (128, 256, 512, 1024, 1024), 2 layers per
  block, 16x spatial and 4x temporal compression, scaling_factor 1.03682 (no shift).
* ``text_encoder/config.json``: Qwen2.5-VL-7B-Instruct's language model (the script saves ``AutoModel.from_pretrained(
  "Qwen/Qwen2.5-VL-7B-Instruct").language_model``, a Qwen2_5_VLTextModel): Qwen-Image's table of the same model
  (:mod:`lean.models.qwen_image.sizes`, written from memory) without its vision tower. 7.07B parameters.
* ``text_encoder_2/config.json``: google/byt5-small's encoder (the script loads ``T5EncoderModel.from_pretrained(
  "google/byt5-small")`` and the Glyph-SDXL-v2 weights into it): d_model 1472, d_kv 64, 6 heads, d_ff 3584, 12 layers,
  gated-GELU (its config.json, read through the docs search). Glyph-SDXL-v2 adds colour and font tokens to the
  vocabulary; a random build takes its vocabulary from lean's tokenizer anyway (``lean.models.build``).

The smaller sizes shrink every width and depth and keep the structure: the 2048-wide byT5 projection is the class's
own constant, so even the tiny transformer has 4.5M parameters; the tiny VAE compresses 8x (32 px -> 4 x 4 latent, 32
tokens at 5 frames) and keeps 8 latent channels; the small one has the published 16x and 32 channels. The tiny text
encoder has 3 layers, so that the pipeline's hidden_states[-3] is a layer's output, not the embedding.
"""

from __future__ import annotations

from typing import Any

from lean.models.qwen_image.sizes import _qwen2_5_vl, _vision
from lean.models.sizes import t5_encoder
from lean.models.spec import Size

BYT5_SMALL = (1472, 64, 6, 3584, 12)  # google/byt5-small's encoder: t5_encoder(*BYT5_SMALL)
SCALING_FACTOR = 1.03682  # AutoencoderKLHunyuanVideo15's default, the published VAE's


def _dit(
    heads: int, head_dim: int, layers: int, refiner: int, embeds: tuple[int, int, int], latent: int, rope
) -> dict[str, Any]:
    """HunyuanVideo15Transformer3DModel: ``latent`` channels in and out (the input also carries T2V's zero condition
    latent and mask: 2 latent + 1 channels), 1 x 1 x 1 patches; ``embeds`` the widths of the (Qwen2.5-VL text, byT5
    glyph, SigLIP image) embeddings it takes; ``rope`` (frame, height, width) sums to ``head_dim``."""
    text, glyph, image = embeds
    return dict(
        in_channels=2 * latent + 1,
        out_channels=latent,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers,
        num_refiner_layers=refiner,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=text,
        text_embed_2_dim=glyph,
        image_embed_dim=image,
        rope_theta=256.0,
        rope_axes_dim=rope,
        use_meanflow=False,
        target_size=640,
        task_type="t2v",
    )


def _vae(latent: int, channels: tuple[int, ...], layers: int, spatial: int) -> dict[str, Any]:
    """AutoencoderKLHunyuanVideo15: ``latent`` channels, ``spatial``x spatial (log2 of it downsampling stages, so
    ``channels`` has at least one more level), 4x temporal; the last width a multiple of 2 ``latent``."""
    return dict(
        in_channels=3,
        out_channels=3,
        latent_channels=latent,
        block_out_channels=channels,
        layers_per_block=layers,
        spatial_compression_ratio=spatial,
        temporal_compression_ratio=4,
        downsample_match_channel=True,
        upsample_match_channel=True,
        scaling_factor=SCALING_FACTOR,
    )


def _qwen2_5_vl_text(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, mrope) -> dict[str, Any]:
    """Qwen2_5_VLTextConfig's arguments: Qwen-Image's Qwen2.5-VL language model without the vision tower."""
    arch = _qwen2_5_vl(hidden, layers, heads, kv_heads, intermediate, mrope, _vision(1, 16, 2, 32, 16, [0]))
    return {k: v for k, v in arch.items() if k != "vision_config"}


SIZES = {
    "tiny": Size(  # 32 px x 5 frames -> 2 x 4 x 4 latent (8x VAE) -> 32 video tokens
        transformer=_dit(2, 16, layers=1, refiner=1, embeds=(32, 32, 16), latent=8, rope=(4, 6, 6)),
        vae=_vae(8, (8, 8, 8, 16), 1, spatial=8),
        text_encoders=dict(
            text_encoder=_qwen2_5_vl_text(32, 3, 2, 1, 64, [2, 3, 3]),
            text_encoder_2=t5_encoder(32, 16, 2, 64, 1),
        ),
    ),
    "small": Size(  # 256 px x 5 frames -> 2 x 16 x 16 latent (16x VAE, like the real one) -> 512 video tokens
        transformer=_dit(4, 32, layers=4, refiner=2, embeds=(64, 64, 32), latent=32, rope=(8, 12, 12)),
        vae=_vae(32, (16, 32, 32, 64, 64), 1, spatial=16),
        text_encoders=dict(
            text_encoder=_qwen2_5_vl_text(64, 3, 4, 2, 128, [2, 3, 3]),
            text_encoder_2=t5_encoder(64, 16, 4, 128, 2),
        ),
    ),
    "full": Size(  # HunyuanVideo-1.5 480p T2V: 8.33B transformer, Qwen2.5-VL-7B language model, byT5-small (Glyph)
        transformer=_dit(16, 128, layers=54, refiner=2, embeds=(3584, 1472, 1152), latent=32, rope=(16, 56, 56)),
        vae=_vae(32, (128, 256, 512, 1024, 1024), 2, spatial=16),
        text_encoders=dict(
            text_encoder=_qwen2_5_vl_text(3584, 28, 28, 4, 18944, [16, 24, 24]),
            text_encoder_2=t5_encoder(*BYT5_SMALL),
        ),
    ),
}
