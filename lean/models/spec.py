"""What a model family is: a typed :class:`FamilySpec` (everything lean reads about a family before or without
building it) and the :class:`FamilyRuntime` protocol (everything a built policy calls on it, ``Policy.runtime``).

A family is a package ``lean/models/<family>/`` whose ``SPEC`` is a :class:`FamilySpec`;
``lean.models.registry.FAMILIES`` maps its name to that spec. Every fact about a family is a field of its spec, set in
its folder's ``spec.py``. Config validation reads specs, so a family package imports no diffusers or transformers at
import time: components are named by class name (``model_index.json``'s spelling) and imported when a model is built.
Code outside ``lean/models/`` reads spec fields; it never probes a family for attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from lean.models.sequence_parallel import SequenceParallel
    from lean.models.text import PromptEmbeds

SCALE_SHIFT = "scale_shift"  # z = (z_vae - shift_factor) * scaling_factor, scalars of the VAE config (FLUX, SD3)
MEAN_STD = "mean_std"  # z = (z_vae - latents_mean_c) / latents_std_c per channel (Wan)
BATCH_NORM = "batch_norm"  # z = (patchify_2x2(z_vae) - bn.running_mean) / sqrt(bn.running_var + eps) (FLUX.2)
Normalisation = Literal["scale_shift", "mean_std", "batch_norm"]


class FamilyRuntime(Protocol):
    """A family's runtime object for one resolution / frame count, built by ``FamilySpec.runtime(transformer_config,
    vae_config, resolution, num_frames)`` (``lean.models.build.build_runtime``) and held as ``Policy.runtime``: the
    latent geometry, the text conditioning, the network call and the decode, and how sequence parallelism enters the
    network."""

    noise_shape: tuple[int, ...]  # per-sample Gaussian draw, in the VAE latent layout
    latent_shape: tuple[int, ...]  # per-sample x as the transformer takes it
    image_seq_len: int  # tokens the transformer sees per sample (a dynamically shifting scheduler's input)
    splits_text: bool  # sequence parallelism splits the text tokens too (joint attention), so they must divide

    def noise_to_latents(self, noise: Tensor) -> Tensor:
        """A draw in the VAE latent layout -> the policy's layout (FLUX packs 2x2 patches; others: unchanged)."""
        ...

    def latents_from_vae(self, z: Tensor) -> Tensor:
        """VAE latents -> the policy's normalised latents: the inverse of what :meth:`decode` does before the VAE."""
        ...

    def encode_text(
        self, encoders, tokenizers, prompts: list[str], max_length: int, device: torch.device, images=None
    ) -> PromptEmbeds:
        """The text conditioning of ``prompts``; ``images`` (PIL images, one per prompt, or None) reach the text
        encoder of a family whose encoder sees the reference image (Qwen-Image-Edit's Qwen2.5-VL)."""
        ...

    def encode_reference(self, vae, pixels: Tensor) -> Tensor:
        """Reference images ``[B, 3, H, W]`` in [-1, 1] -> their latent tokens ``[B, R, C]`` in the policy's layout
        (``PromptEmbeds.reference``), which :meth:`forward` appends to the image tokens. Families without
        ``reference_images`` raise."""
        ...

    def forward(
        self, transformer, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None
    ) -> Tensor: ...

    def decode(self, vae, x: Tensor) -> Tensor: ...

    def shard_sequence(self, net, sp: SequenceParallel) -> list:
        """Install sequence parallelism on ``net`` (a bare diffusers model); returns the hooks' handles. Families
        without it (``FamilySpec.sequence_parallel`` False) raise."""
        ...


@dataclass(frozen=True)
class Component:
    """One folder of a diffusers pipeline, as ``model_index.json`` names it."""

    # "diffusers", "transformers", or the module of a diffusers pipeline's own class (LTX-2's text connectors and
    # vocoder: "diffusers.pipelines.ltx2", which model_index.json shortens to "ltx2"; lean.models.build.library_module)
    library: str
    model_class: str
    config_class: str | None = None  # a transformers text encoder's config class (the size builds it); else None


@dataclass(frozen=True)
class VaeConvention:
    """How the policy's latents relate to the VAE's."""

    normalisation: Normalisation  # :data:`SCALE_SHIFT` or :data:`MEAN_STD`, read from the VAE config
    temporal_compression: int | None = None  # video: frames per latent frame t (F = t k + 1 frames); None: images


PUBLISHED = "full"  # a family's published size; its other published sizes are "full-<variant>" (Wan2.1's 14B)


def is_published(size: str) -> bool:
    """Whether ``model.size`` names a published size (drawn on the run's device, planned on the meta device on a
    CPU): ``full``, or ``full-<variant>``."""
    return size == PUBLISHED or size.startswith(PUBLISHED + "-")


