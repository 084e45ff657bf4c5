"""FLUX.2 [klein]'s :class:`~lean.models.spec.FamilySpec`: FLUX.2's, with Flux2KleinPipeline's Qwen3 text encoder and
no distilled-guidance embedding (CFG is ``sample.cfg``)."""

from __future__ import annotations

from lean.models.flux2.schedule import empirical_mu
from lean.models.flux2.spec import ATTN, FFN, SCHEDULER
from lean.models.flux2.text import CHAT_TEMPLATE
from lean.models.flux2_klein.model import Flux2Klein
from lean.models.flux2_klein.sizes import SIZES
from lean.models.spec import BATCH_NORM, Component, FamilySpec, VaeConvention

SPEC = FamilySpec(
    display_name="FLUX.2 [klein]",
    pipeline="Flux2KleinPipeline",
    components={
        "transformer": Component("diffusers", "Flux2Transformer2DModel"),
        "vae": Component("diffusers", "AutoencoderKLFlux2"),
        "text_encoder": Component("transformers", "Qwen3ForCausalLM", "Qwen3Config"),
    },
    tokenizers={"text_encoder": "tokenizer"},  # Qwen2TokenizerFast as published
    t5_tokenizer="tokenizer",
    vae=VaeConvention(BATCH_NORM),
    packed_latents=True,
    scheduler=SCHEDULER,  # FLUX.2-klein-9B's scheduler_config.json is FLUX.2-dev's; the pipeline's mu is empirical too
    sizes=SIZES,
    lora_attention=ATTN,  # Flow-Factory's FLUX.2 [klein] targets are its FLUX.2 ones (lean.models.flux2.spec)
    lora_ffn=FFN,
    runtime=Flux2Klein,
    block_lists=("transformer_blocks", "single_transformer_blocks"),  # 8 double-stream, then 24 single-stream
    guidance_embed=False,  # guidance_embeds=False: Flux2KleinPipeline guides with true CFG (or not at all, distilled)
    sequence_parallel=False,  # lean.models.flux2.model.NO_SEQUENCE_PARALLEL says why
    reference_images=True,  # the pipeline's image=: edits (lean.models.flux2.model), one reference per prompt
    reference_optional=True,  # ... or none: the same weights generate from text alone
    min_reference_side=64,  # Flux2ImageProcessor.check_image_input(min_side_length=64)
    mu_rule=empirical_mu,
    chat_template=CHAT_TEMPLATE,
    block_counts=("num_layers", "num_single_layers"),  # double-stream blocks, then single-stream ones
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
