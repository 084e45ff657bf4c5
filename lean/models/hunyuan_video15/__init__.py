"""HunyuanVideo-1.5 text-to-video (Tencent Hunyuan): :data:`SPEC` (``spec.py``), the runtime :class:`HunyuanVideo15`
(``model.py``: video latent geometry, the Qwen2.5-VL and byT5 conditioning, the transformer call with T2V's zero
condition channels) and the size table (``sizes.py``). No sequence parallelism yet (see ``spec.py``)."""

from lean.models.hunyuan_video15.model import HunyuanVideo15
from lean.models.hunyuan_video15.spec import SPEC

__all__ = ["SPEC", "HunyuanVideo15"]
