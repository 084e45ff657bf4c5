"""Z-Image's sizes: tiny (tests), small (CPU bench) and full (Tongyi-MAI/Z-Image-Turbo as published; the base
Z-Image has the same architecture).

The full transformer is diffusers' own defaults of ``ZImageTransformer2DModel.__init__`` (diffusers 0.42.1,
models/transformers/transformer_z_image.py:367-385), which are the published ``transformer/config.json`` (written from
memory of the Hugging Face folder, nothing is downloaded): a single-stream DiT of width 3840, 30 blocks, 30 heads x
128 (no GQA), 2 noise-refiner and 2 context-refiner blocks, qk RMS-norm, caption width 2560 (Qwen3-4B's), 2x2 patches
of a 16-channel latent, RoPE axes (32, 48, 48) over (caption/frame index, row, column) with theta 256. ~6.15B
parameters (the published "6B").

The text encoder is Qwen3-4B (``text_encoder/config.json``, from memory): width 2560, 36 layers, 32 heads, 8 key-value
heads of 128, MLP 9728, rope theta 1e6, 40960 positions, tied embeddings. The VAE is FLUX.1's AutoencoderKL (scaling
0.3611, shift 0.1159; ZImagePipeline decodes ``latents / scaling_factor + shift_factor``, pipeline_z_image.py:593).

The smaller sizes shrink every width and depth and keep the structure. The text encoders keep at least two layers:
the pipeline reads the second-to-last hidden state (pipeline_z_image.py:244). A random build takes its vocabulary and
special tokens from lean's own tokenizer, so ``vocab_size`` is not in these tables.
"""

from __future__ import annotations

from lean.models.flux.sizes import SIZES as FLUX_SIZES
from lean.models.flux2_klein.sizes import qwen3
from lean.models.spec import Size


def _dit(width: int, layers: int, refiners: int, heads: int, text_dim: int, rope: tuple[int, ...], lens) -> dict:
    """ZImageTransformer2DModel: ``layers`` single-stream blocks after ``refiners`` noise- and context-refiner blocks;
    ``rope``: the rotary axes, summing to the head width ``width / heads``; ``lens``: positions per axis (the first
    counts caption tokens, then the image's frame index after them)."""
    return dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=width,
        n_layers=layers,
        n_refiner_layers=refiners,
        n_heads=heads,
        n_kv_heads=heads,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=text_dim,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=list(rope),
        axes_lens=list(lens),
    )


SIZES = {
    "tiny": Size(  # 32 px -> 8x8 latent (FLUX's tiny 4x VAE) -> 16 tokens of 2x2 patches
        transformer=_dit(32, 1, 1, heads=2, text_dim=16, rope=(4, 6, 6), lens=(256, 64, 64)),
        vae=FLUX_SIZES["tiny"].vae,
        text_encoders=dict(text_encoder=qwen3(16, 32, 2, 2, 1, 8)),
    ),
    "small": Size(  # 256 px -> 32x32 latent (8x VAE, like the real one) -> 256 tokens
        transformer=_dit(128, 4, 1, heads=4, text_dim=64, rope=(8, 12, 12), lens=(1024, 128, 128)),
        vae=FLUX_SIZES["small"].vae,
        text_encoders=dict(text_encoder=qwen3(64, 128, 2, 4, 2, 16)),
    ),
    "full": Size(  # Tongyi-MAI/Z-Image-Turbo: 6.15B transformer, Qwen3-4B text encoder, FLUX.1's VAE
        transformer=_dit(3840, 30, 2, heads=30, text_dim=2560, rope=(32, 48, 48), lens=(1024, 512, 512)),
        vae=FLUX_SIZES["full"].vae,
        text_encoders=dict(
            text_encoder=qwen3(
                2560,
                9728,
                36,
                32,
                8,
                128,
                max_position_embeddings=40960,
                rope_parameters={"rope_type": "default", "rope_theta": 1.0e6},
                tie_word_embeddings=True,
            )
        ),
    ),
}
