"""The ``model`` section: which family, at which size and precision, and what is trained (registered with
``lean.config.sections``; a family's own options would be a group registered under ``model.<name>``)."""

from __future__ import annotations

from dataclasses import dataclass

from lean.config.checks import ConfigError, check_positive, choice, choices
from lean.config.dtypes import DTYPES, MODEL_DTYPE, or_model
from lean.config.sections import register_options


@register_options("model")
@dataclass
class ModelConfig:
    """The policy: which diffusers transformer, at which size and precision, and what is trained."""

    family: str = choice("model family")
    """Model family: a name of ``lean.models.FAMILIES`` (image: FLUX, SD3; video: Wan)."""
    size: str = "tiny"
    """Architecture size, one of the family's sizes: tiny (tests), small (CPU bench), full (published)."""
    pretrained: str | None = None
    """A local diffusers folder loaded with ``from_pretrained``; None: random weights from the size's config."""
    resolution: int = 32
    """Image side in pixels (a multiple of 16)."""
    width: int | None = None
    """Frame width in pixels where it differs from the height (``model.resolution`` is then the height: Wan's 480p is
    ``resolution: 480``, ``width: 832``); families with ``FamilySpec.non_square`` only. None: square frames."""
    num_frames: int = 5
    """Video frames (video families only); the family's VAE fixes which counts exist."""
    dtype: str = choice("dtype", DTYPES.default)
    """Precision of the policy: a name of ``lean.config.dtypes.DTYPES``."""
    vae_dtype: str = choice("dtype", MODEL_DTYPE, also=(MODEL_DTYPE,))
    """Precision of the VAE that decodes the samples, at least ``model.dtype``'s: a name of
    ``lean.config.dtypes.DTYPES``, or ``model``. FlowGRPO decodes in float32 (its SD3, FLUX and Wan scripts build the
    VAE in float32); DanceGRPO in bf16."""
    tf32: bool = True
    """float32 runs on a GPU: matmuls and convolutions on TF32 tensor cores (about 7x the plain FP32 rate on an
    H100; 10 mantissa bits per product, float32 accumulation). false: full float32."""
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_ffn: bool = False
    """Also adapt the feed-forward projections (FlowGRPO does for FLUX)."""
    lora_init: str = choice("LoRA initialisation")
    """How the LoRA factors start (B = 0 in both, so the policy starts at the base model): a name of
    ``lean.models.LORA_INITS`` (peft's ``init_lora_weights``)."""
    lora_targets: list[str] | None = None
    """peft ``target_modules``: module-name suffixes to adapt (DanceGRPO: to_q, to_k, to_v, to_out.0). None: the
    family's own set (every attention projection, with ``lora_ffn`` the feed-forward ones too)."""
    full_finetune: bool = False
    """Train every transformer weight instead of a LoRA adapter (the reference becomes a frozen copy)."""
    gradient_checkpointing: bool = False
    """Activation checkpointing of the transformer blocks (diffusers' own, ``enable_gradient_checkpointing``): a
    tracked forward keeps each block's input only and recomputes the block in the backward. Less memory for every
    schedule's tracked steps (Recompute's update, Retain's kept graphs, Reweight's per-step backward), one more
    forward of the trained steps in time."""
    text_max_length: int = 16
    """T5 / UMT5 tokens per prompt."""
    edit: bool | None = None
    """Image editing: every prompt carries a reference image (a ``.jsonl`` prompt file whose lines have an ``image``)
    that conditions its samples. None: as the family and the prompts say (the editing families Kontext and
    Qwen-Image-Edit always edit; FLUX.2 and FLUX.2 [klein], whose pipelines take an optional ``image=``, edit when the
    prompts carry images); true: edit (without a prompt file, lean's bundled recolouring set); false: text to image."""
    reference_resolution: int | None = None
    """The square side in pixels an edit's reference image is resized to (once, Lanczos) and encoded at (Flow-Factory's
    ``condition_image_size``; a multiple of 16); not for Qwen-Image-Edit, whose pipeline fixes its own (1024 at the
    published size). None: that family's own side, else ``model.resolution`` (FlowGRPO resizes references to the
    run's resolution, bicubic)."""

    def validate(self) -> None:
        """The fields alone; what depends on the family is ``lean.models.check_config``'s."""
        choices(self, "model")
        check_positive("model.resolution", self.resolution)
        if self.resolution % 16:
            raise ConfigError("model.resolution", self.resolution, "must be a multiple of 16")
        if self.width is not None and (self.width <= 0 or self.width % 16):
            raise ConfigError("model.width", self.width, "must be a positive multiple of 16 (or null: square frames)")
        for key in ("num_frames", "lora_rank", "lora_alpha", "text_max_length"):
            check_positive(f"model.{key}", getattr(self, key))
        if self.reference_resolution is not None and (self.reference_resolution <= 0 or self.reference_resolution % 16):
            raise ConfigError(
                "model.reference_resolution", self.reference_resolution, "must be a positive multiple of 16 (or null)"
            )
        if self.lora_targets is not None and (not self.lora_targets or not all(self.lora_targets)):
            raise ConfigError("model.lora_targets", self.lora_targets, "name at least one module (or null)")

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    @property
    def frame_size(self) -> str:
        """``H px`` or ``HxW px``: the samples' size in words."""
        return f"{self.resolution} px" if self.width is None else f"{self.resolution}x{self.width} px"

    def runtime_size(self) -> dict:
        """The family runtime's geometry arguments beyond the resolution: ``width`` when the frames are not square."""
        return {} if self.width is None else {"width": self.width}

    @property
    def torch_vae_dtype(self):
        return or_model(self.vae_dtype, self.torch_dtype)
