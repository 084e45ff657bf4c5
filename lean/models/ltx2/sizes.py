"""LTX-2's sizes: tiny (tests), small (CPU bench) and full (LTX-2.3 as diffusers converts it: dg845/LTX-2.3-Diffusers,
the checkpoint Flow-Factory's recipe loads).

The full configs are diffusers' LTX-2 conversion configs for version "2.3" (``get_ltx2_transformer_config``,
``get_ltx2_connectors_config``, ``get_ltx2_video_vae_config``, ``get_ltx2_audio_vae_config``,
``get_ltx2_vocoder_config``; read in stored public diffusers source, nothing is downloaded):

* transformer (LTX2VideoTransformer3DModel, 18.99B parameters counted on the meta device): 48 blocks, a video
  stream of 32 heads x 128 and an audio stream of 32 heads x 64, each with self-attention, text cross-attention (video
  4096, audio 2048 wide), audio-to-video and
  video-to-audio cross-attention and a GELU MLP; gated attention and prompt (cross-attention) modulation in both
  streams, split RoPE, 128-channel video latents in 1x1x1 patches and 128-wide audio tokens (8 channels x 16 latent mel
  bins);
* connectors (LTX2TextConnectors): the 49 stacked Gemma-3 hidden states (3840 wide) RMS-normed and projected per
  modality (4096 / 2048), then 8 gated blocks each over 128 learned registers;
* video VAE (AutoencoderKLLTX2Video): 32x spatial, 8x temporal compression (F = 8k + 1 frames), 128 channels;
* audio VAE (AutoencoderKLLTX2Audio): stereo 64-bin mel spectrograms at 16 kHz, hop 160, 4x compressed in time and
  in mel bins, 8 latent channels; vocoder (LTX2VocoderWithBWE): 16 kHz waveforms extended to 48 kHz.

The text encoder is Gemma-3-12B (Gemma3ForConditionalGeneration; ``text_encoder/config.json``, from memory): width
3840, 48 layers, 16 heads, 8 key-value heads of 256, MLP 15360, and its SigLIP vision tower (1152 wide, 27 layers, 16
heads, MLP 4304, 896 px in 14 px patches, 256 tokens an image), which LTX-2 never feeds an image. Its rotary settings
stay at transformers' Gemma-3 defaults (no parameter depends on them). A random build takes its vocabulary from lean's
tokenizer, so ``vocab_size`` is not in these tables.

The smaller sizes shrink every width and depth and keep the structure and the two constraints the joint state needs:
the video and audio tokens are equally wide (``in_channels`` = audio latent channels x latent mel bins =
``audio_in_channels``, the audio VAE's ``base_channels``: its latent statistics are over those packed features), and
the connectors' widths are the transformer's text widths. The tiny VAE keeps 32x / 8x; its vocoders keep the 160 and
240 samples a mel frame becomes (16 kHz, hop 160; x3 at hop 80) with fewer, wider upsampling stages.
"""

from __future__ import annotations

from lean.models.spec import Size


def _dit(heads: int, head_dim: int, audio_heads: int, audio_head_dim: int, channels: int, layers: int) -> dict:
    """LTX2VideoTransformer3DModel as LTX-2.3: the text widths are the streams' widths (no caption projection)."""
    return dict(
        in_channels=channels,
        out_channels=channels,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        cross_attention_dim=heads * head_dim,
        vae_scale_factors=(8, 32, 32),
        pos_embed_max_pos=20,
        base_height=2048,
        base_width=2048,
        gated_attn=True,
        cross_attn_mod=True,
        audio_in_channels=channels,
        audio_out_channels=channels,
        audio_patch_size=1,
        audio_patch_size_t=1,
        audio_num_attention_heads=audio_heads,
        audio_attention_head_dim=audio_head_dim,
        audio_cross_attention_dim=audio_heads * audio_head_dim,
        audio_scale_factor=4,
        audio_pos_embed_max_pos=20,
        audio_sampling_rate=16000,
        audio_hop_length=160,
        audio_gated_attn=True,
        audio_cross_attn_mod=True,
        num_layers=layers,
        activation_fn="gelu-approximate",
        qk_norm="rms_norm_across_heads",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        caption_channels=3840,  # unused without the caption projection (use_prompt_embeddings False)
        attention_bias=True,
        attention_out_bias=True,
        rope_theta=10000.0,
        rope_double_precision=True,
        causal_offset=1,
        timestep_scale_multiplier=1000,
        cross_attn_timestep_scale_multiplier=1000,
        rope_type="split",
        use_prompt_embeddings=False,
        perturbed_attn=True,
    )


