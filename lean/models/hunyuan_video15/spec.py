"""HunyuanVideo-1.5 text-to-video's :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.hunyuan_video15.model import CHAT_MARKERS, CHAT_TEMPLATE, HunyuanVideo15
from lean.models.hunyuan_video15.sizes import SIZES
from lean.models.spec import SCALE_SHIFT, Component, FamilySpec, VaeConvention

# No GRPO recipe publishes HunyuanVideo-1.5 targets yet: the dual-stream blocks' joint attention (video projections
# to_q/k/v/out, text projections add_q/k/v_proj, to_add_out), as FlowGRPO adapts FLUX's and Qwen-Image's; the MLPs of
# both streams are model.lora_ffn. The token refiner's attention (context_embedder.token_refiner) is not adapted.
_ATTN = r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_FFN = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)"

SPEC = FamilySpec(
    display_name="HunyuanVideo-1.5",
    pipeline="HunyuanVideo15Pipeline",
    components={  # the pipeline's folders (its scheduler and guider aside)
        "transformer": Component("diffusers", "HunyuanVideo15Transformer3DModel"),
        "vae": Component("diffusers", "AutoencoderKLHunyuanVideo15"),
        # Qwen2.5-VL-7B-Instruct's language model: hidden_states[-3] of the chat-formatted prompt
        "text_encoder": Component("transformers", "Qwen2_5_VLTextModel", "Qwen2_5_VLTextConfig"),
        # byT5-small with Glyph-SDXL-v2's weights: the prompt's quoted text
        "text_encoder_2": Component("transformers", "T5EncoderModel", "T5Config"),
    },
    tokenizers={"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"},  # Qwen2Tokenizer, ByT5Tokenizer
    # the Qwen2.5-VL tokenizer: model.text_max_length caps a prompt's tokens as the pipeline's tokenizer_max_length
    # (1000) does; the glyph text keeps the pipeline's 256 byT5 tokens
    t5_tokenizer="tokenizer",
    vae=VaeConvention(SCALE_SHIFT, temporal_compression=4),  # z = z_vae * scaling_factor; videos have 4k + 1 frames
    packed_latents=False,
    # hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v's scheduler: diffusers' conversion script saves
    # FlowMatchEulerDiscreteScheduler(shift=5.0) for 480p_t2v (SCHEDULER_CONFIGS; 720p_t2v: 9.0), static. The pipeline
    # steps on sigmas = linspace(1, 0, n + 1)[:-1], shifted: lean's "uniform" grid (sample.sigma_grid=uniform). Its
    # guider is ClassifierFreeGuidance(guidance_scale=6.0) (GUIDANCE_CONFIGS): sample.guidance_scale with sample.cfg.
    scheduler={
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": 5.0,
        "use_dynamic_shifting": False,
        "shift_terminal": None,
        "invert_sigmas": False,
        "stochastic_sampling": False,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "time_shift_type": "exponential",
    },
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=HunyuanVideo15,
    block_lists=("transformer_blocks",),  # 54 dual-stream blocks
    # No sequence parallelism yet: the transformer reorders each row's text tokens and masks the padding in its joint
    # attention, which lean's Ulysses attention processors do not carry.
    sequence_parallel=False,
    non_square=True,  # model.width: the pipeline draws frames of its target area at the requested aspect ratio
    chat_template=CHAT_TEMPLATE,  # the pipeline formats prompts with tokenizer.apply_chat_template
    special_tokens=CHAT_MARKERS,
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
