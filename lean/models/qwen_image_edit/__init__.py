"""Qwen-Image-Edit (Alibaba Qwen team): Qwen-Image conditioned on a reference image twice, through Qwen2.5-VL's vision
tower in the prompt and as VAE latent tokens beside the noisy ones. :data:`SPEC` (``spec.py``), the runtime
:class:`QwenImageEdit` (``model.py``) and the sizes (``sizes.py``: Qwen-Image's, with the reference's resolution)."""

from lean.models.qwen_image_edit.model import QwenImageEdit
from lean.models.qwen_image_edit.spec import SPEC

__all__ = ["SPEC", "QwenImageEdit"]
