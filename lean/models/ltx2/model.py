"""LTX-2's runtime (:class:`LTX2`): text to video with a soundtrack, as diffusers' ``LTX2Pipeline`` (diffusers 0.42,
pipelines/ltx2/pipeline_ltx2.py, "pipeline_ltx2.py" below) runs it. One transformer (LTX2VideoTransformer3DModel)
denoises a video stream and an audio stream together: each stream attends to itself, to its text, and to the other
stream.

The state is both latents, one tensor: ``x [B, S_v + S_a, C]``, the video tokens then the audio tokens (Flow-Factory
concatenates them the same way, src/flow_factory/models/ltx2/ltx2_t2av.py:1160-1163). The video tokens are the
packed VAE latent ``[C, F', h, w]`` in 1x1x1 patches (``LTX2Pipeline._pack_latents``, :651-671), S_v = F' h w with
F' = (F - 1) / 8 + 1, h = H / 32, w = W / 32; the audio tokens are the audio VAE latent ``[C_a, L, M]`` packed as
``[L, C_a M]`` (``_pack_audio_latents``, :727-746), L = round(F / fps x 16000 / 160 / 4) latent audio frames at the
pipeline's 24 fps (:1305-1310) and M = mel bins / 4; C = C_a M (128 = 8 x 16 as published). Both start as N(0, I)
(:766-849) and both step on the same sigma grid (:1345-1372, :1593-1596: a copy of the scheduler steps the audio), so
the SDE, its log-probability and the loss see every video and audio entry: lean's GRPO trains the soundtrack too.

Velocity (``forward``): the transformer's two outputs, ``[v_video, v_audio]`` concatenated the same way; it is the
scheduler's flow velocity (noise - x_0: the pipeline steps ``latents + (sigma' - sigma) v``). Its timestep and its
prompt-modulation sigma are both 1000 sigma (:1412-1421; ``use_cross_timestep`` as the pipeline's default, which equals
the legacy choice when both streams share sigma, as here).

Text conditioning (``encode_text``; ``_get_gemma_prompt_embeds``, :303-365, and the connectors, :1251-1253): each
stripped prompt is tokenized on the left to ``max_length`` tokens; every hidden state of the Gemma-3 encoder is
stacked, ``[B, L, D x (layers + 1)]``, and the text connectors (LTX2TextConnectors) turn it into a video and an audio
text embedding and a mask (padding replaced by learned registers: every token then counts). lean holds the two
embeddings side by side in ``PromptEmbeds.tokens [B, L, D_v + D_a]`` and splits them in ``forward``.

Decoding: the video tokens unpacked, ``z = x std / scaling + mean`` with the VAE's per-channel latent statistics
(buffers of the VAE, not its config), then the VAE (:1614-1660; its decode timestep 0 and decode noise 0, the
pipeline's defaults); the soundtrack (``decode_audio``): the audio tokens ``x std_a + mean_a`` with the audio VAE's
statistics over the packed features, unpacked to ``[C_a, L, M]``, the audio VAE's mel spectrogram, then the vocoder:
stereo waveforms (:1623-1626, :1662-1664).

CFG: the pipeline guides in x_0 (:1440-1458) with ``x_0 = x - sigma v``; ``x_0c + (g - 1)(x_0c - x_0u)`` is the
velocity ``v_u + g (v_c - v_u)``, lean's CFG at s = g, where the video's and the audio's scales are equal
(Flow-Factory's recipe runs without CFG). Its STG, modality-isolation guidance and guidance rescale are not modelled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lean.models.ltx2.sequence_parallel import shard_sequence
from lean.models.sequence_parallel import SequenceParallel
from lean.models.text import PromptEmbeds, tokenize

FRAME_RATE = 24.0  # LTX2Pipeline's frame_rate default (:940), Flow-Factory's train.frame_rate (t2av_pickscore.yaml:56)


class LTX2:
    """LTX-2 geometry, conditioning and calls for a fixed size and frame count (8k + 1 frames)."""

    def __init__(self, transformer_config, vae_config, resolution: int, num_frames: int, width: int | None = None):
        s, t = vae_config.spatial_compression_ratio, vae_config.temporal_compression_ratio
        width = width or resolution
        if (num_frames - 1) % t or resolution % s or width % s:
            raise ValueError(f"LTX-2's VAE needs {t}k + 1 frames and sides that are multiples of {s}")
        c = transformer_config
        if (c.patch_size, c.patch_size_t, c.audio_patch_size, c.audio_patch_size_t) != (1, 1, 1, 1):
            raise ValueError("LTX-2's runtime packs 1x1x1 patches (the published patch sizes)")
        if c.in_channels != c.audio_in_channels:
            raise ValueError("the joint state needs in_channels = audio_in_channels")
        self.frames, self.h, self.w = (num_frames - 1) // t + 1, resolution // s, width // s
        self.channels = c.in_channels
        seconds = num_frames / FRAME_RATE  # the audio VAE's rate and hop are the transformer's (16000, 160)
        self.audio_frames = round(seconds * c.audio_sampling_rate / c.audio_hop_length / c.audio_scale_factor)
        self.video_tokens = self.frames * self.h * self.w
        # the video text width: the stream's own (LTX-2.3's per-modality connectors), else the caption width
        self.text_width = c.cross_attention_dim if not c.use_prompt_embeddings else c.caption_channels

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.video_tokens + self.audio_frames, self.channels)

    latent_shape = noise_shape

    @property
    def image_seq_len(self) -> int:
        """Video tokens: the scheduler's mu reads them (:1346-1352), sequence parallelism splits them."""
        return self.video_tokens

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        return noise

    def latents_from_vae(self, z: Tensor) -> Tensor:
        raise NotImplementedError("LTX-2's latent statistics are VAE buffers: latents_from_vae gets no VAE")

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(video tokens ``[B, S_v, C]``, audio tokens ``[B, L, C]``) of the joint state."""
        return x[:, : self.video_tokens], x[:, self.video_tokens :]

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """The connectors' video and audio text embeddings side by side, ``[B, L, D_v + D_a]``, with their mask."""
        if images is not None:
            raise ValueError("LTX-2's text-to-video encoder takes no image")
        tokenizer = tokenizers["tokenizer"]
        tokenizer.padding_side = "left"  # Gemma pads on the left (:330-333)
        ids, mask = tokenize(tokenizer, [p.strip() for p in prompts], max_length, device)
        hidden = encoders["text_encoder"](input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        video, audio, kept = encoders["connectors"](torch.stack(hidden, -1).flatten(2, 3), mask, padding_side="left")
        return PromptEmbeds(torch.cat([video, audio], -1), mask=kept.long())

    def forward(self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        """Velocity of the joint state ``[B, S_v + L, C]``."""
        if guidance_embed is not None:
            raise ValueError("LTX-2 has no distilled-guidance embedding; use CFG (sample.cfg)")
        video, audio = self.split(x)
        text, audio_text = emb.tokens[..., : self.text_width], emb.tokens[..., self.text_width :]
        t = sigma * 1000
        v, a = transformer(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=text,
            audio_encoder_hidden_states=audio_text,
            timestep=t,
            sigma=t,
            encoder_attention_mask=emb.mask,
            audio_encoder_attention_mask=emb.mask,
            num_frames=self.frames,
            height=self.h,
            width=self.w,
            fps=FRAME_RATE,
            audio_num_frames=self.audio_frames,
            use_cross_timestep=True,
            return_dict=False,
        )
        return torch.cat([v, a], 1)

    def decode(self, vae, x: Tensor) -> Tensor:
        """Videos in [-1, 1], ``[B, 3, F, H, W]``, from the video tokens."""
        video = self.split(x)[0]
        z = video.transpose(1, 2).unflatten(2, (self.frames, self.h, self.w))
        mean, std = (s.view(1, -1, 1, 1, 1).to(z) for s in (vae.latents_mean, vae.latents_std))
        z = z * std / vae.config.scaling_factor + mean
        timestep = z.new_zeros(len(z)) if vae.config.timestep_conditioning else None  # decode_timestep 0
        return vae.decode(z, timestep, return_dict=False)[0]

    def decode_audio(self, components, x: Tensor) -> Tensor:
        """Stereo waveforms ``[B, 2, samples]`` from the audio tokens (the audio VAE's mel spectrogram, the vocoder)."""
        audio_vae, vocoder = components["audio_vae"], components["vocoder"]
        a = self.split(x)[1]
        a = a * audio_vae.latents_std.to(a) + audio_vae.latents_mean.to(a)
        bins = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
        mel = audio_vae.decode(a.unflatten(2, (-1, bins)).transpose(1, 2), return_dict=False)[0]
        return vocoder(mel)

    splits_text = False  # sequence parallelism splits the video tokens (the text is cross-attended, whole)

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        return shard_sequence(net, sp)
