"""FLUX.2's runtime (:class:`Flux2`; Black Forest Labs): an MMDiT (8 double-stream + 48 single-stream blocks at
[dev]'s size) over 2x2-patchified VAE latent tokens, conditioned on stacked hidden states of one text encoder, with a
distilled-guidance embedding ([dev]) or true CFG ([klein] base), as diffusers' ``Flux2Pipeline`` and
``Flux2KleinPipeline`` run it. [klein] subclasses it with its own text encoder (``lean.models.flux2_klein``).

Latent layout seen by the policy, for a ``[C, h, w]`` VAE latent (C = 32 as published):

    patchify:  z [C, h, w] -> p [4C, h/2, w/2]          p[4c + 2i + j, y, x] = z[c, 2y + i, 2x + j]
    normalise: n = (p - mu_bn) / sqrt(var_bn + eps)     mu_bn, var_bn: the VAE's ``bn.running_mean / running_var``
    pack:      x [N, 4C], N = (h/2)(w/2), row-major      (``Flux2Pipeline._pack_latents``)

The pipeline draws its noise in the patchified layout ``[4C, h/2, w/2]`` and packs it, and so does the policy
(``noise_shape``), so a generator gives the same x_1 in both. Positions are 4-D rotary ids (t, h, w, l): image token
(y, x) -> (0, y, x, 0), text token l -> (0, 0, 0, l). The transformer takes sigma in [0, 1] (it multiplies by 1000
itself), and the guidance value g as g (also x 1000 inside). Decoding inverts the normalisation, the packing and the
patchify before the VAE decoder (``Flux2Pipeline.__call__`` after its loop).

Edits (``Flux2Pipeline`` / ``Flux2KleinPipeline`` with ``image=``; one reference image per prompt): the reference
r, in [-1, 1], is encoded as the samples are decoded, inverted: the VAE latent distribution's mode
(``sample_mode="argmax"``), patchified, BatchNorm-normalised and packed (``_encode_vae_image``,
``prepare_image_latents``) into ``[N_r, 4C]`` tokens, at rotary ids (10, y, x, 0) (``_prepare_image_ids``: the k-th
reference at t = 10 + 10k). The transformer sees ``[x; r]`` and ``[img_ids; ref_ids]`` and the velocity is its first N
output tokens (the pipelines' ``noise_pred[:, : latents.size(1)]``); the text never sees the image (``encode_prompt``
takes none; only Flux2Pipeline's optional caption upsampling, which lean does not run, does) and the dynamic shift
counts the noisy tokens only (``image_seq_len = latents.shape[1]``). The reference is encoded once per prompt
(``PromptEmbeds.reference``) and carries no gradient; CFG's negative branch keeps it (the pipelines concatenate it to
both). Flow-Factory's FLUX.2 adapters condition alike (X-GenGroup/Flow-Factory a0b2bc5,
src/flow_factory/models/flux/flux2_klein.py:776-798).

The BatchNorm statistics are VAE buffers, not config values, so the runtime (built from configs) reads them from the
VAE it is given (:meth:`decode`, :func:`normalise`); :meth:`latents_from_vae`, which gets no VAE, refuses.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lean.models.flux.model import distilled_guidance
from lean.models.flux2.sizes import HIDDEN_LAYERS
from lean.models.flux2.text import mistral_prompt_embeds
from lean.models.latent_grid import vae_scale
from lean.models.sequence_parallel import SequenceParallel
from lean.models.text import PromptEmbeds

NO_SEQUENCE_PARALLEL = (
    "FLUX.2 has no sequence parallelism yet: its single-stream blocks fuse q, k, v and the MLP input into one Linear "
    "(to_qkv_mlp_proj) and the attention and MLP outputs into another (to_out), which lean's Ulysses processors "
    "(separate q/k/v and output projections) do not split"
)


def patchify(z: Tensor) -> Tensor:
    """``[B, C, h, w] -> [B, 4C, h/2, w/2]`` (``Flux2Pipeline._patchify_latents``)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(p: Tensor) -> Tensor:
    """Inverse of :func:`patchify` (``Flux2Pipeline._unpatchify_latents``)."""
    b, c4, h, w = p.shape
    return p.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


def pack(p: Tensor) -> Tensor:
    """``[B, D, H, W] -> [B, H W, D]`` (row-major tokens)."""
    b, d, h, w = p.shape
    return p.reshape(b, d, h * w).permute(0, 2, 1)


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    """Inverse of :func:`pack` for an ``h x w`` token grid."""
    b, _, d = x.shape
    return x.permute(0, 2, 1).reshape(b, d, h, w)


REFERENCE_TIME = 10  # the reference's rotary time id: Flux2Pipeline._prepare_image_ids' scale + scale * 0


