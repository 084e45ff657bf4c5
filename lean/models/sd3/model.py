"""Stable Diffusion 3 / 3.5's runtime (:class:`SD3`; Stability AI): an MMDiT with joint text-image attention over
2x2 patches of a 16-channel VAE latent, conditioned on three text encoders, as diffusers'
``StableDiffusion3Pipeline`` runs it.

Text conditioning (``encode_text``): two CLIP text towers with projection (``text_encoder`` = CLIP-L,
``text_encoder_2`` = OpenCLIP bigG) and a T5 encoder (``text_encoder_3``). With h_L, h_G the CLIP towers' penultimate
hidden states ``[B, 77, D_L]``, ``[B, 77, D_G]``, p_L, p_G their projected eos vectors and t the T5 last hidden states
``[B, L, D_T]``:

    tokens = concat_seq( pad_to_D_T( concat_feat(h_L, h_G) ), t )     [B, 77 + L, D_T]
    pooled = concat_feat(p_L, p_G)                                     [B, P_L + P_G]

SD3.5 adds qk RMS-norm and, in its first layers, a second (image-only) self-attention per block ("dual attention").
Latent layout seen by the policy: the VAE latent itself, ``x [B, 16, h, w]`` (the transformer patchifies 2x2 itself).
The transformer takes the timestep in [0, 1000], so it is fed 1000 sigma. The VAE latent is normalised as
z = (z_vae - shift) * scale, decoded as z_vae = z / scale + shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.latent_grid import LatentGrid, vae_scale
from lean.models.sequence_parallel import SequenceParallel
from lean.models.text import PromptEmbeds, tokenize


class SD3(LatentGrid):
    """SD3 geometry, conditioning and calls for a fixed resolution (``num_frames`` is ignored: images)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int = 1):
        latent = resolution // vae_scale(vae_config)
        patch, max_patches = transformer_config.patch_size, transformer_config.pos_embed_max_size
        if latent % patch or latent // patch > max_patches:
            raise ValueError(
                f"resolution {resolution} gives a {latent}x{latent} latent; SD3 needs a multiple of "
                f"{patch} with at most {max_patches} patches per side"
            )
        self.set_grid(vae_config, resolution, patch)

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """CLIP penultimate states (both towers, padded to their full context, no mask) side by side, zero-padded
        to the T5 width, followed by the T5 last hidden states (``max_length`` tokens, no mask); pooled: the two
        projected CLIP eos vectors side by side. As ``StableDiffusion3Pipeline.encode_prompt`` without clip_skip."""
        clip_len = encoders["text_encoder"].config.max_position_embeddings
        states, pooled = [], []
        for name, tok_name in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
            ids, _ = tokenize(tokenizers[tok_name], prompts, clip_len, device)
            out = encoders[name](ids, output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        ids, _ = tokenize(tokenizers["tokenizer_3"], prompts, max_length, device)
        t5 = encoders["text_encoder_3"](ids)[0]
        clip = torch.cat(states, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return PromptEmbeds(torch.cat([clip, t5], dim=1), torch.cat(pooled, dim=-1))

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, 16, h, w]``."""
        if guidance_embed is not None:
            raise ValueError("SD3 has no distilled-guidance embedding; use CFG")
        return transformer(
            hidden_states=x,
            encoder_hidden_states=emb.tokens,
            pooled_projections=emb.pooled,
            timestep=sigma * 1000,
            return_dict=False,
        )[0]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Images in [-1, 1], ``[B, 3, H, W]``."""
        return vae.decode(x / self.scaling + self.shift, return_dict=False)[0]

    splits_text = False  # no sequence parallelism (SPEC.sequence_parallel is False)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        raise NotImplementedError("SD3 has no sequence parallelism yet")
