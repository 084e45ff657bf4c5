"""FLUX.1's :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.flux.model import Flux
from lean.models.flux.sizes import SIZES
from lean.models.spec import SCALE_SHIFT, Component, FamilySpec, VaeConvention

# The double-stream blocks' joint attention, and the single-stream blocks' (which fuse the MLP into proj_mlp (in)
# and proj_out (attention + MLP out)).
_ATTN = (
    r"(single_)?transformer_blocks\.\d+\.attn\."
    r"(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
)
_FFN = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)|single_transformer_blocks\.\d+\.(proj_mlp|proj_out)"

SPEC = FamilySpec(
    display_name="FLUX",
    pipeline="FluxPipeline",
    components={
        "transformer": Component("diffusers", "FluxTransformer2DModel"),
        "vae": Component("diffusers", "AutoencoderKL"),
        "text_encoder": Component("transformers", "CLIPTextModel", "CLIPTextConfig"),  # pooled vector
        "text_encoder_2": Component("transformers", "T5EncoderModel", "T5Config"),  # token embeddings
    },
    tokenizers={"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"},
    t5_tokenizer="tokenizer_2",
    vae=VaeConvention(SCALE_SHIFT),
    packed_latents=True,
    # FLUX.1-dev's scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler): FluxPipeline shifts by e^mu, mu
    # linear in the image token count (lean.models.scheduler.time_shift); the static shift is unused
    scheduler={
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    },
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=Flux,
    block_lists=("transformer_blocks", "single_transformer_blocks"),  # 19 double-stream, then 38 single-stream
    guidance_embed=True,  # FLUX.1-dev is guidance-distilled: it takes the guidance value as an embedding
    sequence_parallel=True,
    block_counts=("num_layers", "num_single_layers"),  # double-stream blocks, then single-stream ones
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
