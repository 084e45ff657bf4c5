"""Wan image-to-video's runtime (:class:`WanI2V`), as diffusers 0.42's ``WanImageToVideoPipeline`` runs it
(pipelines/wan/pipeline_wan_i2v.py): Wan2.1's (:class:`lean.models.wan.model.Wan`: the latent geometry, UMT5, the
per-channel normalisation, the decode) with the conditioning image entering the transformer twice.

The conditioning latent (``encode_reference``, ``prepare_latents`` without ``expand_timesteps``): the video
``[I, 0, ..., 0]`` of F frames (the image I in [-1, 1], then F - 1 black frames) through the VAE, the latent
distribution's mode, normalised per channel as the samples: c ``[B, 16, F', h, w]``; and the mask m ``[B, t, F', h, w]``
(t = the VAE's temporal factor, 4): the pipeline's per-frame mask (1 on frame 0, 0 after) with frame 0 repeated t
times, viewed as t channels per latent frame, which is 1 on latent frame 0 and 0 on the others. The reference is
``[m; c]`` ``[B, t + 16, F', h, w]`` (``PromptEmbeds.reference``), encoded once per prompt at the run's frame count.

The transformer (``forward``) sees ``[x; m; c]`` along the channels (36 = 16 + 4 + 16 in_channels) at timestep
``1000 sigma`` and returns the velocity of x's 16 channels. Wan2.1-I2V's transformer also reads the image through
its own cross-attention keys (``image_dim``, ``add_k_proj`` / ``add_v_proj``): ``encoder_hidden_states_image`` is
CLIP ViT-H/14's penultimate hidden states of I (``encode_image``: ``hidden_states[-2]``, 257 tokens as published),
after the pipeline's ``CLIPImageProcessor`` (``encode_text`` with ``images``: ``PromptEmbeds.image``). Its attention
processor takes every context token but the last 512 as the image's (``WanAttnProcessor``: "512 is the context
length of the text encoder, hardcoded"), so the text states are zero-padded to 512 tokens, as the pipeline's
``max_sequence_length=512`` pads them. Wan2.2-I2V-A14B's transformers read no CLIP states (``image_dim`` None): its
text keeps lean's ``model.text_max_length``, as Wan's.

CFG's unconditional branch is the negative prompt on the same image (the pipeline passes ``image_embeds`` and the
condition to both branches); the reference carries no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.text import PromptEmbeds
from lean.models.wan.model import Wan

TEXT_CONTEXT = 512  # WanAttnProcessor's hard-coded text length when the transformer reads image states


class WanI2V(Wan):
    """Wan image-to-video geometry, conditioning and calls for a fixed resolution and frame count."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int, width: int | None = None):
        super().__init__(transformer_config, vae_config, resolution, num_frames, width)
        self.num_frames, self.mask_channels = num_frames, vae_config.scale_factor_temporal
        self.reads_image = transformer_config.image_dim is not None  # Wan2.1-I2V's CLIP cross-attention
        expected = 2 * self.channels + self.mask_channels
        if transformer_config.in_channels != expected:
            raise ValueError(f"in_channels={transformer_config.in_channels}: Wan image-to-video takes {expected}")

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """UMT5's states (Wan's); where the transformer reads image states, zero-padded to :data:`TEXT_CONTEXT` tokens
        and, with ``images`` (PIL, one per prompt), CLIP's penultimate hidden states of each image."""
        emb = super().encode_text(encoders, tokenizers, prompts, max_length, device)
        if not self.reads_image:
            return emb
        if emb.tokens.shape[1] > TEXT_CONTEXT:
            raise ValueError(f"model.text_max_length={max_length}: Wan2.1-I2V reads at most {TEXT_CONTEXT} text tokens")
        emb.tokens = torch.nn.functional.pad(emb.tokens, (0, 0, 0, TEXT_CONTEXT - emb.tokens.shape[1]))
        if images is not None:
            emb.image = self.encode_image(encoders["image_encoder"], tokenizers["image_processor"], images, device)
        return emb

    @staticmethod
    def encode_image(encoder, processor, images, device: torch.device) -> Tensor:
        """``WanImageToVideoPipeline.encode_image``: the image processor's pixels, the encoder's second-to-last hidden
        states ``[B, 1 + patches, E]``."""
        pixels = processor(images=list(images), return_tensors="pt").pixel_values
        return encoder(pixel_values=pixels.to(device, encoder.dtype), output_hidden_states=True).hidden_states[-2]

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> ``[m; c]`` ``[B, t + C, F', h, w]`` (module docstring)."""
        frames = self.num_frames - 1
        video = torch.cat([pixels[:, :, None], pixels.new_zeros(*pixels.shape[:2], frames, *pixels.shape[2:])], 2)
        condition = self.latents_from_vae(vae.encode(video, return_dict=False)[0].mode())
        mask = condition.new_zeros(condition.shape[0], self.mask_channels, *condition.shape[2:])
        mask[:, :, 0] = 1
        return torch.cat([mask, condition], dim=1)

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, C, F', h, w]`` of x, the conditioning latent and mask beside it on the channels."""
        if guidance_embed is not None:
            raise ValueError("Wan has no distilled-guidance embedding; use CFG")
        if emb.reference is None:
            raise ValueError('Wan image-to-video needs an image per prompt: a .jsonl prompt file with an "image" field')
        if emb.reference.shape[2:] != x.shape[2:]:
            raise ValueError(f"a conditioning latent of {tuple(emb.reference.shape[2:])} for x of {tuple(x.shape[2:])}")
        if self.reads_image and emb.image is None:
            raise ValueError("Wan2.1-I2V reads the image's CLIP states: encode the prompt with its image")
        return transformer(
            hidden_states=torch.cat([x, emb.reference.to(x.dtype)], dim=1),
            timestep=sigma * 1000,
            encoder_hidden_states=emb.tokens,
            encoder_hidden_states_image=None if emb.image is None else emb.image.to(x.dtype),
            return_dict=False,
        )[0]