def grid_ids(t: int, h: int, w: int) -> Tensor:
    """Rotary ids ``[h w, 4]`` of an ``h x w`` token grid at time id ``t``: token (y, x) -> (t, y, x, 0)."""
    zero = torch.arange(1)
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), zero)


def bn_stats(vae, like: Tensor) -> tuple[Tensor, Tensor]:
    """The VAE's latent BatchNorm mean and std ``[1, 4C, 1, 1]`` (std = sqrt(running_var + batch_norm_eps))."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def normalise(vae, z: Tensor) -> Tensor:
    """VAE latents ``[B, C, h, w]`` -> the policy's tokens ``[B, N, 4C]`` (``Flux2Pipeline._encode_vae_image`` and
    ``_pack_latents``)."""
    p = patchify(z)
    mean, std = bn_stats(vae, p)
    return pack((p - mean) / std)


class Flux2:
    """FLUX.2 geometry, conditioning and calls for a fixed resolution (``num_frames`` is ignored: images)."""

    hidden_layers: tuple[int, ...] = HIDDEN_LAYERS  # the text encoder's stacked hidden states

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int = 1):
        scale = vae_scale(vae_config)
        latent = resolution // scale
        if latent % 2:
            raise ValueError(f"resolution {resolution} gives an odd {latent}x{latent} latent; FLUX.2 packs 2x2 patches")
        self.h = self.w = latent // 2  # the token grid
        self.channels = 4 * vae_config.latent_channels  # per token
        self.has_guidance = transformer_config.guidance_embeds
        self._ids: dict[tuple, tuple[Tensor, Tensor]] = {}

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.channels, self.h, self.w)  # the patchified layout Flux2Pipeline.prepare_latents draws

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.h * self.w, self.channels)

    @property
    def image_seq_len(self) -> int:
        """Image tokens (the pipelines' ``latents.shape[1]``, what their empirical mu depends on)."""
        return self.h * self.w

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        return pack(noise)

    def latents_from_vae(self, z: Tensor) -> Tensor:
        raise NotImplementedError(
            "FLUX.2 normalises latents with the VAE's BatchNorm buffers; use lean.models.flux2.model.normalise(vae, z)"
        )

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """Mistral Small 3.1's hidden states 10, 20, 30 side by side (``lean.models.flux2.text``); no pooled vector,
        no text mask (the transformer attends to the padding too, as in the pipeline)."""
        tokens = mistral_prompt_embeds(
            encoders["text_encoder"], tokenizers["tokenizer"], prompts, max_length, device, self.hidden_layers
        )
        return PromptEmbeds(tokens)

    def _positions(self, text_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """4-D rotary ids (t, h, w, l), as the pipelines build them: image token (y, x) -> (0, y, x, 0), text token
        l -> (0, 0, 0, l). Integer ids (the transformer reads them as float32); batch-independent, cached."""
        key = (text_len, device)
        if key not in self._ids:
            zero = torch.arange(1)
            txt = torch.cartesian_prod(zero, zero, zero, torch.arange(text_len))
            self._ids[key] = (grid_ids(0, self.h, self.w).to(device), txt.to(device))
        return self._ids[key]

    def _reference_positions(self, tokens: int, device: torch.device) -> Tensor:
        """Rotary ids of a square reference of ``tokens`` tokens (lean resizes every reference to a square)."""
        side = math.isqrt(tokens)
        return grid_ids(REFERENCE_TIME, side, side).to(device)

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, N, 4C]``; ``guidance_embed`` feeds the distilled-guidance embedder (1.0 when unset). An edit's
        reference tokens (``emb.reference``) go beside the noisy ones; their outputs are dropped."""
        guidance = distilled_guidance(sigma, self.has_guidance, guidance_embed, "FLUX.2")
        img_ids, txt_ids = self._positions(emb.tokens.shape[1], x.device)
        hidden = x
        if emb.reference is not None:
            hidden = torch.cat([x, emb.reference.to(x.dtype)], dim=1)
            img_ids = torch.cat([img_ids, self._reference_positions(emb.reference.shape[1], x.device)])
        out = transformer(
            hidden_states=hidden,
            encoder_hidden_states=emb.tokens,
            timestep=sigma,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]
        return out[:, : x.shape[1]]

    def decode(self, vae, x: Tensor) -> Tensor:
        """Images in [-1, 1], ``[B, 3, H, W]``."""
        p = unpack(x, self.h, self.w)
        mean, std = bn_stats(vae, p)
        return vae.decode(unpatchify(p * std + mean), return_dict=False)[0]

    splits_text = True  # joint attention over text and image tokens (were sequence parallelism implemented)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> packed reference tokens ``[B, N_r, 4C]``: the VAE latent's mode, normalised
        as the samples (``Flux2Pipeline._encode_vae_image``)."""
        return normalise(vae, vae.encode(pixels, return_dict=False)[0].mode())

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        raise NotImplementedError(NO_SEQUENCE_PARALLEL)
