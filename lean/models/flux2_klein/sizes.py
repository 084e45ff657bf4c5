"""FLUX.2 [klein]'s sizes: tiny (tests), small (CPU bench) and full (black-forest-labs/FLUX.2-klein-9B as published).

9B, not 4B: it is what diffusers' Flux2KleinPipeline example loads (FLUX.2-klein-base-9B; same architecture) and what
Flow-Factory's FLUX.2 [klein] recipes train (examples/grpo/lora/flux2_klein{,_base}/default.yaml). The transformer
(``lean.models.flux2.sizes.flux2_transformer``) has no guidance embedder; the text encoder is Qwen3
(``Qwen3ForCausalLM``) whose hidden states 9, 18 and 27 the pipeline stacks (so joint_attention_dim = 3 x its width);
every size keeps more than 27 layers so that hidden state 27 is not the last, normed one. The VAE is FLUX.2's.
"""

from __future__ import annotations

from lean.models.flux2.sizes import SIZES as FLUX2_SIZES
from lean.models.flux2.sizes import flux2_transformer
from lean.models.spec import Size

HIDDEN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers


def qwen3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, **extra) -> dict:
    """Qwen3Config (the vocabulary is the tokenizer's)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        **extra,
    )


def _transformer(double: int, single: int, heads: int, head_dim: int, text_dim: int, latent_channels: int) -> dict:
    return flux2_transformer(double, single, heads, head_dim, text_dim, latent_channels, guidance=False)


SIZES: dict[str, Size] = {
    "tiny": Size(  # as FLUX.2's tiny: 32 px -> 16 tokens of 32 channels
        transformer=_transformer(1, 1, heads=2, head_dim=16, text_dim=3 * 16, latent_channels=8),
        vae=FLUX2_SIZES["tiny"].vae,
        text_encoders=dict(text_encoder=qwen3(16, 32, 28, 2, 1, 8)),
    ),
    "small": Size(
        transformer=_transformer(2, 4, heads=4, head_dim=32, text_dim=3 * 32, latent_channels=8),
        vae=FLUX2_SIZES["small"].vae,
        text_encoders=dict(text_encoder=qwen3(32, 64, 28, 4, 2, 8)),
    ),
    # black-forest-labs/FLUX.2-klein-9B (transformer/, text_encoder/config.json): 8 double + 24 single blocks, 32
    # heads x 128 = 4096 wide, 12288 = 3 x 4096 text width, no guidance embedder: 9.1B parameters. Text encoder:
    # Qwen3-8B (36 layers, 4096 wide, GQA 32/8 heads of 128, MLP 12288, rope theta 1e6, untied head, 40960 positions).
    "full": Size(
        transformer=_transformer(8, 24, heads=32, head_dim=128, text_dim=12288, latent_channels=32),
        vae=FLUX2_SIZES["full"].vae,
        text_encoders=dict(
            text_encoder=qwen3(
                4096,
                12288,
                36,
                32,
                8,
                128,
                max_position_embeddings=40960,
                rope_parameters={"rope_type": "default", "rope_theta": 1.0e6},
                tie_word_embeddings=False,
            )
        ),
    ),
}
