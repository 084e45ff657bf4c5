"""Model families behind one :class:`Policy`: ``build_policy(model_cfg, prompts)`` and ``count_parameters``.

A family is a module (``lean/models/<family>.py``) declaring ``SIZES`` (per-size configs of each component),
``COMPONENTS`` (folder -> model class, config class), ``TOKENIZERS``, ``PIPELINE``, ``lora_targets(ffn)`` and a
runtime class implementing :class:`lean.models.policy.Family`. Family modules import diffusers, so they are
imported on first use only.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from lean.config import ModelConfig
from lean.models.policy import LORA_FILE, Policy
from lean.models.precision import keep_rms_norm_dtype
from lean.models.text import PromptEmbeds, train_tokenizer

__all__ = ["FAMILIES", "Policy", "PromptEmbeds", "build_policy", "count_parameters", "family_module"]

# family name -> (module, runtime class name)
FAMILIES = {
    "flux": ("lean.models.flux", "Flux"),
    "wan": ("lean.models.wan", "Wan"),
    "sd3": ("lean.models.sd3", "SD3"),
}
INIT_SEED = 20240601  # every process draws the same random weights
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def family_module(family: str) -> ModuleType:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[family][0])


def count_parameters(family: str, size: str) -> int:
    """Parameters of the family's transformer at ``size``, built on the meta device (no memory, no init)."""
    from accelerate import init_empty_weights

    spec = family_module(family)
    with init_empty_weights(include_buffers=True):  # buffers too: SD3.5's 384x384 position table takes 20 s on CPU
        model = spec.COMPONENTS["transformer"][0](**spec.SIZES[size]["transformer"])
    return sum(p.numel() for p in model.parameters())


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Random draws inside come from ``seed`` (on ``device``); the caller's RNG state is restored afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _random_components(spec: ModuleType, size: str, tokenizer, device: torch.device) -> dict[str, torch.nn.Module]:
    """Every component of ``spec`` at ``size``, drawn on ``device``, each from its own seed so that e.g. the
    transformer does not depend on the vocabulary size of the text encoders."""
    modules = {}
    for k, (name, (cls, config_cls)) in enumerate(spec.COMPONENTS.items()):
        arch = spec.SIZES[size][name]
        with torch.device(device), _seeded(INIT_SEED + k, device):
            if config_cls is None:
                modules[name] = cls(**arch)
            else:  # a transformers text encoder sized by ``arch``, vocabulary from the tokenizer
                modules[name] = cls(config_cls(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                               **arch))
    return modules


def _load_components(spec: ModuleType, folder: Path, dtype: torch.dtype) -> tuple[dict, dict]:
    """Models and tokenizers from a diffusers pipeline folder, each with its own class's ``from_pretrained``."""
    index = json.loads((folder / "model_index.json").read_text())
    modules, tokenizers = {}, {}
    for name, (cls, _) in spec.COMPONENTS.items():
        library, class_name = index[name]
        loaded_cls = getattr(importlib.import_module(library), class_name)
        if name == "transformer" and not issubclass(loaded_cls, cls):
            raise ValueError(f"{folder}: transformer is {class_name}, not a {cls.__name__}")
        dtype_arg = "torch_dtype" if library == "diffusers" else "dtype"  # transformers 5 renamed it
        modules[name] = loaded_cls.from_pretrained(folder / name, **{dtype_arg: dtype})
    for tokenizer_name in spec.TOKENIZERS.values():
        library, class_name = index[tokenizer_name]
        tokenizers[tokenizer_name] = getattr(importlib.import_module(library), class_name).from_pretrained(
            folder / tokenizer_name)
    return modules, tokenizers


def _cache_folder(cache_dir: str | Path, model_cfg: ModelConfig, prompts: list[str]) -> Path:
    """Folder of a randomly initialised pipeline, keyed by everything its weights depend on."""
    import diffusers

    key = json.dumps([model_cfg.family, model_cfg.size, model_cfg.text_max_length, sorted(set(prompts)),
                      INIT_SEED, diffusers.__version__])
    return Path(cache_dir) / f"{model_cfg.family}-{model_cfg.size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def build_policy(model_cfg: ModelConfig, prompts: list[str], device: torch.device | str = "cpu",
                 cache_dir: str | Path | None = None) -> Policy:
    """The policy for ``model_cfg``: loaded from ``model_cfg.pretrained`` (a diffusers pipeline folder, e.g. one
    written by :meth:`Policy.save_pretrained`), else randomly initialised at ``model_cfg.size`` with a fixed seed and
    a tokenizer trained on ``prompts`` (+ the empty prompt). With ``cache_dir`` a random build is saved there once
    and later builds load it through the pretrained path. Then LoRA (or full fine-tuning) is set up, and every part
    is cast to ``model_cfg.dtype`` on ``device``.
    """
    spec = family_module(model_cfg.family)
    dtype, device = DTYPES[model_cfg.dtype], torch.device(device)
    folder = Path(model_cfg.pretrained) if model_cfg.pretrained else None
    if folder is None and cache_dir is not None:
        folder = _cache_folder(cache_dir, model_cfg, prompts)
        if not (folder / "model_index.json").exists():
            _write_cache(model_cfg, prompts, folder)
    if folder is not None:
        modules, tokenizers = _load_components(spec, folder, dtype)
    else:
        tokenizer = train_tokenizer([*prompts, ""], model_cfg.text_max_length)
        # Weights are drawn on the CPU (identical on every machine), except the published size: 12B parameters
        # take minutes to initialise on a CPU, so it is drawn on its device directly.
        init_device = device if model_cfg.size == "full" else torch.device("cpu")
        modules = _random_components(spec, model_cfg.size, tokenizer, init_device)
        tokenizers = {name: tokenizer for name in spec.TOKENIZERS.values()}

    transformer = modules.pop("transformer")
    vae = modules.pop("vae")
    arch = getattr(spec, FAMILIES[model_cfg.family][1])(transformer.config, vae.config, model_cfg.resolution,
                                                        model_cfg.num_frames)
    reference = None
    if model_cfg.full_finetune:
        transformer.requires_grad_(True)
        reference = copy.deepcopy(transformer).requires_grad_(False)
    else:
        from peft import LoraConfig, get_peft_model

        transformer.requires_grad_(False)
        lora = LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=0.0,
                          target_modules=spec.lora_targets(model_cfg.lora_ffn))
        with _seeded(INIT_SEED - 1, transformer.device):  # LoRA A is drawn at random (B = 0)
            transformer = get_peft_model(transformer, lora, autocast_adapter_dtype=False)
    vae.requires_grad_(False)
    for encoder in modules.values():
        encoder.requires_grad_(False)

    policy = Policy(model_cfg.family, arch, transformer, vae, modules, tokenizers, model_cfg.text_max_length,
                    spec.PIPELINE, device, dtype, reference_transformer=reference)
    if folder is not None and not model_cfg.full_finetune and (folder / LORA_FILE).exists():
        policy.load_lora(folder / LORA_FILE)
    if dtype == torch.float64:
        keep_rms_norm_dtype(policy)
    return policy


def _write_cache(model_cfg: ModelConfig, prompts: list[str], folder: Path) -> None:
    """Build the random pipeline in float32 and save it at ``folder`` atomically (concurrent builders may race)."""
    fresh = build_policy(ModelConfig(family=model_cfg.family, size=model_cfg.size,
                                     text_max_length=model_cfg.text_max_length), prompts)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    fresh.save_pretrained(tmp, adapter=False)  # base weights only; the adapter is set up per run
    try:
        os.rename(tmp, folder)
    except OSError:  # another process got there first
        shutil.rmtree(tmp)