def _connectors(text: int, layers: int, video: tuple[int, int], audio: tuple[int, int], depth: int, registers: int):
    """LTX2TextConnectors as LTX-2.3: ``text`` the encoder's width, ``layers`` its hidden states (its layers + 1);
    ``video``/``audio`` (heads, head width) of each connector, ``depth`` blocks each."""
    return dict(
        caption_channels=text,
        text_proj_in_factor=layers,
        video_connector_num_attention_heads=video[0],
        video_connector_attention_head_dim=video[1],
        video_connector_num_layers=depth,
        video_connector_num_learnable_registers=registers,
        video_gated_attn=True,
        audio_connector_num_attention_heads=audio[0],
        audio_connector_attention_head_dim=audio[1],
        audio_connector_num_layers=depth,
        audio_connector_num_learnable_registers=registers,
        audio_gated_attn=True,
        connector_rope_base_seq_len=4096,
        rope_theta=10000.0,
        rope_double_precision=True,
        causal_temporal_positioning=False,
        rope_type="split",
        per_modality_projections=True,
        video_hidden_dim=video[0] * video[1],
        audio_hidden_dim=audio[0] * audio[1],
        proj_bias=True,
    )


def _vae(channels: int, encoder: tuple[int, ...], decoder: tuple[int, ...], layers: tuple[int, ...]) -> dict:
    """AutoencoderKLLTX2Video as LTX-2.3: 4x4 pixel patches, then 8x more spatial and 8x temporal compression."""
    return dict(
        in_channels=3,
        out_channels=3,
        latent_channels=channels,
        block_out_channels=encoder,
        down_block_types=("LTX2VideoDownBlock3D",) * 4,
        decoder_block_out_channels=decoder,
        layers_per_block=layers,
        decoder_layers_per_block=layers,
        spatio_temporal_scaling=(True, True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True, True),
        decoder_inject_noise=(False,) * 5,
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
        upsample_residual=(False, False, False, False),
        upsample_factor=(2, 2, 1, 2),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        resnet_norm_eps=1e-6,
        encoder_causal=True,
        decoder_causal=False,
        encoder_spatial_padding_mode="zeros",
        decoder_spatial_padding_mode="zeros",
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    )


def _audio_vae(base: int, mult: tuple[int, ...], blocks: int, latent: int, mel_bins: int) -> dict:
    """AutoencoderKLLTX2Audio: stereo mel spectrograms, 4x compressed in time and mel bins; ``base`` = ``latent`` x
    ``mel_bins / 4`` (the packed audio token's width, over which its latent statistics are kept)."""
    return dict(
        base_channels=base,
        output_channels=2,
        ch_mult=mult,
        num_res_blocks=blocks,
        attn_resolutions=None,
        in_channels=2,
        resolution=256,
        latent_channels=latent,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=mel_bins,
        double_z=True,
    )


def _upsampler(mel_bins: int, hidden: int, stages: tuple, resnets: tuple) -> dict:
    """One of LTX2VocoderWithBWE's two upsampling networks (the vocoder, and with the ``bwe_`` prefix the bandwidth
    extender): the same keys, each network its own width and (kernel, factor) ``stages``."""
    kernels, dilations = resnets
    return dict(
        in_channels=2 * mel_bins,
        hidden_channels=hidden,
        out_channels=2,
        upsample_kernel_sizes=[k for k, _ in stages],
        upsample_factors=[f for _, f in stages],
        resnet_kernel_sizes=list(kernels),
        resnet_dilations=[list(d) for d in dilations],
        act_fn="snakebeta",
        leaky_relu_negative_slope=0.1,
        antialias=True,
        antialias_ratio=2,
        antialias_kernel_size=12,
        final_act_fn=None,
        final_bias=False,
    )


