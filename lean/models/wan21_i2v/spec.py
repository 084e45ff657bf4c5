"""Wan2.1 image-to-video's :class:`~lean.models.spec.FamilySpec` (Wan2.1-I2V-14B-480P): Wan2.1's (UMT5, the VAE, the
LoRA targets, Ulysses sequence parallelism) with a CLIP vision encoder and its image processor, a 36-channel
transformer that reads the image's CLIP states (``sizes.py``), and the runtime :class:`WanI2V` (``model.py``) that
conditions every sample on its prompt's image."""

from __future__ import annotations

import dataclasses

from lean.models.spec import Component, Processor
from lean.models.wan.spec import SPEC as WAN
from lean.models.wan21_i2v.model import WanI2V
from lean.models.wan21_i2v.sizes import IMAGE_PROCESSOR, SIZES

SPEC = dataclasses.replace(
    WAN,
    display_name="Wan2.1-I2V",
    pipeline="WanImageToVideoPipeline",
    # the pipeline's image_encoder (CLIPVisionModel, pipeline_wan_i2v.py's annotation; diffusers' conversion saves the
    # WithProjection class, whose hidden states are the same) beside Wan's components
    components={**WAN.components, "image_encoder": Component("transformers", "CLIPVisionModel", "CLIPVisionConfig")},
    processors={"image_processor": Processor("CLIPImageProcessor", "CLIPImageProcessor", IMAGE_PROCESSOR)},
    # huggingface/diffusers@7d56827 scripts/convert_wan_to_diffusers.py builds every I2V folder but FLF2V's with
    # UniPCMultistepScheduler(flow_prediction, use_flow_sigmas, flow_shift=3.0), Wan2.1's 480P sampling shift
    scheduler=WAN.scheduler,
    sizes=SIZES,
    runtime=WanI2V,
    reference_images=True,  # every prompt carries its conditioning image (the pipeline's image=)
)
