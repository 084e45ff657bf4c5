"""Wan2.2-I2V-A14B's :class:`~lean.models.spec.FamilySpec`: Wan2.1-I2V's runtime (``lean.models.wan21_i2v``: the
conditioning image's latent and mask beside the noisy latent) on two experts, ``transformer`` (high noise) and
``transformer_2`` (low noise), switched at the published boundary; no image encoder (its transformers read no CLIP
states)."""

from __future__ import annotations

import dataclasses

from lean.models.wan.spec import SPEC as WAN
from lean.models.wan21_i2v.spec import SPEC as WAN21_I2V
from lean.models.wan22_i2v.sizes import SIZES

# WanImageToVideoPipeline runs `transformer` at t >= boundary_ratio * 1000, `transformer_2` below; on its flow-sigma
# UniPC timesteps t = 1000 sigma, so the boundary sigma is boundary_ratio. huggingface/diffusers@7d56827
# scripts/convert_wan_to_diffusers.py builds the Wan2.2-I2V folder with boundary_ratio=0.9 (the original code's
# boundary 0.900: Wan-Video/Wan2.2 wan/configs/wan_i2v_A14B.py, read at the fork HighDoping/Wan2.2@d6feb22, line 37).
BOUNDARY_RATIO = 0.9

SPEC = dataclasses.replace(
    WAN21_I2V,
    display_name="Wan2.2-I2V",
    components={**WAN.components, "transformer_2": WAN.components["transformer"]},
    processors={},
    denoiser_folders=("transformer", "transformer_2"),
    boundary=BOUNDARY_RATIO,
    # the same script's UniPCMultistepScheduler(flow_prediction, use_flow_sigmas, flow_shift=3.0) for Wan2.2-I2V (the
    # original code samples I2V-A14B at sample_shift 5.0, wan_i2v_A14B.py line 35: pass sample.shift to match it)
    scheduler=WAN.scheduler,
    # One CFG scale per expert: sample.guidance_scale (high noise) and sample.guidance_scale_2 (low noise, the
    # pipeline's guidance_scale_2; null: the same scale)
    sizes=SIZES,
)