@dataclass(frozen=True)
class Size:
    """One size of a family: the constructor arguments of each component (a text encoder: its config class's),
    what a random build draws. Every denoiser of the family has the ``transformer`` config."""

    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_encoders: dict[str, dict[str, Any]]  # text encoder folder -> its config
    # folder -> constructor arguments of the pipeline's other diffusers components: neither a denoiser, the VAE nor a
    # transformers text encoder (LTX-2's text connectors, audio VAE and vocoder); frozen, held beside the text encoders
    others: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the square side in pixels at which an edit's reference image is encoded (Qwen-Image-Edit's pipeline: its 1024^2
    # area, whatever the samples' size); None: the run's model.resolution (FLUX.1 Kontext as FlowGRPO runs it)
    reference_resolution: int | None = None


@dataclass(frozen=True)
class Processor:
    """A multimodal processor folder of a pipeline (Qwen-Image-Edit's ``processor``, a Qwen2VLProcessor): a tokenizer
    and an image processor saved in one folder. lean builds the processor object from those two parts
    (``lean.models.processors``); a random build's image processor takes ``image_processor``'s arguments."""

    processor_class: str  # the transformers class model_index.json names
    image_processor_class: str  # the transformers class of its image processor
    image_processor: dict[str, Any]  # a random build's image processor arguments (the published preprocessor config)


