"""FLUX.1 Kontext [dev]'s :class:`~lean.models.spec.FamilySpec`: FLUX.1-dev's components, sizes and scheduler (the
transformer is FLUX.1-dev's architecture, black-forest-labs/FLUX.1-Kontext-dev transformer/config.json), edits
conditioned on a reference image."""

from __future__ import annotations

from lean.models.flux.sizes import SIZES
from lean.models.flux.spec import _ATTN
from lean.models.flux.spec import SPEC as FLUX
from lean.models.kontext.model import Kontext
from lean.models.spec import FamilySpec

# FlowGRPO's Kontext targets (scripts/train_flux_kontext.py lines 411-425, yifan123/flow_grpo 9745241 read through
# its zhtmike mirror; peft suffix matches): the joint attention of every block (as FLUX's), the double-stream blocks'
# MLPs and the single-stream blocks' proj_mlp, but not their proj_out (which FLUX.1's lora_ffn adds).
_FFN = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)|single_transformer_blocks\.\d+\.proj_mlp"

SPEC = FamilySpec(
    display_name="FLUX.1 Kontext",
    pipeline="FluxKontextPipeline",
    components=FLUX.components,
    tokenizers=FLUX.tokenizers,
    t5_tokenizer=FLUX.t5_tokenizer,
    vae=FLUX.vae,
    packed_latents=True,
    scheduler=FLUX.scheduler,  # FLUX.1-Kontext-dev's scheduler_config.json is FLUX.1-dev's
    sizes=SIZES,
    lora_attention=_ATTN,
    lora_ffn=_FFN,
    runtime=Kontext,
    block_lists=FLUX.block_lists,
    guidance_embed=True,  # guidance-distilled, as FLUX.1-dev (FluxKontextPipeline's guidance_scale=3.5)
    sequence_parallel=True,  # FLUX.1's Ulysses attention: the reference tokens split with the noisy ones
    reference_images=True,
    block_counts=FLUX.block_counts,
    takes_sigmas=True,  # its pipeline call takes lean's sigma grid
)
