"""Wan2.1 text-to-video's runtime (:class:`Wan`): a DiT over causal-3D-VAE latents ``[C, F', h, w]``, conditioned
on UMT5 token embeddings.

Latent layout seen by the policy is the VAE's own ``x [B, C, F', h, w]`` with F' = (F - 1) / t + 1 and h = H / s for the
VAE's temporal / spatial factors t, s (the transformer patchifies 1x2x2 itself). The transformer takes the timestep in
[0, 1000], so it is fed 1000 sigma. Latents are normalised per channel: z = (z_vae - mean) / std, decoded as
z_vae = z std + mean (as diffusers' ``WanPipeline``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.sequence_parallel import SequenceParallel
from lean.models.spec import VideoLatents
from lean.models.text import PromptEmbeds, tokenize
from lean.models.wan.sequence_parallel import shard_sequence


class Wan(VideoLatents):
    """Wan geometry, conditioning and calls for a fixed resolution and frame count (4k + 1 frames)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int, width: int | None = None):
        t, s = vae_config.scale_factor_temporal, vae_config.scale_factor_spatial
        if (num_frames - 1) % t:
            raise ValueError(f"num_frames={num_frames}: Wan's VAE needs {t}k + 1 frames")
        # resolution is the height; width (model.width) when the frames are not square, as Wan's 480 x 832
        self.frames, self.h, self.w = (num_frames - 1) // t + 1, resolution // s, (width or resolution) // s
        self.patch = tuple(transformer_config.patch_size)  # (t, h, w)
        self.channels = vae_config.z_dim
        self.mean = torch.tensor(vae_config.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(vae_config.latents_std).view(1, -1, 1, 1, 1)

    def latents_from_vae(self, z: Tensor) -> Tensor:
        return self.noise_to_latents((z - self.mean.to(z)) / self.std.to(z))

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """UMT5 last hidden states with the padding positions zeroed (WanPipeline trims and zero-pads them)."""
        ids, mask = tokenize(tokenizers["tokenizer"], prompts, max_length, device)
        tokens = encoders["text_encoder"](ids, mask).last_hidden_state
        return PromptEmbeds(tokens * mask[..., None].to(tokens.dtype))

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, C, F', h, w]``."""
        if guidance_embed is not None:
            raise ValueError("Wan has no distilled-guidance embedding; use CFG")
        return transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=emb.tokens, return_dict=False)[
            0
        ]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Videos in [-1, 1], ``[B, 3, F, H, W]``."""
        z = x * self.std.to(x) + self.mean.to(x)
        return vae.decode(z, return_dict=False)[0]

    splits_text = False  # sequence parallelism splits the video tokens only (cross-attention reads the whole text)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        return shard_sequence(net, sp)
