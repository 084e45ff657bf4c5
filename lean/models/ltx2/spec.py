"""LTX-2's :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.ltx2.model import LTX2
from lean.models.ltx2.sizes import SIZES
from lean.models.spec import MEAN_STD, Component, FamilySpec, VaeConvention

# Flow-Factory's default LoRA targets for LTX-2 (X-GenGroup/Flow-Factory at a0b2bc5,
# src/flow_factory/models/ltx2/ltx2_t2av.py:175-218 ``default_target_modules``, suffix-matched by peft), 28 linear
# layers a block: the q/k/v/out projections of the video and audio self-attention (attn1, audio_attn1), their text
# cross-attention (attn2, audio_attn2) and the cross-modal attention (audio_to_video_attn, video_to_audio_attn), and
# the two layers of each stream's MLP (ff, audio_ff). lean splits that set: the attention projections here, the MLPs
# under model.lora_ffn (the preset sets both, Flow-Factory's default).
_BLOCK = r"transformer_blocks\.\d+\."
_STREAMS = r"(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
_ATTN = _BLOCK + _STREAMS + r"\.(to_q|to_k|to_v|to_out\.0)"
_FFN = _BLOCK + r"(ff|audio_ff)\.net\.(0\.proj|2)"

SPEC = FamilySpec(
    display_name="LTX-2",
    pipeline="LTX2Pipeline",
    components={  # LTX2Pipeline's modules (pipeline_ltx2.py:241-262); the connectors and vocoder live in its module
        "transformer": Component("diffusers", "LTX2VideoTransformer3DModel"),
        "vae": Component("diffusers", "AutoencoderKLLTX2Video"),
        "audio_vae": Component("diffusers", "AutoencoderKLLTX2Audio"),
        # Gemma-3-12B; the pipeline reads every hidden state (pipeline_ltx2.py:350-355)
        "text_encoder": Component("transformers", "Gemma3ForConditionalGeneration", "Gemma3Config"),
        "connectors": Component("diffusers.pipelines.ltx2", "LTX2TextConnectors"),
        "vocoder": Component("diffusers.pipelines.ltx2", "LTX2VocoderWithBWE"),  # LTX-2.3's (LTX-2.0's is LTX2Vocoder)
    },
    tokenizers={"text_encoder": "tokenizer"},  # GemmaTokenizer in the published folder
    t5_tokenizer="tokenizer",  # the one tokenizer: its length caps the pipeline's max_sequence_length (1024)
    vae=VaeConvention(MEAN_STD, temporal_compression=8),  # per-channel statistics; videos have 8k + 1 frames
    packed_latents=True,  # the policy's x is the pipeline's packed tokens, video then audio (lean.models.ltx2.model)
    # The published scheduler_config.json is not among the sources read; these are the values LTX2Pipeline falls back
    # to (pipeline_ltx2.py:1346-1352: mu from the video tokens, base/max image tokens 1024/4096, shift 0.95/2.05) with
    # the dynamic shifting its mu needs, on the grid linspace(1, 1/n, n) (:1345): lean's "uniform". A model.pretrained
    # folder's own scheduler_config.json is read instead (lean.models.scheduler.scheduler_config).
    scheduler={
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "use_dynamic_shifting": True,
        "base_image_seq_len": 1024,
        "max_image_seq_len": 4096,
        "base_shift": 0.95,
        "max_shift": 2.05,
        "time_shift_type": "exponential",
    },
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=LTX2,
    block_lists=("transformer_blocks",),
    sequence_parallel=True,  # the video tokens split, the audio stream replicated (lean.models.ltx2.sequence_parallel)
    non_square=True,  # model.width: LTX-2's own size is 512 x 768
    takes_sigmas=True,  # LTX2Pipeline.__call__ takes sigmas= (:943)
    audio=True,  # the audio VAE and vocoder decode the soundtrack for the rewards that read it
    num_frames=9,  # lean's default 5 frames are not 8k + 1
)
