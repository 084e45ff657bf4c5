"""FLUX.1's runtime (:class:`Flux`): an MMDiT over 2x2-packed VAE latents, conditioned on T5 token embeddings
(``text_encoder_2``) and a CLIP pooled vector (``text_encoder``), with a distilled-guidance embedding.

Latent layout seen by the policy: packed tokens ``x [B, N, 4C]``, N = (h/2)(w/2) for a ``[C, h, w]`` VAE latent,
exactly as diffusers' ``FluxPipeline`` packs it. The transformer takes sigma in [0, 1] (it multiplies by 1000 itself).
The VAE's latent is normalised as z = (z_vae - shift) * scale, so decoding uses z_vae = z / scale + shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.flux.sequence_parallel import shard_sequence
from lean.models.latent_grid import vae_scale
from lean.models.sequence_parallel import SequenceParallel
from lean.models.text import PromptEmbeds, tokenize


def pack(z: Tensor) -> Tensor:
    """``[B, C, h, w] -> [B, (h/2)(w/2), 4C]``: each 2x2 latent patch becomes one token (row-major)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    """Inverse of :func:`pack` for an ``h x w`` latent."""
    b, _, d = x.shape
    c = d // 4
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def distilled_guidance(sigma: Tensor, has_guidance: bool, guidance_embed: float | None, model: str) -> Tensor | None:
    """The guidance embedder's input per sample: ``guidance_embed`` (1.0 when unset, as lean feeds a
    guidance-distilled model without one), or None for a transformer without the embedder (where a value is an
    error: such a model guides by CFG)."""
    if has_guidance:
        return sigma.new_full(sigma.shape, 1.0 if guidance_embed is None else guidance_embed)
    if guidance_embed is not None:
        raise ValueError(f"this {model} transformer has no guidance embedder (guidance_embeds=False): use CFG")
    return None


class PackedLatents:
    """The geometry of 2x2-packed latents (FLUX.1, Qwen-Image): a ``[C, h, w]`` VAE latent drawn as noise, seen by
    the policy as ``(h/2)(w/2)`` tokens of width 4C (:func:`pack`). Subclasses set ``channels``, ``h``, ``w``."""

    channels: int
    h: int
    w: int

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.channels, self.h, self.w)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return ((self.h // 2) * (self.w // 2), self.channels * 4)

    @property
    def image_seq_len(self) -> int:
        """Image tokens (the pipelines' ``latents.shape[1]``, what their dynamic shift depends on)."""
        return (self.h // 2) * (self.w // 2)

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        return pack(noise)


class Flux(PackedLatents):
    """FLUX geometry, conditioning and calls for a fixed resolution (``num_frames`` is ignored: images)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int = 1):
        scale = vae_scale(vae_config)
        self.h = self.w = resolution // scale
        if self.h % 2:
            raise ValueError(f"resolution {resolution} gives an odd {self.h}x{self.w} latent; FLUX packs 2x2 patches")
        self.channels = vae_config.latent_channels
        self.scaling, self.shift = vae_config.scaling_factor, vae_config.shift_factor
        self.has_guidance = transformer_config.guidance_embeds
        self._ids: dict[tuple, tuple[Tensor, Tensor]] = {}

    def latents_from_vae(self, z: Tensor) -> Tensor:
        return self.noise_to_latents((z - self.shift) * self.scaling)

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """T5 last hidden states (no attention mask, as FluxPipeline) + CLIP pooled (eos) vector."""
        ids, _ = tokenize(tokenizers["tokenizer_2"], prompts, max_length, device)
        tokens = encoders["text_encoder_2"](ids)[0]
        clip = encoders["text_encoder"]
        # CLIP is causal, so its eos state does not depend on padding: pad to its full context, like FluxPipeline.
        ids, _ = tokenize(tokenizers["tokenizer"], prompts, clip.config.max_position_embeddings, device)
        return PromptEmbeds(tokens, clip(ids).pooler_output)

    def _positions(self, text_len: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """RoPE positions: image token (i, j) -> (0, i, j); text tokens all at 0. Batch-independent, cached."""
        key = (text_len, device, dtype)
        if key not in self._ids:
            i, j = torch.meshgrid(torch.arange(self.h // 2), torch.arange(self.w // 2), indexing="ij")
            img = torch.stack([torch.zeros_like(i), i, j], dim=-1).reshape(-1, 3)
            self._ids[key] = (img.to(device, dtype), torch.zeros(text_len, 3, device=device, dtype=dtype))
        return self._ids[key]

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, N, 4C]``; ``guidance_embed`` feeds the distilled-guidance embedder (1.0 when unset)."""
        guidance = distilled_guidance(sigma, self.has_guidance, guidance_embed, "FLUX")
        img_ids, txt_ids = self._positions(emb.tokens.shape[1], x.device, x.dtype)
        return transformer(
            hidden_states=x,
            encoder_hidden_states=emb.tokens,
            pooled_projections=emb.pooled,
            timestep=sigma,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Images in [-1, 1], ``[B, 3, H, W]``."""
        z = unpack(x, self.h, self.w) / self.scaling + self.shift
        return vae.decode(z, return_dict=False)[0]

    splits_text = True  # sequence parallelism splits the text tokens too (joint attention)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        return shard_sequence(net, sp)
