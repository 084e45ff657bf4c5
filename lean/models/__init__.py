"""Model families behind one :class:`Policy`: ``build_policy(model_cfg, prompts)``, ``count_parameters`` and
``time_shift`` (the sigma grid's shift from a pretrained folder's scheduler config or the family's published one).

A family is a package ``lean/models/<family>/`` exposing ``SPEC``, a frozen :class:`lean.models.spec.FamilySpec`:
display name, diffusers pipeline class, components (folder -> library, model class, config class, as
``model_index.json`` names them), tokenizers (and which one is T5-like), VAE conventions, latent packing,
capabilities (guidance embedding, video, sequence parallelism, ...), the published scheduler config, the typed size
table, the LoRA targets, its denoiser folders (one, or experts chosen by a boundary sigma) and ``runtime``, the class
implementing the :class:`lean.models.spec.Family` protocol. :data:`FAMILIES` maps each name to its spec
(:func:`family_spec`); code outside ``lean/models/`` reads spec fields and never probes a family with
``getattr``/``hasattr``. Family packages import no diffusers at import time (config validation reads their specs);
the component classes are imported when a model is built. Adding a family is one new package plus one
:data:`FAMILIES` line.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import inspect
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lean.config import ConfigError, suggest
from lean.config.dtypes import DTYPES, HALF, dtype_name
from lean.config.prompts import reference_image
from lean.config.registry import Registry
from lean.models.flux import SPEC as FLUX
from lean.models.flux2 import SPEC as FLUX2
from lean.models.flux2_klein import SPEC as FLUX2_KLEIN
from lean.models.hunyuan_video15 import SPEC as HUNYUAN_VIDEO15
from lean.models.kontext import SPEC as KONTEXT
from lean.models.policy import LORA_FILE, Policy
from lean.models.precision import keep_rms_norm_dtype
from lean.models.processors import load_processor, random_processor
from lean.models.qwen_image import SPEC as QWEN_IMAGE
from lean.models.qwen_image_edit import SPEC as QWEN_IMAGE_EDIT
from lean.models.sd3 import SPEC as SD3
from lean.models.spec import FamilySpec
from lean.models.text import PromptEmbeds, train_tokenizer
from lean.models.wan import SPEC as WAN
from lean.models.wan22 import SPEC as WAN22
from lean.models.wan22_ti2v import SPEC as WAN22_TI2V
from lean.parallel.sharding import FSDP

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.models.options import ModelConfig

__all__ = [
    "EDIT_PROMPTS",
    "FAMILIES",
    "LORA_INITS",
    "FamilySpec",
    "Policy",
    "PromptEmbeds",
    "build_policy",
    "build_scheduler",
    "check_config",
    "count_parameters",
    "family_defaults",
    "family_spec",
    "lora_config",
    "pipeline_family",
    "scheduler_config",
    "terminal_stretch",
    "time_shift",
]

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
    ],
)
LORA_INITS: Registry[str | bool] = Registry(
    "LoRA initialisation",
    [  # name -> peft's init_lora_weights
        ("kaiming", True),  # A kaiming-uniform, B = 0 (peft's default; DanceGRPO)
        ("gaussian", "gaussian"),  # A ~ N(0, 1/r), B = 0 (FlowGRPO's scripts)
    ],
)
INIT_SEED = 20240601  # every process draws the same random weights
DEVICE_INIT_SIZE = "full"  # the published size is drawn on the run's device, every other one on the CPU
SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"  # in a diffusers pipeline folder
# What an editing family edits when no prompt file is given: lean.workbench.data.write_edit_dataset's recolouring task
EDIT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "edits" / "train_metadata.jsonl"


def family_spec(family: str) -> FamilySpec:
    """The spec of a registered family (a ``KeyError`` naming the known ones otherwise)."""
    return FAMILIES.get_or_raise(family)


def component_classes(spec: FamilySpec, name: str) -> tuple[type, type | None]:
    """(model class, transformers config class or None) of component ``name`` of a family."""
    component = spec.components[name]
    module = importlib.import_module(component.library)
    config_class = component.config_class
    return getattr(module, component.model_class), (getattr(module, config_class) if config_class else None)


def meta_transformer(spec: FamilySpec, size: str, pretrained: str | os.PathLike | None = None) -> torch.nn.Module:
    """The family's (first) denoiser at ``size`` (or as ``pretrained``'s ``transformer/config.json`` describes it) on
    the meta device: no memory, no initialisation (buffers too: SD3.5's 384x384 position table takes 20 s on a CPU)."""
    from accelerate import init_empty_weights  # local: accelerate's import takes seconds

    name = spec.denoiser_folders[0]
    cls = component_classes(spec, name)[0]
    config = cls.load_config(Path(pretrained) / name) if pretrained else spec.size_config(size, name)
    with init_empty_weights(include_buffers=True):
        return cls.from_config(config)


def count_parameters(family: str, size: str) -> int:
    """Parameters of the family's transformer (one denoiser) at ``size``, counted on the meta device."""
    return sum(p.numel() for p in meta_transformer(family_spec(family), size).parameters())


def scheduler_config(family: str, pretrained: str | os.PathLike | None) -> tuple[dict, str]:
    """The scheduler settings of a run and where they come from: ``<pretrained>/scheduler/scheduler_config.json``
    when the folder has one, else the family's published one (``FamilySpec.scheduler``)."""
    if pretrained is not None:
        path = Path(pretrained) / SCHEDULER_CONFIG
        if path.exists():
            return json.loads(path.read_text()), str(path)
    spec = family_spec(family)
    return dict(spec.scheduler), f"{spec.display_name}'s published scheduler config"


def build_scheduler(family: str, pretrained: str | os.PathLike | None, shift: float | None = None):
    """The diffusers scheduler a pipeline of ``family`` samples with: the class and settings of
    :func:`scheduler_config` (``_class_name`` names the class, as in a ``scheduler_config.json``); with ``shift``,
    that static shift instead (``flow_shift`` of Wan's UniPC scheduler, else ``shift``; no dynamic shifting, no
    terminal stretch), e.g. the shift a run sampled with (``sample.shift`` as resolved)."""
    import diffusers  # local: diffusers takes seconds to import (see component_classes)

    config, _ = scheduler_config(family, pretrained)
    name = config.get("_class_name") or family_spec(family).scheduler["_class_name"]
    if shift is not None:
        config = {**config, ("flow_shift" if "flow_shift" in config else "shift"): shift, "use_dynamic_shifting": False}
        if config.get("shift_terminal"):  # lean's grids have no terminal stretch (Qwen-Image's 0.02)
            config["shift_terminal"] = None
    return getattr(diffusers, name).from_config(config)


def component_config(spec: FamilySpec, name: str, size: str, pretrained: str | os.PathLike | None = None):
    """Component ``name``'s config with its class's defaults filled in (attribute access): the pretrained folder's
    ``<name>/config.json`` or the family's size table; nothing is built."""
    from diffusers.configuration_utils import FrozenDict  # local: diffusers takes seconds to import

    if pretrained:
        config = json.loads((Path(pretrained) / name / "config.json").read_text())
    else:
        config = spec.size_config(size, name)
    signature = inspect.signature(component_classes(spec, name)[0].__init__).parameters.values()
    defaults = {p.name: p.default for p in signature if p.default is not inspect.Parameter.empty}
    return FrozenDict({**defaults, **config})


def transformer_blocks(config) -> int:
    """Blocks of a transformer config (:func:`component_config`; FLUX: double- and single-stream)."""
    return config.get("num_layers", 0) + config.get("num_single_layers", 0)


def tracked_step_floor(model_cfg: ModelConfig) -> tuple[int, str]:
    """A lower bound of the bytes one trajectory's tracked transformer step saves for its backward, from the configs
    alone: every block keeps at least its input, [tokens, width] at ``model.dtype``. Every schedule tracks at least
    one such step (Recompute in its update). Returns (bytes, the product spelled out)."""
    spec = family_spec(model_cfg.family)
    t = component_config(spec, spec.denoiser_folders[0], model_cfg.size, model_cfg.pretrained)
    vae = component_config(spec, "vae", model_cfg.size, model_cfg.pretrained)
    arch = spec.runtime(t, vae, model_cfg.resolution, model_cfg.num_frames, **model_cfg.runtime_size())
    width = t["num_attention_heads"] * t["attention_head_dim"]
    blocks = transformer_blocks(t)
    size = DTYPES[model_cfg.dtype].itemsize
    tokens = arch.image_seq_len
    return tokens * width * blocks * size, f"{tokens:,} tokens x width {width} x {blocks} blocks x {size} bytes"


def time_shift(
    family: str,
    pretrained: str | os.PathLike | None,
    shift: float | None,
    image_seq_len: int,
    num_steps: int | None = None,
) -> tuple[float, str]:
    """The sigma grid's time shift and where it comes from. ``shift`` (``sample.shift``) wins when set; otherwise the
    scheduler config of :func:`scheduler_config`, read as diffusers' pipelines read it:

    * ``use_dynamic_shifting`` (FLUX.1; SD3 pipelines too when set): ``mu`` is linear in the image token count,
      ``base_shift`` at ``base_image_seq_len`` tokens to ``max_shift`` at ``max_image_seq_len`` (FluxPipeline's
      ``calculate_shift``, extrapolated beyond them as it is), and the shift is ``e^mu`` (``time_shift_type``
      exponential, diffusers' default) or ``mu`` (linear); a family with a ``FamilySpec.mu_rule`` computes mu as its
      pipeline does instead, from the image token count and ``num_steps`` (Flux2Pipeline's ``compute_empirical_mu``);
    * else ``flow_shift`` (Wan's UniPCMultistepScheduler), else ``shift`` (FlowMatchEulerDiscreteScheduler, whose
      default is 1).
    """
    if shift is not None:
        return float(shift), "sample.shift"
    config, source = scheduler_config(family, pretrained)
    if config.get("use_dynamic_shifting", False):
        rule = family_spec(family).mu_rule
        if rule is not None:
            if num_steps is None:
                raise ValueError(f"{family}'s pipeline computes mu from the step count: pass num_steps")
            mu = rule(image_seq_len, num_steps)
        else:
            base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
            base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
            m = (max_shift - base_shift) / (max_len - base_len)
            mu = image_seq_len * m + (base_shift - m * base_len)
        kind = config.get("time_shift_type", "exponential")
        if kind not in ("exponential", "linear"):
            raise ValueError(f"{source}: time_shift_type={kind!r} is not supported (exponential, linear)")
        value = math.exp(mu) if kind == "exponential" else mu
        return value, f"{source}, dynamic: mu={mu:.4g} at {image_seq_len} image tokens"
    return float(config.get("flow_shift", config.get("shift", 1.0))), source


def terminal_stretch(
    family: str, pretrained: str | os.PathLike | None, shift: float | None, shift_terminal: float | None
) -> float | None:
    """The sigma grid's terminal stretch (``lean.sampling.sde.sigma_schedule``'s ``terminal``):
    ``sample.shift_terminal`` when set; else, when the shift too comes from the scheduler config (``sample.shift``
    None), that config's ``shift_terminal`` (Qwen-Image: 0.02); else none, since a static ``sample.shift`` replaces the
    scheduler's shifting."""
    if shift_terminal is not None or shift is not None:
        return shift_terminal
    return scheduler_config(family, pretrained)[0].get("shift_terminal") or None


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Random draws inside come from ``seed`` (on ``device``); the caller's RNG state is restored afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _random_components(spec: FamilySpec, size: str, tokenizer, device: torch.device) -> dict[str, torch.nn.Module]:
    """Every component of ``spec`` at ``size``, drawn on ``device``, each from its own seed so that e.g. the
    transformer does not depend on the vocabulary size of the text encoders."""
    modules = {}
    for k, name in enumerate(spec.components):
        cls, config_cls = component_classes(spec, name)
        arch = spec.size_config(size, name)
        with torch.device(device), _seeded(INIT_SEED + k, device):
            if config_cls is None:
                modules[name] = cls(**arch)
            else:  # a transformers text encoder sized by ``arch``, vocabulary from the tokenizer
                vocab = dict(
                    vocab_size=len(tokenizer),
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.bos_token_id,
                    **{key: tokenizer.convert_tokens_to_ids(t) for key, t in spec.special_token_ids.items()},
                )
                if "text_config" in arch:  # a multimodal encoder (Mistral3): the vocabulary is its language model's
                    modules[name] = cls(config_cls(**{**arch, "text_config": {**arch["text_config"], **vocab}}))
                else:
                    modules[name] = cls(config_cls(**vocab, **arch))
    return modules


def pretrained_problem(family: str, folder: str | os.PathLike) -> str | None:
    """What keeps ``folder`` from loading as a ``family`` pipeline (one line), or None. Reads only JSON: the checks
    :func:`_load_components` relies on, made before any model is built."""
    spec, folder = family_spec(family), Path(folder)
    if not folder.is_dir():
        return "is not a folder (a local diffusers pipeline folder, as save_pretrained writes it)"
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except FileNotFoundError:
        return "has no model_index.json: not a diffusers pipeline folder"
    except (OSError, ValueError) as err:
        return f"model_index.json is not readable JSON ({str(err).splitlines()[0]})"
    needed = [*spec.components, *spec.tokenizers.values(), *spec.processors]
    malformed = [n for n in needed if not (isinstance(index.get(n), list) and len(index[n]) == 2)]
    if malformed:
        return f"model_index.json has no [library, class] for {', '.join(malformed)} (a {spec.display_name} pipeline)"
    for name in spec.denoiser_folders:
        expected = spec.components[name].model_class
        if index[name][1] != expected:
            return f"holds a {index[name][1]}, not model.family={family}'s {expected}"
    # the same denoiser class in another family's pipeline (FLUX.2 [dev] and [klein]): its index names that pipeline
    named = index.get("_class_name")
    owner = next((f for f, s in FAMILIES.items() if s.pipeline == named and f != family), None)
    if owner is not None and named != spec.pipeline:
        return f"holds a {named} (model.family={owner}), not model.family={family}'s {spec.pipeline}"
    for name in spec.components:
        try:
            json.loads((folder / name / "config.json").read_text())
        except FileNotFoundError:
            return f"has no {name}/config.json"
        except (OSError, ValueError) as err:
            return f"{name}/config.json is not readable JSON ({str(err).splitlines()[0]})"
    # the same pipeline and denoiser class around another VAE (Wan2.1's 16 latent channels, Wan2.2-TI2V's 48)
    channels, expected = _vae_channels(folder), _latent_channels(spec)
    if channels is not None and expected and channels not in expected:
        owner = next(
            (f for f, s in FAMILIES.items() if s.pipeline == spec.pipeline and channels in _latent_channels(s)), None
        )
        wanted = "/".join(map(str, sorted(expected)))
        holder = f" (model.family={owner})" if owner else ""
        return f"holds a {channels}-channel VAE{holder}, not model.family={family}'s {wanted}-channel one"
    return None


def _latent_channels(spec: FamilySpec) -> set[int]:
    """The VAE latent channels (``z_dim``) of a family's sizes; empty where its VAE config names none."""
    return {s.vae["z_dim"] for s in spec.sizes.values() if "z_dim" in s.vae}


def _vae_channels(folder: Path) -> int | None:
    """``z_dim`` of a pipeline folder's ``vae/config.json``, or None (none, or unreadable)."""
    try:
        channels = json.loads((folder / "vae" / "config.json").read_text()).get("z_dim")
    except (OSError, ValueError, AttributeError):
        return None
    return channels if isinstance(channels, int) else None


def _pixel_multiple(spec: FamilySpec, size: str, pretrained: str | None) -> int | None:
    """The side every resolution must be a multiple of where the configs say it (Wan's): the VAE's
    ``scale_factor_spatial`` times the transformer's spatial ``patch_size``, from the size table or the pretrained
    folder's JSON; None where they do not name both."""
    name = spec.denoiser_folders[0]
    if pretrained is None:
        vae, t = spec.size_config(size, "vae"), spec.size_config(size, name)
    else:
        vae, t = (json.loads((Path(pretrained) / n / "config.json").read_text()) for n in ("vae", name))
    scale, patch = vae.get("scale_factor_spatial"), t.get("patch_size")
    return scale * patch[-1] if isinstance(scale, int) and isinstance(patch, list | tuple) else None


def pipeline_family(folder: str | os.PathLike) -> str | None:
    """The family whose pipeline class a pipeline folder's ``model_index.json`` names, or None (no readable
    index, or a pipeline class no family runs)."""
    try:
        index = json.loads((Path(folder) / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    name = index.get("_class_name") if isinstance(index, dict) else None
    families = [family for family, spec in FAMILIES.items() if spec.pipeline == name]

    def present(folder: str) -> bool:  # diffusers writes [null, null] for an absent optional component
        entry = index.get(folder)
        return isinstance(entry, list) and bool(entry) and entry[0] is not None

    # WanPipeline runs Wan2.1 (one transformer), Wan2.2-A14B (transformer_2 too) and Wan2.2-TI2V-5B (one transformer,
    # the 48-channel Wan2.2 VAE, expand_timesteps): the families whose VAE latent channels the folder's VAE has, then
    # the most denoisers the folder has
    complete = [f for f in families if all(present(d) for d in FAMILIES[f].denoiser_folders)]
    channels = _vae_channels(Path(folder))
    fitting = [f for f in complete if channels is None or channels in (_latent_channels(FAMILIES[f]) or {channels})]
    return max(
        fitting or complete, key=lambda f: len(FAMILIES[f].denoiser_folders), default=families[0] if families else None
    )


def _load_components(
    spec: FamilySpec, folder: Path, dtype: torch.dtype, vae_dtype: torch.dtype | None = None
) -> tuple[dict, dict]:
    """Models and tokenizers from a diffusers pipeline folder, each with its own class's ``from_pretrained``, in
    ``dtype`` (the VAE in ``vae_dtype``, when given)."""
    index = json.loads((folder / "model_index.json").read_text())
    modules, tokenizers = {}, {}
    for name in spec.components:
        cls = component_classes(spec, name)[0]
        library, class_name = index[name]
        loaded_cls = getattr(importlib.import_module(library), class_name)
        if name in spec.denoiser_folders and not issubclass(loaded_cls, cls):
            raise ValueError(f"{folder}: {name} is {class_name}, not a {cls.__name__}")
        dtype_arg = "torch_dtype" if library == "diffusers" else "dtype"  # transformers 5 renamed it
        part_dtype = vae_dtype if name == "vae" and vae_dtype is not None else dtype
        modules[name] = loaded_cls.from_pretrained(folder / name, **{dtype_arg: part_dtype})
    for tokenizer_name in spec.tokenizers.values():
        library, class_name = index[tokenizer_name]
        tokenizers[tokenizer_name] = getattr(importlib.import_module(library), class_name).from_pretrained(
            folder / tokenizer_name
        )
    for name, processor in spec.processors.items():  # a multimodal processor: lean assembles it (processors.py)
        tokenizers[name] = load_processor(processor, folder / name)
    return modules, tokenizers


def _cache_folder(cache_dir: str | Path, model_cfg: ModelConfig, prompts: list[str]) -> Path:
    """Folder of a randomly initialised pipeline, keyed by everything its weights depend on."""
    import diffusers  # local: diffusers takes seconds to import (see component_classes)

    key = json.dumps(
        [
            model_cfg.family,
            model_cfg.size,
            model_cfg.text_max_length,
            sorted(set(prompts)),
            INIT_SEED,
            diffusers.__version__,
        ]
    )
    return Path(cache_dir) / f"{model_cfg.family}-{model_cfg.size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def lora_config(model_cfg: ModelConfig):
    """The peft ``LoraConfig`` of a LoRA run: rank, alpha, initialisation, targets (the family's set by default)."""
    from peft import LoraConfig  # local: peft imports transformers (seconds)

    return LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        lora_dropout=0.0,
        init_lora_weights=LORA_INITS[model_cfg.lora_init],
        target_modules=model_cfg.lora_targets or family_spec(model_cfg.family).lora_targets(model_cfg.lora_ffn),
    )


def build_policy(
    model_cfg: ModelConfig, prompts: list[str], device: torch.device | str = "cpu", cache_dir: str | Path | None = None
) -> Policy:
    """The policy for ``model_cfg``: loaded from ``model_cfg.pretrained`` (a diffusers pipeline folder, e.g. one
    written by :meth:`Policy.save_pretrained`), else randomly initialised at ``model_cfg.size`` with a fixed seed and
    a tokenizer trained on ``prompts`` (+ the empty prompt). With ``cache_dir`` a random build is saved there once
    and later builds load it through the pretrained path. Then LoRA (or full fine-tuning) is set up, and every part
    is cast to ``model_cfg.dtype`` on ``device``.
    """
    spec = family_spec(model_cfg.family)
    dtype, device = DTYPES[model_cfg.dtype], torch.device(device)
    folder = Path(model_cfg.pretrained) if model_cfg.pretrained else None
    if folder is None and cache_dir is not None:
        folder = _cache_folder(cache_dir, model_cfg, prompts)
        if not (folder / "model_index.json").exists():
            _write_cache(model_cfg, prompts, folder)
    if folder is not None:
        modules, tokenizers = _load_components(spec, folder, dtype, model_cfg.torch_vae_dtype)
    else:
        tokenizer = train_tokenizer([*prompts, ""], model_cfg.text_max_length, spec.special_tokens)
        tokenizer.chat_template = spec.chat_template  # FLUX.2's pipelines format prompts with it
        # Weights are drawn on the CPU (identical on every machine), except the published size: 12B parameters
        # take minutes to initialise on a CPU, so it is drawn on its device directly.
        init_device = device if model_cfg.size == DEVICE_INIT_SIZE else torch.device("cpu")
        modules = _random_components(spec, model_cfg.size, tokenizer, init_device)
        tokenizers = {name: tokenizer for name in spec.tokenizers.values()}
        tokenizers.update({name: random_processor(p, tokenizer) for name, p in spec.processors.items()})

    denoisers = {name: modules.pop(name) for name in spec.denoiser_folders}
    vae = modules.pop("vae")
    first = next(iter(denoisers.values()))
    arch = spec.runtime(
        first.config, vae.config, model_cfg.resolution, model_cfg.num_frames, **model_cfg.runtime_size()
    )
    reference = None
    if model_cfg.full_finetune:
        for net in denoisers.values():
            net.requires_grad_(True)
        reference = [copy.deepcopy(net).requires_grad_(False) for net in denoisers.values()]
    else:
        from peft import get_peft_model  # local: peft imports transformers (seconds)

        for k, (name, net) in enumerate(denoisers.items()):
            net.requires_grad_(False)
            with _seeded(INIT_SEED - 1 - k, net.device):  # LoRA A is drawn at random (B = 0), per denoiser
                denoisers[name] = get_peft_model(net, lora_config(model_cfg), autocast_adapter_dtype=False)
    vae.requires_grad_(False)
    for encoder in modules.values():
        encoder.requires_grad_(False)

    policy = Policy(
        model_cfg.family,
        arch,
        denoisers,
        vae,
        modules,
        tokenizers,
        model_cfg.text_max_length,
        spec.pipeline,
        device,
        dtype,
        reference_denoisers=reference,
        boundary=spec.boundary,
        vae_dtype=model_cfg.torch_vae_dtype,
        cfg_renorm=spec.cfg_renorm,
        resolution=model_cfg.resolution,
        reference_resolution=spec.sizes[model_cfg.size].reference_resolution,
        pipeline_config=spec.pipeline_config,
    )
    if folder is not None and not model_cfg.full_finetune and (folder / LORA_FILE).exists():
        policy.load_lora(folder / LORA_FILE)
    if dtype == torch.float64:
        keep_rms_norm_dtype(policy)
    policy.set_gradient_checkpointing(model_cfg.gradient_checkpointing)
    return policy


def _write_cache(model_cfg: ModelConfig, prompts: list[str], folder: Path) -> None:
    """Build the random pipeline in float32 and save it at ``folder`` atomically (concurrent builders may race)."""
    fresh = build_policy(dataclasses.replace(model_cfg, pretrained=None, dtype=dtype_name(torch.float32)), prompts)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    fresh.save_pretrained(tmp, adapter=False)  # base weights only; the adapter is set up per run
    try:
        os.rename(tmp, folder)
    except OSError:  # another process got there first
        shutil.rmtree(tmp)


def family_defaults(cfg: RunConfig) -> None:
    """The family's own defaults, set before any rule runs: an editing family (``reference_images``) given lean's
    default text prompts edits the bundled recolouring set (:data:`EDIT_PROMPTS`) instead."""
    from lean.config import DEFAULT_PROMPTS, prompts_of_file  # local: lean.config imports no domain module

    t = cfg.train
    if family_spec(cfg.model.family).reference_images and t.prompts_file is None and t.prompts == DEFAULT_PROMPTS:
        t.prompts_file = str(EDIT_PROMPTS)
        t.prompts = prompts_of_file("train.prompts_file", t.prompts_file)


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """The family's configuration rules (``lean.configure`` runs them): the size and frame count exist, the
    capabilities asked for are the family's, the pretrained folder holds a pipeline of it."""
    m, s = cfg.model, cfg.sample
    family = family_spec(m.family)
    if m.size not in family.sizes:
        raise ConfigError(
            "model.size", m.size, f"{m.family} comes in {', '.join(family.sizes)}" + suggest(m.size, family.sizes)
        )
    step = family.vae.temporal_compression  # video VAEs compress time: F = step k + 1 frames
    if step and (m.num_frames - 1) % step:
        raise ConfigError(
            "model.num_frames",
            m.num_frames,
            f"{family.display_name}'s VAE needs {step}k+1 frames (1, {1 + step}, {1 + 2 * step}, ...)",
        )
    if m.pretrained is not None and (problem := pretrained_problem(m.family, m.pretrained)) is not None:
        raise ConfigError("model.pretrained", m.pretrained, problem)
    if m.width is not None and not family.non_square:
        able = ", ".join(n for n, f in FAMILIES.items() if f.non_square)
        raise ConfigError(
            "model.width", m.width, f"{family.display_name} renders square frames (families with a width: {able})"
        )
    side = _pixel_multiple(family, m.size, m.pretrained)
    for key, pixels in (("model.resolution", m.resolution), ("model.width", m.width)):
        if side is not None and pixels is not None and pixels % side:  # Wan2.2-TI2V's 16x VAE, 2x2 patches: 32
            raise ConfigError(
                key, pixels, f"{family.display_name} needs a multiple of {side} pixels (VAE compression x patch)"
            )
    if s.guidance_scale_2 is not None and family.boundary is None:
        raise ConfigError(
            "sample.guidance_scale_2",
            s.guidance_scale_2,
            f"is the low-noise expert's CFG scale; {family.display_name} has one denoiser (set null)",
        )
    prompt_sets = [("train.prompts_file", cfg.train.prompts_file, cfg.train.prompts)]
    if cfg.eval.prompts is not None:
        prompt_sets.append(("eval.prompts_file", cfg.eval.prompts_file, cfg.eval.prompts))
    for key, file, prompts in prompt_sets:
        edits = sum(reference_image(p) is not None for p in prompts)
        if family.reference_images and edits < len(prompts):
            raise ConfigError(
                key,
                file,
                f"{family.display_name} edits reference images: every prompt needs one (a .jsonl prompt file whose "
                f'lines carry an "image" path beside the "prompt"); {len(prompts) - edits} of {len(prompts)} have none',
            )
        if edits and not family.reference_images:
            editing = [n for n, f in FAMILIES.items() if f.reference_images]
            raise ConfigError(
                key,
                file,
                f"{edits} prompts carry a reference image, which model.family={m.family} cannot take "
                f"(editing families: {', '.join(editing)})",
            )
    if s.guidance_embed is not None and not family.guidance_embed:
        raise ConfigError(
            "sample.guidance_embed",
            s.guidance_embed,
            f"model.family={m.family} has no distilled-guidance embedding (only FLUX has one)",
        )
    if cfg.parallel.shard == FSDP and m.full_finetune and m.torch_dtype in HALF and family.keeps_float32:
        raise ConfigError(
            "parallel.shard",
            cfg.parallel.shard,
            f"a half-precision full fine-tune of {m.family} keeps float32 modules FSDP would gather at {m.dtype}",
        )
