"""Stable Diffusion 3 / 3.5's :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.sd3.model import SD3
from lean.models.sd3.sizes import SIZES
from lean.models.spec import SCALE_SHIFT, Component, FamilySpec, VaeConvention

# FlowGRPO's SD3 targets ("attn.to_q", ... matched as module-name suffixes) reach the joint attention `attn` of every
# block, not the SD3.5 dual-attention `attn2`; the regex below selects exactly those modules.
_ATTN = r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_FFN = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)"

SPEC = FamilySpec(
    display_name="SD3",
    pipeline="StableDiffusion3Pipeline",
    components={
        "transformer": Component("diffusers", "SD3Transformer2DModel"),
        "vae": Component("diffusers", "AutoencoderKL"),
        "text_encoder": Component("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),  # CLIP ViT-L/14
        "text_encoder_2": Component("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),  # OpenCLIP bigG
        "text_encoder_3": Component("transformers", "T5EncoderModel", "T5Config"),  # T5 v1.1 XXL encoder
    },
    tokenizers={"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"},
    t5_tokenizer="tokenizer_3",
    vae=VaeConvention(SCALE_SHIFT),
    packed_latents=False,
    scheduler={"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0},  # SD3.5-M's scheduler_config.json
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=SD3,
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
