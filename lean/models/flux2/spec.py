"""FLUX.2 [dev]'s :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.flux2.model import Flux2
from lean.models.flux2.schedule import empirical_mu
from lean.models.flux2.sizes import SIZES
from lean.models.flux2.text import CHAT_TEMPLATE
from lean.models.spec import BATCH_NORM, Component, FamilySpec, VaeConvention

# Flow-Factory's default LoRA targets for FLUX.2 and FLUX.2 [klein] (X-GenGroup/Flow-Factory,
# src/flow_factory/models/flux/flux2.py and flux2_klein.py, ``default_target_modules``, suffix-matched by peft):
#   attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out}, ff.{linear_in,linear_out},
#   ff_context.{linear_in,linear_out}, attn.to_qkv_mlp_proj (the single blocks' fused q, k, v + MLP input).
# The single blocks' output projection is ``attn.to_out`` (no ".0"), which no entry matches: it stays frozen.
# lean splits that set: the attention projections here (the fused single-block one included: it is their q, k, v),
# the double blocks' MLPs under model.lora_ffn; Flow-Factory's default is both (the presets set lora_ffn: true).
ATTN = (
    r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|single_transformer_blocks\.\d+\.attn\.to_qkv_mlp_proj"
)
FFN = r"transformer_blocks\.\d+\.(ff|ff_context)\.(linear_in|linear_out)"

# FLUX.2-dev's scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler, dynamic shifting, exponential); the
# pipelines pass mu = compute_empirical_mu(image_seq_len, num_steps) (mu_rule), so base/max shift are unused
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}

SPEC = FamilySpec(
    display_name="FLUX.2",
    pipeline="Flux2Pipeline",
    components={
        "transformer": Component("diffusers", "Flux2Transformer2DModel"),
        "vae": Component("diffusers", "AutoencoderKLFlux2"),
        "text_encoder": Component("transformers", "Mistral3ForConditionalGeneration", "Mistral3Config"),
    },
    tokenizers={"text_encoder": "tokenizer"},
    t5_tokenizer="tokenizer",  # the one tokenizer (Mistral's); its length caps max_sequence_length
    vae=VaeConvention(BATCH_NORM),
    packed_latents=True,
    scheduler=SCHEDULER,
    sizes=SIZES,
    lora_attention=ATTN,
    lora_ffn=FFN,
    runtime=Flux2,
    block_lists=("transformer_blocks", "single_transformer_blocks"),  # 8 double-stream, then 48 single-stream
    guidance_embed=True,  # FLUX.2 [dev] is guidance-distilled: Flux2Pipeline's guidance_scale (4.0) is an embedding
    sequence_parallel=False,  # lean.models.flux2.model.NO_SEQUENCE_PARALLEL says why
    reference_images=True,  # the pipeline's image=: edits (lean.models.flux2.model), one reference per prompt
    reference_optional=True,  # ... or none: the same weights generate from text alone
    min_reference_side=64,  # Flux2ImageProcessor.check_image_input(min_side_length=64)
    mu_rule=empirical_mu,
    chat_template=CHAT_TEMPLATE,
    block_counts=("num_layers", "num_single_layers"),  # double-stream blocks, then single-stream ones
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
