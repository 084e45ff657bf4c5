"""The registered families and LoRA initialisations: :data:`FAMILIES` maps each family's name to the ``SPEC`` of its
package ``lean/models/<family>/`` (:func:`family_spec`); :data:`LORA_INITS` maps ``model.lora_init`` to peft's
``init_lora_weights``. Adding a family is one new package plus one :data:`FAMILIES` line."""

from __future__ import annotations

from lean.config.registry import Registry
from lean.models.flux import SPEC as FLUX
from lean.models.flux2 import SPEC as FLUX2
from lean.models.flux2_klein import SPEC as FLUX2_KLEIN
from lean.models.hunyuan_video15 import SPEC as HUNYUAN_VIDEO15
from lean.models.kontext import SPEC as KONTEXT
from lean.models.ltx2 import SPEC as LTX2
from lean.models.qwen_image import SPEC as QWEN_IMAGE
from lean.models.qwen_image_edit import SPEC as QWEN_IMAGE_EDIT
from lean.models.sd3 import SPEC as SD3
from lean.models.spec import FamilySpec
from lean.models.wan import SPEC as WAN
from lean.models.wan21_i2v import SPEC as WAN21_I2V
from lean.models.wan22 import SPEC as WAN22
from lean.models.wan22_i2v import SPEC as WAN22_I2V
from lean.models.wan22_ti2v import SPEC as WAN22_TI2V
from lean.models.z_image import SPEC as Z_IMAGE

FAMILIES: Registry[FamilySpec] = Registry(
    "model family",
    [  # name -> spec
        ("flux", FLUX),  # the default
        ("wan", WAN),
        ("wan22", WAN22),  # Wan2.2-T2V-A14B: two experts split at sigma 0.875
        ("wan22_ti2v", WAN22_TI2V),  # Wan2.2-TI2V-5B, text-to-video: the 48-channel Wan2.2 VAE
        ("sd3", SD3),
        ("qwen_image", QWEN_IMAGE),
        ("flux2", FLUX2),  # FLUX.2 [dev]
        ("flux2_klein", FLUX2_KLEIN),  # FLUX.2 [klein] 9B
        ("kontext", KONTEXT),
        ("qwen_image_edit", QWEN_IMAGE_EDIT),
        ("hunyuan_video15", HUNYUAN_VIDEO15),  # HunyuanVideo-1.5 480p T2V: Qwen2.5-VL + byT5 glyphs
        ("z_image", Z_IMAGE),  # Z-Image(-Turbo) 6B: Qwen3-4B, FLUX.1's VAE
        ("wan21_i2v", WAN21_I2V),  # Wan2.1-I2V-14B-480P: the image's latent beside x, its CLIP states beside the text
        ("wan22_i2v", WAN22_I2V),  # Wan2.2-I2V-A14B: two experts split at sigma 0.9, the image's latent beside x
        ("ltx2", LTX2),  # LTX-2.3 text to video with audio: Gemma-3-12B, the video and audio VAEs, a vocoder
    ],
)
LORA_INITS: Registry[str | bool] = Registry(
    "LoRA initialisation",
    [  # name -> peft's init_lora_weights
        ("kaiming", True),  # A kaiming-uniform, B = 0 (peft's default; DanceGRPO)
        ("gaussian", "gaussian"),  # A ~ N(0, (1/r)^2), B = 0 (FlowGRPO's scripts, every Flow-Factory LoRA)
    ],
)


def family_spec(family: str) -> FamilySpec:
    """The spec of a registered family (a ``KeyError`` naming the known ones otherwise)."""
    return FAMILIES.get_or_raise(family)
