"""A :class:`~lean.models.policy.Policy` built from its family's spec: :func:`build_policy` loads a diffusers
pipeline folder (``model.pretrained``, or a cached random build) or draws every component at random from fixed seeds
(:data:`INIT_SEED`), builds the family's runtime (:func:`build_runtime`) and sets up LoRA (:func:`lora_config`) or full
fine-tuning. The family's components are imported by name here, when a model is built (:func:`component_classes`)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lean.config.dtypes import DTYPES, dtype_name
from lean.models.policy import LORA_FILE, Policy, PolicyParts
from lean.models.precision import keep_rms_norm_dtype
from lean.models.processors import load_processor, random_processor
from lean.models.registry import LORA_INITS, family_spec
from lean.models.spec import FamilyRuntime, FamilySpec, is_published
from lean.models.text import train_tokenizer

if TYPE_CHECKING:
    from lean.models.options import ModelConfig

INIT_SEED = 20240601  # every process draws the same random weights


PIPELINE_MODULES = "diffusers.pipelines."  # where a pipeline's own modules live


def library_module(library: str):
    """The module a library name means: a package or module path (diffusers, transformers,
    diffusers.pipelines.ltx2), else, as diffusers reads model_index.json, a pipeline's own module under
    diffusers.pipelines (LTX-2's "ltx2": its text connectors, its vocoder)."""
    if library in ("diffusers", "transformers") or "." in library:
        return importlib.import_module(library)
    return importlib.import_module(PIPELINE_MODULES + library)


def component_classes(spec: FamilySpec, name: str) -> tuple[type, type | None]:
    """(model class, transformers config class or None) of component ``name`` of a family."""
    component = spec.components[name]
    module = library_module(component.library)
    config_class = component.config_class
    return getattr(module, component.model_class), (getattr(module, config_class) if config_class else None)


def import_components(family: str) -> None:
    """Import what building ``family`` imports (its components' libraries, peft: seconds of CPU), building nothing: a
    process that forks its runs pays the imports once (``lean.workbench.side_by_side``)."""
    spec = family_spec(family)
    for name in spec.components:
        component_classes(spec, name)
    import peft  # noqa: F401  (LoRA)


def build_runtime(spec: FamilySpec, transformer_config, vae_config, model_cfg: ModelConfig) -> FamilyRuntime:
    """The family's runtime for the run's geometry (``model.resolution``, ``num_frames``, ``width``) from the
    (first) denoiser's and the VAE's configs."""
    size = model_cfg.runtime_size()
    return spec.runtime(transformer_config, vae_config, model_cfg.resolution, model_cfg.num_frames, **size)


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


def _drawn_components(
    spec: FamilySpec, model_cfg: ModelConfig, prompts: list[str], device: torch.device
) -> tuple[dict, dict]:
    """(models, tokenizers) of a random build at ``model.size``: a word-level tokenizer trained on ``prompts`` (+ the
    empty prompt) shared by every text encoder, and every component from its own seed (:func:`_random_components`)."""
    tokenizer = train_tokenizer([*prompts, ""], model_cfg.text_max_length, spec.special_tokens)
    tokenizer.chat_template = spec.chat_template  # FLUX.2's pipelines format prompts with it
    # Weights are drawn on the CPU (identical on every machine), except the published size: 12B parameters take
    # minutes to initialise on a CPU, so it is drawn on its device directly.
    init_device = device if is_published(model_cfg.size) else torch.device("cpu")  # a published size: on the device
    modules = _random_components(spec, model_cfg.size, tokenizer, init_device)
    tokenizers = {name: tokenizer for name in spec.tokenizers.values()}
    tokenizers.update({name: random_processor(p, tokenizer) for name, p in spec.processors.items()})
    return modules, tokenizers


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
        loaded_cls = getattr(library_module(library), class_name)
        if name in spec.denoiser_folders and not issubclass(loaded_cls, cls):
            raise ValueError(f"{folder}: {name} is {class_name}, not a {cls.__name__}")
        dtype_arg = "dtype" if library == "transformers" else "torch_dtype"  # transformers 5 renamed it
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
    import diffusers  # local: diffusers takes seconds to import

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


def _pipeline_folder(model_cfg: ModelConfig, prompts: list[str], cache_dir: str | Path | None) -> Path | None:
    """The pipeline folder a build loads: ``model.pretrained``, else with ``cache_dir`` the cached random build
    (written on first use, :func:`_write_cache`); None: the build draws its weights."""
    if model_cfg.pretrained:
        return Path(model_cfg.pretrained)
    if cache_dir is None:
        return None
    folder = _cache_folder(cache_dir, model_cfg, prompts)
    if not (folder / "model_index.json").exists():
        _write_cache(model_cfg, prompts, folder)
    return folder


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


def _policy_parts(spec: FamilySpec, modules: dict, tokenizers: dict, model_cfg: ModelConfig) -> PolicyParts:
    """``modules`` (every component, by folder) as a policy's parts, with the training set up: full fine-tuning
    trains the denoisers and keeps frozen copies of them as the reference; LoRA wraps each denoiser in peft (A drawn
    from its own seed, B = 0). The VAE and the text encoders are frozen."""
    denoisers = {name: modules.pop(name) for name in spec.denoiser_folders}
    vae = modules.pop("vae")
    reference = None
    if model_cfg.full_finetune:
        for net in denoisers.values():
            net.requires_grad_(True)
        reference = [copy.deepcopy(net).requires_grad_(False) for net in denoisers.values()]
    else:
        from peft import get_peft_model  # local: peft imports transformers (seconds)

        for k, (name, net) in enumerate(denoisers.items()):
            net.requires_grad_(False)
            # on the meta device (lean plan's count) the adapter is made there too: peft would draw it on the CPU
            # first (seconds for a published size's); elsewhere it is drawn on the CPU as before, the same everywhere
            made_on = torch.device("meta") if net.device.type == "meta" else nullcontext()
            with _seeded(INIT_SEED - 1 - k, net.device), made_on:  # LoRA A is drawn at random (B = 0), per denoiser
                denoisers[name] = get_peft_model(net, lora_config(model_cfg), autocast_adapter_dtype=False)
    vae.requires_grad_(False)
    for encoder in modules.values():
        encoder.requires_grad_(False)
    return PolicyParts(denoisers, vae, modules, tokenizers, reference)


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
    device = torch.device(device)
    folder = _pipeline_folder(model_cfg, prompts, cache_dir)
    if folder is not None:
        modules, tokenizers = _load_components(spec, folder, DTYPES[model_cfg.dtype], model_cfg.torch_vae_dtype)
    else:
        modules, tokenizers = _drawn_components(spec, model_cfg, prompts, device)
    runtime = build_runtime(spec, modules[spec.denoiser_folders[0]].config, modules["vae"].config, model_cfg)
    policy = Policy(spec, runtime, _policy_parts(spec, modules, tokenizers, model_cfg), model_cfg, device)
    if folder is not None and not model_cfg.full_finetune and (folder / LORA_FILE).exists():
        policy.load_lora(folder / LORA_FILE)
    if policy.dtype == torch.float64:
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
