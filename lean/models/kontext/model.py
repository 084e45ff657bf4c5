"""FLUX.1 Kontext's runtime (:class:`Kontext`): FLUX.1 (:class:`lean.models.flux.Flux`) with the reference image's
latent tokens appended to the noisy ones, as diffusers' ``FluxKontextPipeline`` runs it.

With x ``[B, N, 4C]`` the noisy packed latent and r ``[B, N_r, 4C]`` the reference's (its VAE latent's mode,
normalised and packed like x), the transformer sees ``[x; r]`` (N + N_r tokens) and the velocity is its first N
output tokens. RoPE positions: x's token (i, j) at (0, i, j), r's at (1, i, j): the first axis tells the images
apart. The reference is encoded once per prompt (``PromptEmbeds.reference``); it never carries a gradient.
FlowGRPO's Kontext script samples through the same pipeline (flow_grpo/diffusers_patch/
flux_kontext_pipeline_with_logprob.py, lines 154-170 and 209-227, yifan123/flow_grpo 9745241 read through its zhtmike
mirror).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.flux.model import Flux, distilled_guidance, pack
from lean.models.text import PromptEmbeds


class Kontext(Flux):
    """Kontext geometry and calls for a fixed resolution: the reference image has the samples' resolution (FlowGRPO
    resizes it to ``config.resolution``)."""

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> packed reference tokens ``[B, N_r, 4C]``: the latent distribution's mode
        (``sample_mode="argmax"``), normalised as the samples are."""
        z = vae.encode(pixels, return_dict=False)[0].mode()
        return pack((z - self.shift) * self.scaling)

    def _reference_positions(self, tokens: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Reference token (i, j) -> (1, i, j), for a square reference of ``tokens`` tokens."""
        side = int(tokens**0.5)
        i, j = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        return torch.stack([torch.ones_like(i), i, j], dim=-1).reshape(-1, 3).to(device, dtype)

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, N, 4C]`` of the noisy tokens, the reference's tokens beside them."""
        if emb.reference is None:
            raise ValueError('FLUX.1 Kontext edits a reference image: use a .jsonl prompt file with an "image" field')
        guidance = distilled_guidance(sigma, self.has_guidance, guidance_embed, "FLUX.1 Kontext")
        img_ids, txt_ids = self._positions(emb.tokens.shape[1], x.device, x.dtype)
        ref_ids = self._reference_positions(emb.reference.shape[1], x.device, x.dtype)
        out = transformer(
            hidden_states=torch.cat([x, emb.reference.to(x.dtype)], dim=1),
            encoder_hidden_states=emb.tokens,
            pooled_projections=emb.pooled,
            timestep=sigma,
            img_ids=torch.cat([img_ids, ref_ids]),
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]
        return out[:, : x.shape[1]]
