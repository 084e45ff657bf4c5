"""Wan2.1 text-to-video's :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.spec import MEAN_STD, Component, FamilySpec, VaeConvention
from lean.models.wan.model import Wan
from lean.models.wan.sizes import SIZES

# Self-attention (attn1) and cross-attention (attn2; its to_k/to_v are the text-context projections; add_k/v_proj
# exist only in the image-conditioned variants).
_ATTN = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)"
_FFN = r"blocks\.\d+\.ffn\.net\.(0\.proj|2)"

SPEC = FamilySpec(
    display_name="Wan",
    pipeline="WanPipeline",
    components={
        "transformer": Component("diffusers", "WanTransformer3DModel"),
        "vae": Component("diffusers", "AutoencoderKLWan"),
        "text_encoder": Component("transformers", "UMT5EncoderModel", "UMT5Config"),
    },
    tokenizers={"text_encoder": "tokenizer"},
    t5_tokenizer="tokenizer",
    vae=VaeConvention(MEAN_STD, temporal_compression=4),  # the causal 3D VAE: videos have 4k + 1 frames
    packed_latents=False,
    # Wan2.1-T2V-1.3B-Diffusers' scheduler/scheduler_config.json: UniPCMultistepScheduler(use_flow_sigmas, flow_shift=3)
    scheduler={
        "_class_name": "UniPCMultistepScheduler",
        "flow_shift": 3.0,
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
    },
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=Wan,
    block_lists=("blocks",),
    sequence_parallel=True,
    non_square=True,  # model.width: Wan's own sizes are 480 x 832 and 720 x 1280
    keeps_float32=True,  # WanTransformer3DModel._keep_in_fp32_modules: half-precision runs keep some modules float32
)