@dataclass(frozen=True)
class FamilySpec:
    """Everything lean reads about a family without building it."""

    display_name: str  # in messages: "FLUX", "SD3", "Wan"
    pipeline: str  # the diffusers pipeline class (model_index.json's _class_name)
    # folder -> component, in model_index.json's order (a random build draws component k from seed INIT_SEED + k)
    components: Mapping[str, Component]
    tokenizers: Mapping[str, str]  # text encoder folder -> its tokenizer folder
    t5_tokenizer: str  # the tokenizer of the T5-like encoder, whose length caps the pipeline's max_sequence_length
    vae: VaeConvention
    packed_latents: bool  # the policy's x packs VAE latent patches into tokens (FLUX); else the VAE's own layout
    scheduler: Mapping[str, Any]  # the published scheduler_config.json: its _class_name and shift settings
    sizes: Mapping[str, Size]  # tiny (tests), small (CPU bench), ..., full (as published)
    lora_attention: str  # regex (peft full match) of the adapted attention projections
    lora_ffn: str  # regex of the MLP layers model.lora_ffn adds
    runtime: Callable[..., FamilyRuntime]  # (transformer_config, vae_config, resolution, num_frames) -> FamilyRuntime
    # the denoiser's stacks of repeated blocks (ModuleList attributes of the diffusers model), in forward order; each
    # stack's last block may differ from the others (SD3's last joint block updates no text)
    block_lists: tuple[str, ...] = ("transformer_blocks",)
    # the transformer config fields whose sum is its number of blocks (lean.models.footprint.transformer_blocks):
    # FLUX's double- and single-stream blocks are two counts
    block_counts: tuple[str, ...] = ("num_layers",)
    # the denoiser folders, in the order steps use them: one, or a high-noise and a low-noise expert (Wan2.2-A14B)
    denoiser_folders: tuple[str, ...] = ("transformer",)
    boundary: float | None = None  # two denoisers: the first runs at sigma >= boundary, the second below
    # the pipeline class's own settings a folder records in model_index.json (Wan2.2-TI2V: expand_timesteps)
    pipeline_config: dict = field(default_factory=dict)
    non_square: bool = False  # its runtime takes ``width=`` (model.width): frames of another width than height
    guidance_embed: bool = False  # a distilled-guidance embedding (FLUX.1-dev)
    sequence_parallel: bool = False  # ``runtime.shard_sequence`` is implemented
    # conditioned on a reference image per prompt (editing: Kontext, Qwen-Image-Edit, FLUX.2 with model.edit)
    reference_images: bool = False
    # with reference_images: a prompt set may also be plain text, each prompt then conditioned on its image or none
    # (the pipeline's image= is optional and the same weights generate and edit: FLUX.2's); else edits only
    reference_optional: bool = False
    # the smallest reference side the pipeline takes (Flux2ImageProcessor.check_image_input: 64 px); 0: any
    min_reference_side: int = 0
    # true CFG rescaled to the conditional velocity's norm per token (QwenImagePipeline: v <- v * |v_c| / |v|)
    cfg_renorm: bool = False
    # the pipeline's CFG is ``true_cfg_scale`` against a ``negative_prompt`` (QwenImagePipeline), not ``guidance_scale``
    true_cfg: bool = False
    # the pipeline's ``guidance_scale`` g guides as v_c + g (v_c - v_u), CFG only when g > 0 (ZImagePipeline): lean's
    # scale s = v_u + s (v_c - v_u) is g + 1, and no CFG is g = 0
    guidance_from_conditional: bool = False
    # the pipeline's __call__ takes ``sigmas`` (lean sample passes lean's sigma grid; tests/test_export.py checks it
    # against diffusers); WanPipeline's does not: it steps on its scheduler's own grid
    takes_sigmas: bool = False
    keeps_float32: bool = False  # the transformer class keeps some modules float32 in half precision
    # a dynamically shifting scheduler's mu as the pipeline computes it, mu(image_seq_len, num_steps), instead of the
    # config's linear rule (Flux2Pipeline's compute_empirical_mu); None: the linear rule
    # (lean.models.scheduler.dynamic_mu)
    mu_rule: Callable[[int, int], float] | None = None
    # Jinja chat template given to a random build's word-level tokenizer, for a pipeline that formats its prompts with
    # ``tokenizer.apply_chat_template`` (FLUX.2); saved with the tokenizer. None: the pipeline uses no chat template
    chat_template: str | None = None
    # multimodal processor folders (model_index.json's name -> how to build one): what the family's encode_text reads
    # beside the tokenizers (Qwen-Image-Edit's Qwen2VLProcessor puts the reference image into the prompt)
    processors: Mapping[str, Processor] = field(default_factory=dict)
    # special tokens a random build's word-level tokenizer appends after its trained vocabulary (so that no other
    # family's ids move), e.g. the vision markers a processor writes into the prompt
    special_tokens: tuple[str, ...] = ()
    # text encoder config fields a random build sets to a special token's id: {"image_token_id": "<|image_pad|>"}
    special_token_ids: Mapping[str, str] = field(default_factory=dict)
    # the pipeline also makes a soundtrack (LTX-2): ``runtime.decode_audio(components, x)`` gives each sample's
    # waveform ``[B, channels, samples]`` in [-1, 1], which the rewards that read audio receive
    # (``lean.rewards.base.reads_audio``)
    audio: bool = False
    # the frame count a run renders where model.num_frames is lean's default (5), which this family's VAE cannot make
    # (LTX-2's 8k + 1: 9); None: the default stands (lean.models.checks.family_defaults)
    num_frames: int | None = None

    def __post_init__(self) -> None:
        """A spec that contradicts itself fails at import (every spec is built when lean.models is imported)."""
        missing = [d for d in (*self.denoiser_folders, "vae", *self.tokenizers) if d not in self.components]
        if missing:
            raise ValueError(f"{self.display_name}: {', '.join(missing)} not among the components")
        if self.t5_tokenizer not in self.tokenizers.values():
            raise ValueError(f"{self.display_name}: t5_tokenizer {self.t5_tokenizer!r} is not a tokenizer folder")
        if len(self.denoiser_folders) not in (1, 2) or (len(self.denoiser_folders) == 2) != (self.boundary is not None):
            raise ValueError(f"{self.display_name}: one denoiser, or two with a boundary sigma")
        unknown = [t for t in self.special_token_ids.values() if t not in self.special_tokens]
        if unknown:
            raise ValueError(f"{self.display_name}: special_token_ids name {', '.join(unknown)}, not special tokens")
        text = {n for n, c in self.components.items() if c.config_class is not None}
        others = set(self.components) - text - {*self.denoiser_folders, "vae"}
        for name, size in self.sizes.items():
            if set(size.text_encoders) != text:
                raise ValueError(f"{self.display_name} size {name}: text encoder configs for {sorted(text)}")
            if set(size.others) != others:
                raise ValueError(f"{self.display_name} size {name}: other component configs for {sorted(others)}")

    @property
    def video(self) -> bool:
        return self.vae.temporal_compression is not None

    def lora_targets(self, ffn: bool) -> str:
        """Regex (peft full-match) of the adapted linear layers: the attention projections, optionally the MLPs."""
        return f"{self.lora_attention}|{self.lora_ffn}" if ffn else self.lora_attention

    def size_config(self, size: str, component: str) -> dict[str, Any]:
        """Component ``component``'s config at ``size`` (every denoiser has the transformer's)."""
        s = self.sizes[size]
        if component in self.denoiser_folders:
            return s.transformer
        if component in s.others:
            return s.others[component]
        return s.vae if component == "vae" else s.text_encoders[component]


class VideoLatents:
    """The latent geometry video runtimes share (Wan's, HunyuanVideo-1.5's): the VAE's own ``[C, F', h, w]``, which
    the transformer patchifies itself by ``patch`` (t, h, w); set ``channels``, ``frames``, ``h``, ``w``, ``patch``."""

    channels: int
    frames: int
    h: int
    w: int
    patch: tuple[int, int, int]

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.channels, self.frames, self.h, self.w)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self.noise_shape

    @property
    def image_seq_len(self) -> int:
        """Video tokens: the transformer's ``patch`` patches of ``[F', h, w]``."""
        pt, ph, pw = self.patch
        return (self.frames // pt) * (self.h // ph) * (self.w // pw)

    def noise_to_latents(self, noise):
        return noise
