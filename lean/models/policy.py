"""The trainable policy: diffusers flow-matching transformers (its denoisers) + LoRA (peft) + frozen VAE and text
encoders.

Flow matching convention: x_t = (1 - sigma) x_0 + sigma noise, and the network predicts the velocity
v = noise - x_0. Classifier-free guidance combines an unconditional (empty prompt) and a conditional prediction:
v = v_u + s (v_c - v_u). The reference policy of the KL term is the same network with the adapter switched off (or
with an algorithm's second weights swapped in: ``Policy.reference_weights``, GARDO's reset reference).

Everything family-specific (latent layout, timestep scale, text conditioning, VAE normalisation) sits behind the
:class:`lean.models.spec.FamilyRuntime` protocol implemented in ``lean/models/<family>/`` (``Policy.runtime``); this
module does not know which family it runs. ``lean.models.build.build_policy`` builds a policy from the family's spec,
its runtime, its built modules (:class:`PolicyParts`) and the model options. A family has one denoiser or several
(Wan2.2-A14B: a high-noise and a low-noise expert), each step running the one its noise level chooses
(:meth:`Policy.denoiser_index`); LoRA, gradient checkpointing, the reference and the trainable parameters cover every
denoiser.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.utils.checkpoint
from safetensors.torch import load_file, save_file
from torch import Tensor

from lean.config.dtypes import DTYPES, HALF, master_dtype
from lean.config.prompts import conditioning_pixels, reference_image
from lean.models.precision import float64_scope
from lean.models.spec import FamilyRuntime, FamilySpec
from lean.models.text import PromptEmbeds
from lean.parallel.sharding import full, full_state_dict, like
from lean.sampling.sde import compute_dtype

if TYPE_CHECKING:
    from lean.models.options import ModelConfig
    from lean.sampling.options import SampleConfig

LORA_FILE = "lora.safetensors"


@dataclass
class PolicyParts:
    """The built modules of a policy (``lean.models.build.build_policy``): the denoisers by pipeline folder, in the
    order steps use them (peft-wrapped for LoRA, bare under full fine-tuning), the VAE, the text encoders by folder,
    the tokenizers (and multimodal processors) by folder, and under full fine-tuning frozen copies of the denoisers'
    initial weights (the reference; else None)."""

    denoisers: Mapping[str, torch.nn.Module]
    vae: torch.nn.Module
    text_encoders: dict[str, torch.nn.Module]  # and the family's other frozen components (Size.others), by folder
    tokenizers: dict
    reference_denoisers: Sequence[torch.nn.Module] | None = None


@dataclass(frozen=True)
class Guidance:
    """How :meth:`Policy.velocity` guides: the guidance fields of the ``sample`` section (a ``SampleConfig`` has them
    all and serves as one); the default is no guidance."""

    cfg: bool = False  # classifier-free guidance: v = v_u + s (v_c - v_u)
    guidance_scale: float = 1.0  # s
    guidance_scale_2: float | None = None  # s on the low-noise expert's rows (two denoisers; None: guidance_scale)
    uncond_grad: bool = False  # v_u carries a gradient (else it is a constant)
    guidance_embed: float | None = None  # the distilled-guidance embedding's value (FLUX.1); None: the family's default
    truncate_timestep: bool = False  # the network sees floor(1000 sigma) / 1000, in float32 (DanceGRPO)


UNGUIDED = Guidance()


def cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[torch.nn.Module, str, Tensor]]:
    """Every floating parameter and buffer to ``dtype``, except, in half precision, those a diffusers class lists in
    ``_keep_in_fp32_modules`` (Wan: RoPE tables, time embedding, modulation tables, norms), which stay float32 as
    its ``from_pretrained`` keeps them: a name component matches. They are never rounded on the way. Trainable
    parameters (``requires_grad``) are kept at :func:`lean.config.dtypes.master_dtype` (float32 in half precision);
    those this makes wider than they compute in are returned as (module, name, master)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or []) if dtype in HALF else set()
    masters = []
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point():
                    continue
                target = torch.float32 if keep & set(f"{module_name}.{name}".split(".")) else dtype
                if tensor.requires_grad and master_dtype(target) != target:
                    target = master_dtype(target)
                    masters.append((module, name, tensor))
                if tensor.dtype != target:
                    if isinstance(tensor, torch.nn.Parameter):
                        tensor.data = tensor.data.to(target)
                    else:
                        table[name] = tensor.to(target)
    return masters


