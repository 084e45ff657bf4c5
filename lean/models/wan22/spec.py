"""Wan2.2-T2V-A14B's :class:`~lean.models.spec.FamilySpec`: Wan2.1's (runtime, VAE, UMT5, LoRA targets) with two
denoisers, ``transformer`` (high noise) and ``transformer_2`` (low noise)."""

from __future__ import annotations

import dataclasses

from lean.models.wan.spec import SPEC as WAN
from lean.models.wan22.sizes import SIZES

# WanPipeline runs `transformer` at timesteps t >= boundary_ratio * num_train_timesteps, `transformer_2` below; its
# flow-sigma UniPC timesteps are t = 1000 sigma, so the boundary sigma is boundary_ratio itself.
BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B-Diffusers' model_index.json (from memory; the original code's boundary 0.875)

SPEC = dataclasses.replace(
    WAN,
    display_name="Wan2.2",
    components={**WAN.components, "transformer_2": WAN.components["transformer"]},
    denoiser_folders=("transformer", "transformer_2"),
    boundary=BOUNDARY_RATIO,
    # From memory: Wan2.2-T2V-A14B-Diffusers' scheduler/scheduler_config.json, UniPC with flow sigmas at flow_shift
    # 3.0 (the original Wan2.2 code samples T2V-A14B at shift 12.0: pass sample.shift to match it).
    scheduler={
        "_class_name": "UniPCMultistepScheduler",
        "flow_shift": 3.0,
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
    },
    # One CFG scale for both experts: the published recipe's guidance_scale_2 (3.0 low noise vs 4.0 high noise) has no
    # lean key; lean's samples equal WanPipeline's with guidance_scale_2=None (which then uses guidance_scale).
    sizes=SIZES,
)
