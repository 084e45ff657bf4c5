"""A family's size read from its configs, nothing built or only on the meta device: the denoiser's parameters
(:func:`count_parameters`, :func:`meta_transformer`), a component's whole config (:func:`component_config`), its
blocks (:func:`transformer_blocks`) and the least a tracked step keeps for its backward (:func:`tracked_step_floor`)."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lean.config.dtypes import DTYPES
from lean.models.build import build_runtime, component_classes
from lean.models.registry import family_spec
from lean.models.spec import FamilySpec

if TYPE_CHECKING:
    from lean.models.options import ModelConfig


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


def transformer_blocks(spec: FamilySpec, config) -> int:
    """Blocks of a transformer config (:func:`component_config`): the sum of its ``FamilySpec.block_counts`` fields
    (FLUX: double- and single-stream)."""
    return sum(config.get(field, 0) for field in spec.block_counts)


def tracked_step_floor(model_cfg: ModelConfig) -> tuple[int, str]:
    """A lower bound of the bytes one trajectory's tracked transformer step saves for its backward, from the configs
    alone: every block keeps at least its input, [tokens, width] at ``model.dtype``. Every schedule tracks at least
    one such step (Recompute in its update). Returns (bytes, the product spelled out)."""
    spec = family_spec(model_cfg.family)
    t = component_config(spec, spec.denoiser_folders[0], model_cfg.size, model_cfg.pretrained)
    vae = component_config(spec, "vae", model_cfg.size, model_cfg.pretrained)
    runtime = build_runtime(spec, t, vae, model_cfg)
    # heads x head width; a config that names the width itself (ZImageTransformer2DModel's ``dim``) gives it
    width = t["dim"] if "dim" in t else t["num_attention_heads"] * t["attention_head_dim"]
    blocks = transformer_blocks(spec, t)
    size = DTYPES[model_cfg.dtype].itemsize
    tokens = runtime.image_seq_len
    return tokens * width * blocks * size, f"{tokens:,} tokens x width {width} x {blocks} blocks x {size} bytes"
