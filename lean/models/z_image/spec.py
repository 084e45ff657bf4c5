"""Z-Image's :class:`~lean.models.spec.FamilySpec`."""

from __future__ import annotations

from lean.models.spec import SCALE_SHIFT, Component, FamilySpec, VaeConvention
from lean.models.z_image.model import CHAT_TEMPLATE, ZImage
from lean.models.z_image.sizes import SIZES

# Flow-Factory's default LoRA targets for Z-Image (X-GenGroup/Flow-Factory at a0b2bc5,
# src/flow_factory/models/z_image/z_image.py:69-75 ``default_target_modules``, suffix-matched by peft):
#   attention.{to_q,to_k,to_v,to_out.0}, feed_forward.{w1,w2,w3}
# which reach every block of ZImageTransformer2DModel: the noise refiner, the context refiner and the main layers.
# lean splits that set: the attention projections here, the SwiGLU MLPs under model.lora_ffn (Flow-Factory's default
# is both: the preset sets lora_ffn: true).
_BLOCKS = r"(noise_refiner|context_refiner|layers)\.\d+"
_ATTN = _BLOCKS + r"\.attention\.(to_q|to_k|to_v|to_out\.0)"
_FFN = _BLOCKS + r"\.feed_forward\.(w1|w2|w3)"

SPEC = FamilySpec(
    display_name="Z-Image",
    pipeline="ZImagePipeline",
    components={  # Tongyi-MAI/Z-Image-Turbo's model_index.json (its scheduler aside; written from memory)
        "transformer": Component("diffusers", "ZImageTransformer2DModel"),
        "vae": Component("diffusers", "AutoencoderKL"),  # FLUX.1's
        # Qwen3-4B's base model; the pipeline reads hidden_states[-2] (pipeline_z_image.py:240-244)
        "text_encoder": Component("transformers", "Qwen3Model", "Qwen3Config"),
    },
    tokenizers={"text_encoder": "tokenizer"},  # Qwen2Tokenizer in the published folder
    t5_tokenizer="tokenizer",  # the one tokenizer: its length caps the pipeline's max_sequence_length (512)
    vae=VaeConvention(SCALE_SHIFT),  # (z - shift_factor) * scaling_factor; images: no temporal_compression
    packed_latents=False,  # the transformer patchifies the VAE latent itself
    # Tongyi-MAI/Z-Image-Turbo's scheduler/scheduler_config.json (from memory): a static shift of 3, no dynamic
    # shifting. ZImagePipeline computes mu = calculate_shift(image tokens) and passes it (pipeline_z_image.py:474-490),
    # but FlowMatchEulerDiscreteScheduler uses mu only with use_dynamic_shifting; its sigmas are
    # linspace(1, 1/n, n) (get_default_z_image_sigmas, :137-138), shifted by 3, then 0: lean's "uniform" grid.
    scheduler={
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": False,
    },
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=ZImage,
    block_lists=("noise_refiner", "context_refiner", "layers"),  # in forward order (transformer_z_image.py:1001-1062)
    # the main layers only: the refiners see the image or the caption tokens alone, so the tracked-step floor
    # (lean.models.footprint) counts the blocks that see the whole joint sequence
    block_counts=("n_layers",),
    # No sequence parallelism yet: the transformer takes lists of rows of their own lengths (ZImage.shard_sequence).
    sequence_parallel=False,
    # CFG: ZImagePipeline guides with pos + g (pos - neg) against negative_prompt ("" by default) when g > 0
    # (:541-551); that is lean's v_u + s (v_c - v_u) at s = 1 + g. Z-Image-Turbo is distilled to run without it (g = 0)
    guidance_from_conditional=True,  # lean export / lean sample hand the pipeline g = s - 1 (0 without CFG)
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid (:305 sigmas=)
    chat_template=CHAT_TEMPLATE,  # a random build's tokenizer (lean.models.z_image.model)
)