def _vocoder(mel_bins: int, hidden: int, stages: tuple, bwe_hidden: int, bwe_stages: tuple, resnets: tuple) -> dict:
    """LTX2VocoderWithBWE: a 16 kHz vocoder (upsampling ``stages``: (kernel, factor) pairs whose factors multiply to
    the 160 samples of a mel frame), then a bandwidth extender to 48 kHz (``bwe_stages``: factors multiplying to 240 =
    3 x its hop 80); ``resnets``: (kernel sizes, dilations) of each stage's residual blocks."""
    extender = _upsampler(mel_bins, bwe_hidden, bwe_stages, resnets)
    return dict(
        **_upsampler(mel_bins, hidden, stages, resnets),
        **{f"bwe_{key}": value for key, value in extender.items()},
        filter_length=512,
        hop_length=80,
        window_length=512,
        num_mel_channels=mel_bins,
        input_sampling_rate=16000,
        output_sampling_rate=48000,
    )


def gemma3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, vision: dict):
    """Gemma3Config: the language model (the vocabulary is the tokenizer's) and its SigLIP vision tower ``vision``."""
    text = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
    )
    return dict(text_config=text, vision_config=vision, mm_tokens_per_image=256)


def _siglip(hidden: int, intermediate: int, layers: int, heads: int, image: int) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=image,
        patch_size=14,
    )


_TINY_RESNETS = ((3,), ((1,),))
SIZES = {
    "tiny": Size(  # 32 px, 9 frames -> 2 x 1 x 1 video tokens + 9 audio tokens, each 16 wide
        transformer=_dit(2, 8, 2, 4, channels=16, layers=1),
        vae=_vae(16, (4, 8, 16, 16), (4, 8, 8, 16), (1, 1, 1, 1, 1)),
        text_encoders=dict(text_encoder=gemma3(16, 32, 2, 2, 1, 8, _siglip(8, 16, 1, 2, 28))),
        others=dict(
            audio_vae=_audio_vae(16, (1, 1, 1), 1, latent=4, mel_bins=16),
            connectors=_connectors(16, 3, (2, 8), (2, 4), depth=1, registers=8),
            vocoder=_vocoder(16, 16, ((20, 10), (32, 16)), 8, ((31, 15), (32, 16)), _TINY_RESNETS),
        ),
    ),
    "small": Size(  # 64 px, 17 frames -> 3 x 2 x 2 video tokens + 18 audio tokens, each 32 wide
        transformer=_dit(4, 16, 4, 8, channels=32, layers=2),
        vae=_vae(32, (8, 16, 32, 32), (8, 16, 16, 32), (1, 1, 1, 1, 1)),
        text_encoders=dict(text_encoder=gemma3(32, 64, 2, 4, 2, 8, _siglip(16, 32, 1, 2, 28))),
        others=dict(
            audio_vae=_audio_vae(32, (1, 1, 1), 1, latent=8, mel_bins=16),
            connectors=_connectors(32, 3, (4, 16), (4, 8), depth=1, registers=8),
            vocoder=_vocoder(16, 32, ((20, 10), (32, 16)), 16, ((31, 15), (32, 16)), _TINY_RESNETS),
        ),
    ),
    "full": Size(  # LTX-2.3: the 19.0B transformer, Gemma-3-12B, the video and audio VAEs, the 48 kHz vocoder
        transformer=_dit(32, 128, 32, 64, channels=128, layers=48),
        vae=_vae(128, (256, 512, 1024, 1024), (256, 512, 512, 1024), (4, 6, 4, 2, 2)),
        text_encoders=dict(text_encoder=gemma3(3840, 15360, 48, 16, 8, 256, _siglip(1152, 4304, 27, 16, 896))),
        others=dict(
            audio_vae=_audio_vae(128, (1, 2, 4), 2, latent=8, mel_bins=64),
            connectors=_connectors(3840, 49, (32, 128), (32, 64), depth=8, registers=128),
            vocoder=_vocoder(
                64,
                1536,
                ((11, 5), (4, 2), (4, 2), (4, 2), (4, 2), (4, 2)),
                512,
                ((12, 6), (11, 5), (4, 2), (4, 2), (4, 2)),
                ((3, 7, 11), ((1, 3, 5),) * 3),
            ),
        ),
    ),
}
