"""Wan2.2-TI2V-5B's runtime in text-to-video mode (:class:`Wan22TI2V`): Wan's (``lean.models.wan.model.Wan``: the
latent geometry read from the VAE config, UMT5 conditioning, per-channel normalisation, decode) with the timestep
given per video token.

WanPipeline with ``expand_timesteps=True`` (TI2V-5B's ``model_index.json``) hands the transformer a timestep of shape
``[B, seq_len]``: ``mask[0][0][:, ::2, ::2] * t`` flattened, one value per 1x2x2 patch of the latent. In
text-to-video the mask is all ones (``torch.ones`` in WanPipeline; the zeroed first frame is image-to-video's,
WanImageToVideoPipeline's ``first_frame_mask``), so every token carries ``t`` (``1000 sigma`` here). The transformer
then embeds the timestep per token (its ``temb [B, seq_len, D]`` and the blocks' modulation ``[B, seq_len, 6, D]``),
which this runtime reproduces exactly.

Sequence parallelism: Wan's (the tokens split before the first block, Ulysses self-attention, the output gathered
after ``proj_out``), plus the per-token time embeddings split alike, so that each rank modulates its own tokens.
"""

from __future__ import annotations

from torch import Tensor

from lean.models.sequence_parallel import SequenceParallel
from lean.models.text import PromptEmbeds
from lean.models.wan.model import Wan
from lean.models.wan.sequence_parallel import shard_sequence
from lean.parallel.overlap.sequence import split_tokens


class Wan22TI2V(Wan):
    """Wan2.2-TI2V-5B text-to-video: Wan's geometry and conditioning, the timestep expanded over the video tokens."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int, width: int | None = None):
        super().__init__(transformer_config, vae_config, resolution, num_frames, width)
        side = vae_config.scale_factor_spatial * self.patch[1]
        if resolution % side or (width or resolution) % side:  # WanPipeline rounds height and width down to it
            raise ValueError(f"{resolution} x {width or resolution}: Wan2.2-TI2V-5B needs a multiple of {side} pixels")

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity ``[B, C, F', h, w]``; the timestep ``1000 sigma`` of each sample on every one of its tokens, as
        WanPipeline's ``expand_timesteps`` branch passes it (the all-ones first-frame mask of text-to-video)."""
        if guidance_embed is not None:
            raise ValueError("Wan has no distilled-guidance embedding; use CFG")
        timestep = (sigma * 1000)[:, None].expand(-1, self.image_seq_len)
        return transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=emb.tokens, return_dict=False)[0]

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        """Wan's sequence parallelism, and the condition embedder's per-token outputs (``temb [B, S, D]``, the blocks'
        ``timestep_proj [B, S, 6D]``) split along the tokens as the hidden states are: each rank's blocks and output
        norm modulate its own tokens. The embedder's gradient on a rank is then its tokens' share, as every other
        weight's is (``lean.parallel.overlap.sequence``)."""

        def split_time(module, args, output):
            temb, timestep_proj, *rest = output
            if temb.ndim != 3:  # a timestep per sample (not WanPipeline's expand_timesteps): nothing per token
                return output
            return (split_tokens(temb, 1, sp.ov), split_tokens(timestep_proj, 1, sp.ov), *rest)

        return [*shard_sequence(net, sp), net.condition_embedder.register_forward_hook(split_time)]