class _Reentrant:
    """A context manager entered anew each time (a graph backpropagated twice recomputes its blocks twice)."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self.make, self.open = make, []

    def __enter__(self):
        self.open.append(self.make())
        return self.open[-1].__enter__()

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)


class Policy(torch.nn.Module):
    """Velocity field v_theta(x, sigma, prompt) with CFG, its reference (adapter off), and frozen text/VAE parts.

    ``denoisers`` are the peft-wrapped transformers (LoRA), or the bare ones under full fine-tuning; then
    ``reference_denoisers`` are frozen copies of their initial weights (the only case that needs second copies).
    ``denoiser_folders`` name them as the pipeline folder does; with two, ``boundary`` splits the noise levels
    (:meth:`denoiser_index`). Every part is cast to ``dtype`` on ``device`` here, which are then fixed for the
    policy's life.

    Precision: the network computes in ``dtype``, but the trainable parameters (LoRA factors, or the whole trained
    denoisers), hence their gradients and the optimizer state, are float32 masters in half precision
    (:func:`lean.config.dtypes.master_dtype`); each forward reads them cast to ``dtype`` (:meth:`_compute_weights`), so
    gradients land on the masters in float32. The frozen base, the reference copies, VAE and text encoders are
    ``dtype``. float32 and float64 runs have no masters: nothing is cast.
    """

    def __init__(
        self,
        spec: FamilySpec,
        runtime: FamilyRuntime,
        parts: PolicyParts,
        options: ModelConfig,
        device: torch.device | str,
    ):
        """``options`` (the ``model`` section) gives the family's name, the text length, the precisions and the
        samples' resolution; ``spec`` the pipeline class and settings, the expert boundary, the CFG renormalisation
        and the size's reference resolution."""
        super().__init__()
        if len(parts.denoisers) not in (1, 2) or (len(parts.denoisers) == 2) != (spec.boundary is not None):
            raise ValueError("a policy has one denoiser, or two with a boundary sigma")
        self.family, self.spec, self.runtime, self.pipeline_class = options.family, spec, runtime, spec.pipeline
        self.pipeline_config = dict(spec.pipeline_config)  # model_index.json's settings of the pipeline class
        self.denoiser_folders, self.boundary = tuple(parts.denoisers), spec.boundary
        self.cfg_renorm = spec.cfg_renorm
        self.resolution = options.resolution  # of the samples, and of the reference images edits are conditioned on
        # the square side an edit's reference is encoded at when the family's pipeline resizes it again
        # (Qwen-Image-Edit: 1024, Size.reference_resolution); None: resolution
        self.reference_resolution = spec.sizes[options.size].reference_resolution
        # model.reference_resolution: the side the original reference is resized to, once (FLUX.2's condition-image
        # size; refused where the size has its own side); None: the run's resolution
        self.condition_size = options.reference_resolution
        self.negative_prompt = ""  # CFG's unconditional prompt: sample.negative_prompt, set before the first encode
        self.denoisers = torch.nn.ModuleList(parts.denoisers.values())
        self.vae = parts.vae
        self.text_encoders = torch.nn.ModuleDict(parts.text_encoders)
        self.tokenizers, self.text_max_length = parts.tokenizers, options.text_max_length
        reference = parts.reference_denoisers
        self.reference_denoisers = None if reference is None else torch.nn.ModuleList(reference)
        self._prompt_cache: dict[str, PromptEmbeds] = {}
        # at_geometry's, by (side, latent shape): an edit's reference has its side, an I2V condition its frames too
        self._caches_by_side: dict[tuple, dict[str, PromptEmbeds]] = {}
        self._use_reference = False
        self.sequence_parallel = None  # lean.models.sequence_parallel.SequenceParallel once enabled (build_pipeline)
        dtype = DTYPES[options.dtype]
        self.device, self.dtype = torch.device(device), dtype
        self.vae_dtype = options.torch_vae_dtype or dtype  # FlowGRPO decodes in float32 whatever the policy computes in
        self.to(device=device).eval()
        for part in (*(self.reference_denoisers or []), self.text_encoders):  # each its own _keep_in_fp32_modules
            cast_floating(part, dtype)
        cast_floating(self.vae, self.vae_dtype)
        # (module, name, float32 master) read at ``dtype``
        self._masters = [m for net in self.denoisers for m in cast_floating(net, dtype)]
        # the reference as second weights (an algorithm's snapshot, ``lean.models.snapshot``: GARDO's old adapter),
        # what :meth:`reference` reads; None: the adapter off (or the initial weights)
        self.reference_weights = None
        self._read_instead: dict[int, Tensor] = {}  # id(trainable parameter) -> what a forward reads (weights_from)

    @property
    def full_finetune(self) -> bool:
        return self.reference_denoisers is not None

    @property
    def transformer(self) -> torch.nn.Module:
        """The denoiser of a single-denoiser policy (every family today); a policy with several has none."""
        if len(self.denoisers) != 1:
            raise ValueError(f"this policy has {len(self.denoisers)} denoisers: use policy.denoisers")
        return self.denoisers[0]

    def networks(self) -> list[torch.nn.Module]:
        """Every denoiser, then (full fine-tuning) every reference copy: what sharding and sequence parallelism
        install on."""
        return [*self.denoisers, *(self.reference_denoisers or [])]

    def denoiser_index(self, sigma: float) -> int:
        """Which denoiser runs at noise level ``sigma``: the first at ``sigma >= boundary`` (the high-noise expert,
        as WanPipeline compares its timestep with ``boundary_ratio``), the second below; 0 with one denoiser."""
        return 0 if self.boundary is None or sigma >= self.boundary else 1

    def denoiser_for(self, sigma: float) -> torch.nn.Module:
        """The network that runs at noise level ``sigma`` (inside :meth:`reference`: its reference)."""
        return self._nets()[self.denoiser_index(sigma)]

    def train(self, mode: bool = True) -> Policy:
        """Only the denoisers change mode; the frozen VAE and text encoders stay in eval (no dropout)."""
        super().train(mode)
        self.vae.eval()
        self.text_encoders.eval()
        return self

    # ------------------------------------------------------------------ conditioning and latents

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embeddings ``[B, L, D]`` (+ pooled ``[B, P]``, mask, reference), computed once per prompt under no_grad.

        Each new prompt is encoded alone, so its embedding never depends on which prompts it was batched with.
        An edit (:class:`lean.config.prompts.ImagePrompt`) also carries its reference image's latent tokens and its own
        unconditional conditioning (:meth:`_encode_edit`).
        """
        for prompt in dict.fromkeys(prompts):
            if prompt not in self._prompt_cache:
                with torch.no_grad():
                    emb = self._encode_text([prompt]) if reference_image(prompt) is None else self._encode_edit(prompt)
                self._prompt_cache[prompt] = emb.to(dtype=self.dtype)
        return PromptEmbeds.cat([self._prompt_cache[p] for p in prompts])

    def _encode_text(self, prompts: list[str], images=None) -> PromptEmbeds:
        return self.runtime.encode_text(
            self.text_encoders, self.tokenizers, prompts, self.text_max_length, self.device, images=images
        )

    def _encode_edit(self, prompt: str) -> PromptEmbeds:
        """An edit's conditioning: the instruction's text embedding (the image reaches the text encoder too where the
        family's does: Qwen-Image-Edit), the reference image's latent tokens (resized to the run's resolution, as
        FlowGRPO's edit scripts do, then to :attr:`reference_resolution` where the family's pipeline resizes it again:
        Qwen-Image-Edit's VaeImageProcessor.resize, PIL's Lanczos filter; with ``model.reference_resolution`` resized
        to that side once, with Lanczos, as the FLUX.2 pipelines resize theirs), and as ``negative`` the same image
        under the empty instruction: CFG keeps the reference in both branches, as the edit pipelines do."""
        from PIL import Image  # local: only edits need it

        pixels = conditioning_pixels(prompt, self.resolution, self.condition_size)
        image = Image.fromarray((pixels.permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
        side = self.reference_resolution
        if side is not None and side != self.resolution:  # model.reference_resolution is refused with a side
            image = image.resize((side, side), Image.Resampling.LANCZOS)
            pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        reference = self.runtime.encode_reference(self.vae, (pixels[None] * 2 - 1).to(self.device, self.vae_dtype))
        negative = self._encode_text([self.negative_prompt], images=[image])
        negative.reference = reference
        emb = self._encode_text([str(prompt)], images=[image])
        emb.reference, emb.negative = reference, negative
        return emb

    @contextmanager
    def at_geometry(self, runtime: FamilyRuntime, resolution: int) -> Iterator[None]:
        """Sample at another geometry inside: ``runtime`` (the family's for another resolution / frame count, as
        ``eval.resolution`` asks) and ``resolution``, the side edit references are resized to; the prompts it encodes
        are cached apart, by the side and the latent's shape (an edit's reference latents have its side; an
        image-to-video conditioning latent its frame count too). The weights are the same."""
        saved = self.runtime, self.resolution, self._prompt_cache
        self._caches_by_side.setdefault((self.resolution, tuple(self.runtime.noise_shape)), self._prompt_cache)
        self.runtime, self.resolution = runtime, resolution
        self._prompt_cache = self._caches_by_side.setdefault((resolution, tuple(runtime.noise_shape)), {})
        try:
            yield
        finally:
            self.runtime, self.resolution, self._prompt_cache = saved

    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample shape of x in the layout :meth:`velocity` takes."""
        return tuple(self.runtime.latent_shape)

    def init_latents(self, generators: list[torch.Generator], dtype: torch.dtype | None = None) -> Tensor:
        """x_1 ~ N(0, I) in ``dtype`` (default: the policy's): sample b is a float32 draw from ``generators[b]``
        (CPU), so it never depends on batching or on the dtype / device of the run."""
        noise = torch.stack([torch.randn(self.runtime.noise_shape, generator=g) for g in generators])
        latents = self.runtime.noise_to_latents(noise)
        latents = latents.pin_memory() if self.device.type == "cuda" else latents  # a copy the host need not wait for
        return latents.to(self.device, dtype or self.dtype, non_blocking=True)

    # ------------------------------------------------------------------ velocity

    def _nets(self) -> torch.nn.ModuleList:
        return self.reference_denoisers if self._use_reference else self.denoisers

    def _forward(self, x: Tensor, sigma: Tensor, emb: PromptEmbeds, guidance_embed: float | None) -> Tensor:
        with self._forward_scope():
            nets = self._nets()
            if len(nets) == 1:
                return self.runtime.forward(nets[0], x, sigma, emb, guidance_embed)
            # several denoisers: each sample runs the one its sigma chooses (one forward when they all agree)
            chosen = (sigma < self.boundary).long()  # denoiser_index of every sample
            # the meta device (lean plan) has no values: one expert's pass is counted (the experts share a shape)
            picks = [0] if sigma.device.type == "meta" else chosen.unique().tolist()
            if len(picks) == 1:
                return self.runtime.forward(nets[picks[0]], x, sigma, emb, guidance_embed)
            order = torch.argsort(chosen, stable=True)
            parts = []
            for k in picks:
                rows = (chosen == k).nonzero().squeeze(1)
                parts.append(self.runtime.forward(nets[k], x[rows], sigma[rows], emb.index(rows), guidance_embed))
            return torch.cat(parts)[torch.argsort(order)]

    @contextmanager
    def _forward_scope(self) -> Iterator[None]:
        """What every transformer forward runs under: float64 kept, trainable weights read at ``dtype``."""
        with float64_scope(self.dtype == torch.float64), self._compute_weights():
            yield

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Activation checkpointing of every denoiser's blocks (``model.gradient_checkpointing``), through
        diffusers' own switch. The recompute in the backward runs outside :meth:`_forward`, so it re-enters the
        same scope (``context_fn``): otherwise a float64 model would recompute in float32 and a half-precision one
        would read its float32 masters, and the recomputed activations would not be the saved ones."""

        def checkpointed(block, *args):
            scopes = lambda: (contextlib.nullcontext(), _Reentrant(self._forward_scope))  # noqa: E731
            return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False, context_fn=scopes)

        for denoiser in self.denoisers:
            net = denoiser.get_base_model() if hasattr(denoiser, "get_base_model") else denoiser
            if enabled:
                net.enable_gradient_checkpointing(gradient_checkpointing_func=checkpointed)
            elif net.is_gradient_checkpointing:
                net.disable_gradient_checkpointing()

    def drop_master_casts(self) -> bool:
        """Stop casting the float32 masters to ``dtype`` in the forward (another owner casts them: FSDP's mixed
        precision, ``lean.parallel.sharding``); returns whether there were any."""
        had, self._masters = bool(self._masters), []
        return had

    @contextmanager
    def _compute_weights(self) -> Iterator[None]:
        """Inside the block each float32 master reads as its cast to ``dtype`` (an autograd op: the gradient flows
        back to the master and accumulates there in float32); swapped in ``_parameters`` under the same name, as
        ``torch.func.functional_call`` does. Without masters (float32, float64) this does nothing.

        Why not ``torch.autocast`` (FlowGRPO's Accelerate set-up): it also changes how the frozen network computes,
        and differently per device: CUDA runs layer_norm, softmax, pow, rsqrt in float32 and CPU does not, so the
        CPU certificate would not certify what a GPU runs; and it would compute the Linear layers diffusers keeps in
        float32 (Wan's time embedder) in bfloat16. Casting the trainable weights alone keeps the forward exactly
        the one a ``dtype`` model computes; peft then sees ``dtype`` LoRA weights and does not upcast the input.
        """
        if not self._masters or self._use_reference:
            yield
            return
        for module, name, p in self._masters:
            module._parameters[name] = self._read_instead.get(id(p), p).to(self.dtype)
        try:
            yield
        finally:
            for module, name, p in self._masters:
                module._parameters[name] = p

    def velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        emb: PromptEmbeds,
        guidance: Guidance | SampleConfig = UNGUIDED,
        joint_cfg: bool = False,
    ) -> Tensor:
        """v(x, sigma | prompt), guided when ``guidance.cfg``: v = v_u + s (v_c - v_u), v_u for :attr:`negative_prompt`
        (or the row's own unconditional conditioning, ``emb.negative``: an edit keeps its reference image); with two
        experts, ``guidance_scale_2`` (if set) is s on the low-noise expert's rows, as WanPipeline's. Families with
        ``cfg_renorm`` (Qwen-Image) rescale v per token to the norm of v_c over the channels, as their pipelines do.

        ``sigma`` is ``[B]`` (or a scalar) in [0, 1]. With ``uncond_grad=False`` v_u is a constant.
        The two halves run as one ``[uncond, cond]`` batch, except when autograd is recording and v_u is
        detached: then v_u runs as its own no-grad forward, which keeps half the batch out of the graph (no saved
        activations, no backward through it) at the same forward FLOPs. Both give the same numbers up to rounding;
        ``joint_cfg`` keeps the one batch anyway (v_u detached after it), so that a recomputed forward rounds exactly
        as the no-grad rollout's did. ``truncate_timestep``: the network sees floor(1000 sigma) / 1000, computed in
        float32 as DanceGRPO does.
        """
        x = x.to(self.dtype)  # a trajectory kept wider than the network (sample.latent_dtype) is read at its precision
        sigma = torch.as_tensor(sigma, device=x.device)
        guidance_embed, uncond_grad = guidance.guidance_embed, guidance.uncond_grad
        if guidance.truncate_timestep:
            sigma = torch.floor(sigma.float() * 1000) / 1000
        # sigma in the step's compute dtype: rounding it to bfloat16 would move the timestep (913.35 -> 916)
        sigma = sigma.to(compute_dtype(x)).expand(x.shape[0])
        if not guidance.cfg:
            return self._forward(x, sigma, emb, guidance_embed)
        if emb.negative is not None:
            uncond = emb.negative
        else:
            uncond = self.encode_prompts([self.negative_prompt]).expand(x.shape[0])
        if torch.is_grad_enabled() and not uncond_grad and not joint_cfg:
            with torch.no_grad():
                v_u = self._forward(x, sigma, uncond, guidance_embed)
            v_c = self._forward(x, sigma, emb, guidance_embed)
        else:
            v = self._forward(
                torch.cat([x, x]), torch.cat([sigma, sigma]), PromptEmbeds.cat([uncond, emb]), guidance_embed
            )
            v_u, v_c = v.chunk(2)
            if not uncond_grad:
                v_u = v_u.detach()  # a constant (no-op without autograd)
        scale = guidance.guidance_scale
        if guidance.guidance_scale_2 is not None and self.boundary is not None:  # per row, by its sigma's expert
            low = (sigma < self.boundary).view(-1, *[1] * (x.dim() - 1))
            scale = torch.where(low, guidance.guidance_scale_2, guidance.guidance_scale).to(v_c.dtype)
        v = v_u + scale * (v_c - v_u)
        if self.cfg_renorm:
            v = v * (
                torch.linalg.vector_norm(v_c, dim=-1, keepdim=True) / torch.linalg.vector_norm(v, dim=-1, keepdim=True)
            )
        return v

    forward = velocity

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Inside the block the policy is the reference model: the adapter disabled (or the initial weights), or the
        :attr:`reference_weights` where an algorithm set them (its snapshot's values, read when the block starts)."""
        if self.reference_weights is not None:
            with self.weights_from(self.reference_weights.values):
                yield
            return
        if not self.full_finetune:
            with contextlib.ExitStack() as adapters_off:
                for net in self.denoisers:
                    adapters_off.enter_context(net.disable_adapter())
                yield
            return
        self._use_reference = True
        try:
            yield
        finally:
            self._use_reference = False

    @torch.no_grad()
    def decode(self, x: Tensor) -> Tensor:
        """Images ``[B, 3, H, W]`` (video: ``[B, 3, F, H, W]``), float32 in [0, 1], decoded at the VAE's
        precision."""
        return (self.runtime.decode(self.vae, x.to(self.vae_dtype)) / 2 + 0.5).clamp(0, 1).float()

    @torch.no_grad()
    def decode_audio(self, x: Tensor) -> Tensor | None:
        """The soundtrack of each sample, ``[B, channels, samples]`` float32 in [-1, 1], of a family that makes one
        (``FamilySpec.audio``: LTX-2's audio VAE and vocoder, held beside the text encoders); else None."""
        if not self.spec.audio:
            return None
        return self.runtime.decode_audio(self.text_encoders, x.to(self.dtype)).float()

    @contextmanager
    def weights_from(self, values: Sequence[Tensor]) -> Iterator[None]:
        """Inside the block every forward reads ``values`` (one per :meth:`trainable_parameters`, in that order) for
        the trainable parameters. They are put in the modules' ``_parameters`` by reference, as
        ``torch.func.functional_call`` does, never copied into the parameters: a graph that saved the trained
        weights stays valid (an in-place copy would bump their version counters), and no gradient reaches
        ``values`` (detached). A float32 master is read through its cast to ``dtype`` (:meth:`_compute_weights`)."""
        params = [p for _, p in self.trainable_parameters()]
        instead = {id(p): v.detach() for p, v in zip(params, values, strict=True)}
        masters = {id(p) for _, _, p in self._masters}
        slots = [
            (module, name, p)
            for net in self.denoisers
            for module in net.modules()
            for name, p in module._parameters.items()
            if p is not None and id(p) in instead and id(p) not in masters
        ]
        self._read_instead = instead
        for module, name, p in slots:
            module._parameters[name] = instead[id(p)]
        try:
            yield
        finally:
            for module, name, p in slots:
                module._parameters[name] = p
            self._read_instead = {}

    # ------------------------------------------------------------------ trainable state

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of what the optimizer updates: LoRA factors, or the whole denoisers. Names are module
        paths inside the denoiser, prefixed with its folder (``transformer_2.``) when there are several; identical in
        every process."""
        several = len(self.denoisers) > 1
        return [
            (f"{folder}.{n}" if several else n, p)
            for folder, net in zip(self.denoiser_folders, self.denoisers, strict=True)
            for n, p in net.named_parameters()
            if p.requires_grad
        ]

    @torch.no_grad()
    def perturb_lora_(self, std: float, generator: torch.Generator) -> None:
        """theta += std * N(0, I) on the trainable parameters (float32 CPU draws), e.g. to make a zero-initialised
        LoRA B non-trivial so the policy and its reference differ."""
        for _, p in self.trainable_parameters():
            p.add_(like(torch.randn(p.shape, generator=generator), p).to(p.dtype) * std)

    def lora_state_dict(self) -> dict[str, Tensor]:
        """A copy of the trainable parameters, keyed as :meth:`trainable_parameters`; whole tensors (sharded ones are
        gathered: under ``parallel.shard=fsdp`` every process must call it)."""
        return {n: full(p).detach().clone() for n, p in self.trainable_parameters()}

    @torch.no_grad()
    def load_lora_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy ``state`` into the trainable parameters; keys and shapes must match exactly."""
        params = dict(self.trainable_parameters())
        if set(state) != set(params):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise KeyError(f"LoRA state mismatch: missing {missing[:3]}..., unexpected {extra[:3]}...")
        for n, p in params.items():
            p.copy_(like(state[n], p))

    def save_lora(self, path: str | Path, state: dict[str, Tensor] | None = None) -> None:
        """The trainable parameters as safetensors, in their own dtype (float32 masters in half precision); ``state``
        (keyed as :meth:`lora_state_dict`, e.g. the EMA weights) instead of the current ones."""
        state = self.lora_state_dict() if state is None else state
        if set(state) != {n for n, _ in self.trainable_parameters()}:
            raise KeyError("save_lora: state must be keyed as the trainable parameters")
        save_file({n: t.contiguous() for n, t in state.items()}, str(path), metadata={"family": self.family})

    def load_lora(self, path: str | Path) -> None:
        self.load_lora_state_dict(load_file(str(path), device=str(self.device)))

    # ------------------------------------------------------------------ diffusers pipeline folder

    def base_transformer_state_dict(self, denoiser: int = 0) -> dict[str, Tensor]:
        """Denoiser ``denoiser``'s own weights, LoRA layers stripped (peft keeps the base Linear as ``base_layer``);
        whole tensors (gathered when sharded: every process must call it)."""
        net = self.denoisers[denoiser]
        if self.full_finetune:
            return full_state_dict(net)
        state = full_state_dict(net.get_base_model())
        return {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}

    def save_pretrained(self, folder: str | Path, adapter: bool = True) -> None:
        """Write a diffusers pipeline folder: ``model_index.json``, ``transformer/`` (each denoiser's folder: base
        weights, adapter excluded), ``vae/``, the text encoders and tokenizers; plus, if ``adapter``, the LoRA as
        ``lora.safetensors``. :func:`lean.models.build.build_policy` with ``pretrained=folder`` restores this policy
        exactly."""
        from diffusers import __version__ as diffusers_version  # local: diffusers takes seconds to import

        folder = Path(folder)
        index = {"_class_name": self.pipeline_class, "_diffusers_version": diffusers_version}
        for k, (name, net) in enumerate(zip(self.denoiser_folders, self.denoisers, strict=True)):
            base = net if self.full_finetune else net.get_base_model()
            base.save_config(folder / name)
            save_file(
                {key: v.contiguous() for key, v in self.base_transformer_state_dict(k).items()},
                str(folder / name / "diffusion_pytorch_model.safetensors"),
            )
            index[name] = ["diffusers", type(base).__name__]
        if self.boundary is not None:
            index["boundary_ratio"] = self.boundary  # WanPipeline's name for it
        index.update(self.pipeline_config)
        self.vae.save_pretrained(folder / "vae")
        index["vae"] = ["diffusers", type(self.vae).__name__]
        for name, encoder in self.text_encoders.items():  # with the family's other frozen components (Size.others)
            encoder.save_pretrained(folder / name)
            # a pipeline's own module by its short name, as diffusers writes it (LTX-2's connectors: "ltx2")
            index[name] = [
                self.spec.components[name].library.removeprefix("diffusers.pipelines."),
                type(encoder).__name__,
            ]
        for name, tokenizer in self.tokenizers.items():
            tokenizer.save_pretrained(folder / name)
            processor = name in self.spec.processors  # a processor (Qwen2VLProcessor, CLIPImageProcessor) names itself
            index[name] = ["transformers", type(tokenizer).__name__ if processor else "PreTrainedTokenizerFast"]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        if adapter and not self.full_finetune:
            self.save_lora(folder / LORA_FILE)
