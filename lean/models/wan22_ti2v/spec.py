"""Wan2.2-TI2V-5B's :class:`~lean.models.spec.FamilySpec` (text-to-video mode): Wan2.1's (WanPipeline, UMT5, the
LoRA targets, Ulysses sequence parallelism) with the Wan2.2 VAE's 48 latent channels and 16x spatial compression
(``sizes.py``), the timestep per token of WanPipeline's ``expand_timesteps`` (``model.py``) and the published
scheduler's shift.

Published sampling: 704 x 1280 (or 1280 x 704) pixels, 121 frames at 24 fps (Wan-Video/Wan2.2's
wan/configs/wan_ti2v_5B.py: frame_num 121, sample_fps 24). lean renders squares: ``model.resolution=960`` with
``model.num_frames=121`` is the comparable full-size run (a multiple of the 32 px one token covers: 30 x 30 = 900
tokens per latent frame against the published 22 x 40 = 880; 31 latent frames).
"""

from __future__ import annotations

import dataclasses

from lean.models.wan.spec import SPEC as WAN
from lean.models.wan22_ti2v.model import Wan22TI2V
from lean.models.wan22_ti2v.sizes import SIZES

SPEC = dataclasses.replace(
    WAN,
    display_name="Wan2.2-TI2V",
    # Wan-Video/Wan2.2's wan/configs/wan_ti2v_5B.py samples at sample_shift 5.0; Wan2.2-TI2V-5B-Diffusers'
    # scheduler/scheduler_config.json: UniPCMultistepScheduler with flow sigmas at flow_shift 5.0 (from memory).
    scheduler={
        "_class_name": "UniPCMultistepScheduler",
        "flow_shift": 5.0,
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
    },
    sizes=SIZES,
    runtime=Wan22TI2V,
    # model_index.json of Wan2.2-TI2V-5B-Diffusers: WanPipeline gives the transformer one timestep per token
    pipeline_config={"expand_timesteps": True},
)
