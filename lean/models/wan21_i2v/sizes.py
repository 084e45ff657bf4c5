"""Wan2.1 image-to-video's sizes: tiny (tests), small (CPU bench) and full (Wan2.1-I2V-14B-480P as published), each
with a CLIP vision encoder for the conditioning image.

The transformer is Wan's (``lean.models.wan.sizes``) taking 36 channels (the 16-channel noisy latent, the 4-channel
mask and the 16-channel conditioning latent) and reading the image's CLIP states through added key / value
projections (``image_dim`` = the encoder's width, ``added_kv_proj_dim`` = the transformer's). The full size is
diffusers' conversion of Wan2.1-I2V-14B-480P (huggingface/diffusers@7d56827 scripts/convert_wan_to_diffusers.py,
``get_transformer_config("Wan-I2V-14B-480p")``: 40 heads x 128, ffn 13824, 40 layers, in_channels 36, image_dim
1280, added_kv_proj_dim 5120), Wan2.1's VAE and UMT5-XXL; its image encoder is laion/CLIP-ViT-H-14-laion2B-s32B-b79K
(the same script's ``__main__``), a ViT-H/14 (written from memory: width 1280, 32 layers, 16 heads, MLP 5120, 224 px,
14 px patches: 257 tokens, GELU), prepared by its ``CLIPImageProcessor`` (224 px shortest edge, bicubic, 224 x 224
centre crop, OpenAI CLIP's mean and std). The smaller sizes shrink the encoder's width and depth and keep its 224 px
input (one image processor for every size), in larger patches: 56 px at tiny (17 tokens), 28 px at small (65).
"""

from __future__ import annotations

from typing import Any

from lean.models.spec import Size
from lean.models.wan.sizes import SIZES as WAN_SIZES
from lean.models.wan.sizes import _dit

LATENT, MASK = 16, 4  # the Wan2.1 VAE's channels; the mask's, its temporal factor


def dit_i2v(image_dim: int | None, **arch: int) -> dict[str, Any]:
    """Wan's transformer on ``[x; mask; condition]`` (36 channels in, 16 out); with ``image_dim`` it reads an image
    encoder's states of that width through added key / value projections of its own width."""
    config = _dit(**arch)
    width = arch["heads"] * arch["head_dim"]
    return {
        **config,
        "in_channels": 2 * LATENT + MASK,
        "image_dim": image_dim,
        "added_kv_proj_dim": width if image_dim is not None else None,
    }


def clip_vision(width: int, mlp: int, layers: int, heads: int, side: int, patch: int) -> dict[str, Any]:
    """transformers' ``CLIPVisionConfig``: a ViT of ``layers`` blocks over ``side`` px images in ``patch`` px
    patches (``(side / patch)^2 + 1`` tokens with the class token)."""
    return dict(
        hidden_size=width,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=side,
        patch_size=patch,
        projection_dim=1024 if width == 1280 else width,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )


SIDE = 224  # the image encoder's input side (ViT-H/14's), at every size

IMAGE_PROCESSOR = dict(  # CLIPImageProcessor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K (from memory)
    size={"shortest_edge": SIDE},
    crop_size={"height": SIDE, "width": SIDE},
    resample=3,  # PIL bicubic
    do_center_crop=True,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)

SIZES = {
    "tiny": Size(
        transformer=dit_i2v(32, heads=2, head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, layers=1),
        vae=WAN_SIZES["tiny"].vae,
        text_encoders={
            **WAN_SIZES["tiny"].text_encoders,
            "image_encoder": clip_vision(32, 64, 2, 2, SIDE, 56),  # 16 patches + the class token
        },
    ),
    "small": Size(
        transformer=dit_i2v(64, heads=4, head_dim=32, text_dim=64, freq_dim=64, ffn_dim=256, layers=4),
        vae=WAN_SIZES["small"].vae,
        text_encoders={**WAN_SIZES["small"].text_encoders, "image_encoder": clip_vision(64, 256, 2, 4, SIDE, 28)},
    ),
    "full": Size(  # Wan2.1-I2V-14B-480P: the 14B transformer, Wan2.1's VAE, UMT5-XXL, CLIP ViT-H/14
        transformer=dit_i2v(1280, heads=40, head_dim=128, text_dim=4096, freq_dim=256, ffn_dim=13824, layers=40),
        vae=WAN_SIZES["full"].vae,
        text_encoders={**WAN_SIZES["full"].text_encoders, "image_encoder": clip_vision(1280, 5120, 32, 16, SIDE, 14)},
    ),
}
