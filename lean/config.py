"""Typed run configuration: ``params.yaml`` + ``--preset`` + ``--set`` overrides -> :class:`RunConfig`.

Everything downstream takes a ``RunConfig`` (or one of its sections), never a raw dict.
Every error is a :class:`ConfigError` whose message is one line naming the key, the value
and what is allowed; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration value. ``str(err)`` is a single line meant for the user."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config error: {key}={value!r}: {allowed}")


DEFAULT_PROMPTS = [
    "a red circle on a white background",
    "a green square on a black background",
    "a blue triangle on a yellow background",
    "a yellow circle on a blue background",
    "a white square on a red background",
    "a black triangle on a green background",
    "a magenta circle on a cyan background",
    "a cyan square on a magenta background",
]


@dataclass
class ModelConfig:
    family: str = "flux"  # flux | wan | sd3
    size: str = "tiny"  # tiny | small | medium (GPU bench) | full (published); see lean/models/<family>.py
    pretrained: str | None = None  # local diffusers folder, loaded with from_pretrained
    resolution: int = 32  # image side in pixels
    num_frames: int = 5  # video frames (wan only); Wan's VAE wants 4k+1
    dtype: str = "float32"  # float32 | float64 | bfloat16 | float16
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_ffn: bool = False  # also adapt the feed-forward projections (FlowGRPO does for FLUX)
    full_finetune: bool = False
    text_max_length: int = 16


@dataclass
class SampleConfig:
    num_steps: int = 10
    shift: float = 3.0  # FlowMatchEulerDiscreteScheduler shift
    sigma_grid: str = "euler"  # euler (SD3Pipeline) | uniform (FluxPipeline, DanceGRPO) | unipc (WanPipeline)
    sde_kind: str = "flow_grpo"  # flow_grpo | flow_grpo_linear (FlowGRPO's Wan) | cps | dance
    noise_level: float = 0.7
    cfg: bool = True  # true classifier-free guidance: one [uncond, cond] batch
    guidance_scale: float = 4.5
    guidance_embed: float | None = None  # FLUX-style distilled guidance instead of CFG
    uncond_grad: bool = False  # true: differentiate the unconditional CFG branch too (FlowGRPO's training does)
    timestep_fraction: float = 0.99  # share of steps trained; last step never trained
    timestep_selection: str = "first"  # first (FlowGRPO) | random (DanceGRPO, per sample)
    sde_window: int = 0  # FlowGRPO-Fast: >0 -> only a window of this many steps is stochastic
    sde_window_max_start: int | None = None  # window starts in [0, this]; default: first half


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"color_match": 1.0})


@dataclass
class TrainConfig:
    schedule: str = "recompute"  # recompute | retain | reweight | auto
    iterations: int = 3
    prompts_per_iteration: int = 2  # groups per iteration, across all processes
    group_size: int = 4  # samples per prompt (k)
    rollout_batch_size: int = 8  # samples per forward during rollout, per process
    train_batch_size: int = 8  # samples per forward during the Recompute update, per process
    optimizer_steps_per_iteration: int = 1  # >1 is off-policy (FlowGRPO's gradient accumulation)
    num_inner_epochs: int = 1
    lr: float = 1e-4
    weight_decay: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    global_std: bool = False
    beta: float = 0.0  # KL weight
    ema: bool = False
    ema_decay: float = 0.9
    ema_every: int = 8
    memory_budget_mb: float | None = None  # for schedule=auto; default: what the device has
    seed: int = 42
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    out: str = "outputs/train"
    dist_timeout_s: float = 60.0  # every process-group operation fails after this instead of hanging
    save_every: int = 0  # checkpoint every N iterations into <out>/checkpoints (0: off)
    keep_checkpoints: int = 2
    on_nonfinite: str = "abort"  # abort | skip: what a non-finite reward, log-prob, loss or gradient does


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def samples_per_iteration(self) -> int:
        return self.train.prompts_per_iteration * self.train.group_size


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
_SECTION_TYPES = {
    "model": ModelConfig,
    "sample": SampleConfig,
    "reward": RewardConfig,
    "train": TrainConfig,
}

ON_POLICY_SCHEDULES = ("retain", "reweight", "auto")


# ---------------------------------------------------------------- parsing


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints widen to floats, nothing else)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, value, "must be true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(key, value, "must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(key, value, "must be a finite number")
            return float(value)
        raise ConfigError(key, value, "must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "must be a string")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, value, "must be a list")
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a mapping")
        return {
            _coerce(f"{key} key", k, args[0]): _coerce(f"{key}.{k}", v, args[1])
            for k, v in value.items()
        }
    raise TypeError(f"unsupported annotation {tp} for {key}")


def _build_section(name: str, raw: Any):
    cls = _SECTION_TYPES[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(name, raw, "must be a mapping of keys")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"{name}.{key}", value, "unknown key" + _suggest(key, hints))
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """``--set k=v`` values are YAML scalars/flow collections: 1, 0.5, true, null, [a, b]."""
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one dotted override ``section.key=value`` to a raw config tree in place."""
    if "=" not in assignment:
        raise ConfigError(assignment, None, "an override must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    if parts[0] not in _SECTION_TYPES:
        raise ConfigError(dotted, text, "unknown section" + _suggest(parts[0], _SECTION_TYPES))
    if len(parts) < 2:
        raise ConfigError(dotted, text, "name a key inside the section, e.g. train.lr=1e-4")
    node = tree.setdefault(parts[0], {}) or {}
    tree[parts[0]] = node
    for p in parts[1:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = _parse_scalar(text)


PRESET_DIR = Path(__file__).parent / "presets"


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "weights":
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_tree(params: str | os.PathLike | None = None, section: str | None = None) -> dict:
    """Read the raw run tree from a params file; ``section`` picks a sub-tree (e.g. the DVC ``run``)."""
    if params is None:
        return {}
    path = Path(params)
    if not path.exists():
        raise ConfigError("--params", str(path), "file does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError("--params", str(path), f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError("--params", str(path), "must hold a mapping")
    # params.yaml also carries the DVC stages' own sections; only the run sections go in.
    return {k: v for k, v in tree.items() if k in _SECTION_TYPES}


def load_config(
    params: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    preset: str | None = None,
    tree: dict | None = None,
) -> RunConfig:
    """``params.yaml`` (or ``tree``), then the preset on top, then ``--set`` overrides; validated."""
    raw = dict(tree) if tree is not None else load_tree(params)
    if preset is not None:
        path = PRESET_DIR / f"{preset}.yaml"
        if not path.exists():
            raise ConfigError("--preset", preset, "unknown preset" + _suggest(preset, list_presets())
                              + f"; known: {', '.join(list_presets())}")
        raw = _deep_merge(raw, yaml.safe_load(path.read_text()) or {})
    raw = _deep_merge({}, raw)
    for item in overrides:
        apply_override(raw, item)
    for name in raw:
        if name not in _SECTION_TYPES:
            raise ConfigError(name, raw[name], "unknown section" + _suggest(name, _SECTION_TYPES))
    cfg = RunConfig(**{name: _build_section(name, raw.get(name)) for name in _SECTION_TYPES})
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation


def _choice(key: str, value: Any, options) -> None:
    if value not in options:
        raise ConfigError(key, value, f"must be one of {', '.join(map(str, options))}" + _suggest(str(value), options))


def _positive(key: str, value: float, strict: bool = True) -> None:
    if (value <= 0) if strict else (value < 0):
        raise ConfigError(key, value, "must be > 0" if strict else "must be >= 0")


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Raise :class:`ConfigError` on the first bad value. ``world_size`` checks divisibility."""
    from lean.sde import SDE_KINDS, SIGMA_GRIDS  # local: keep config importable without torch at parse time

    m, s, r, t = cfg.model, cfg.sample, cfg.reward, cfg.train
    _choice("model.family", m.family, ("flux", "wan", "sd3"))
    _choice("model.size", m.size, ("tiny", "small", "medium", "full"))
    if m.size == "medium" and m.family != "flux":
        raise ConfigError("model.size", m.size, "medium (the GPU benchmark size) exists for model.family=flux only")
    _choice("model.dtype", m.dtype, ("float32", "float64", "bfloat16", "float16"))
    _positive("model.resolution", m.resolution)
    if m.resolution % 16:
        raise ConfigError("model.resolution", m.resolution, "must be a multiple of 16")
    _positive("model.num_frames", m.num_frames)
    if m.family == "wan" and (m.num_frames - 1) % 4:
        raise ConfigError("model.num_frames", m.num_frames, "Wan's VAE needs 4k+1 frames (1, 5, 9, ...)")
    _positive("model.lora_rank", m.lora_rank)
    _positive("model.lora_alpha", m.lora_alpha)
    _positive("model.text_max_length", m.text_max_length)
    if m.pretrained is not None:
        p = Path(m.pretrained)
        if not (p / "model_index.json").exists() and not (p / "transformer" / "config.json").exists():
            raise ConfigError("model.pretrained", m.pretrained,
                              "must be a local diffusers folder (with model_index.json or transformer/config.json)")

    _positive("sample.num_steps", s.num_steps)
    if s.num_steps < 2:
        raise ConfigError("sample.num_steps", s.num_steps, "must be >= 2 (the last step is never trained)")
    _positive("sample.shift", s.shift)
    _choice("sample.sigma_grid", s.sigma_grid, SIGMA_GRIDS)
    _choice("sample.sde_kind", s.sde_kind, SDE_KINDS)
    if s.sde_kind == "flow_grpo" and s.sigma_grid == "unipc":
        raise ConfigError("sample.sigma_grid", s.sigma_grid, "starts at 1 - 1e-6, where flow_grpo's noise scale "
                          "sqrt(sigma/(1-sigma)) is ~1000: use sample.sde_kind=flow_grpo_linear (FlowGRPO's Wan SDE)")
    _positive("sample.noise_level", s.noise_level)
    if s.sde_kind == "cps" and s.noise_level > 1:
        raise ConfigError("sample.noise_level", s.noise_level, "cps needs noise_level in (0, 1]")
    _positive("sample.guidance_scale", s.guidance_scale, strict=False)
    if s.guidance_embed is not None:
        _positive("sample.guidance_embed", s.guidance_embed, strict=False)
        if s.cfg:
            raise ConfigError("sample.guidance_embed", s.guidance_embed,
                              "distilled guidance replaces CFG: set sample.cfg=false")
        if m.family != "flux":
            raise ConfigError("sample.guidance_embed", s.guidance_embed, "only FLUX has a guidance embedding")
    if not 0 < s.timestep_fraction <= 1:
        raise ConfigError("sample.timestep_fraction", s.timestep_fraction, "must be in (0, 1]")
    _choice("sample.timestep_selection", s.timestep_selection, ("first", "random"))
    _positive("sample.sde_window", s.sde_window, strict=False)
    if s.sde_window > s.num_steps - 1:
        raise ConfigError("sample.sde_window", s.sde_window,
                          f"must be <= sample.num_steps - 1 = {s.num_steps - 1}")
    if s.sde_window_max_start is not None:
        if not 0 <= s.sde_window_max_start <= s.num_steps - 1 - s.sde_window:
            raise ConfigError("sample.sde_window_max_start", s.sde_window_max_start,
                              f"must be in [0, num_steps - 1 - sde_window = {s.num_steps - 1 - s.sde_window}]")

    from lean.rewards import REWARDS

    if not r.weights:
        raise ConfigError("reward.weights", r.weights, "name at least one reward")
    for name in r.weights:
        if name not in REWARDS:
            raise ConfigError(f"reward.weights.{name}", r.weights[name],
                              f"unknown reward; known: {', '.join(sorted(REWARDS))}" + _suggest(name, REWARDS))

    _choice("train.schedule", t.schedule, ("recompute", "retain", "reweight", "auto"))
    for key in ("iterations", "prompts_per_iteration", "rollout_batch_size", "train_batch_size",
                "optimizer_steps_per_iteration", "num_inner_epochs", "ema_every"):
        _positive(f"train.{key}", getattr(t, key))
    if t.group_size < 2:
        raise ConfigError("train.group_size", t.group_size, "must be >= 2 (advantages are relative to the group)")
    for key in ("lr", "clip_range", "adv_clip_max", "max_grad_norm", "adam_eps"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.dist_timeout_s", t.dist_timeout_s)
    _positive("train.save_every", t.save_every, strict=False)
    _positive("train.keep_checkpoints", t.keep_checkpoints)
    _choice("train.on_nonfinite", t.on_nonfinite, ("abort", "skip"))
    for key in ("weight_decay", "beta"):
        _positive(f"train.{key}", getattr(t, key), strict=False)
    for key in ("adam_beta1", "adam_beta2", "ema_decay"):
        v = getattr(t, key)
        if not 0 <= v < 1:
            raise ConfigError(f"train.{key}", v, "must be in [0, 1)")
    if t.memory_budget_mb is not None:
        _positive("train.memory_budget_mb", t.memory_budget_mb)
    if not t.prompts:
        raise ConfigError("train.prompts", t.prompts, "needs at least one prompt")

    n = cfg.samples_per_iteration
    if n % world_size:
        raise ConfigError("train.prompts_per_iteration", t.prompts_per_iteration,
                          f"prompts_per_iteration x group_size = {n} samples must divide over {world_size} processes")
    local = n // world_size
    if t.schedule in ON_POLICY_SCHEDULES:
        bad = []
        if t.optimizer_steps_per_iteration != 1:
            bad.append(f"train.optimizer_steps_per_iteration={t.optimizer_steps_per_iteration} (set 1)")
        if t.num_inner_epochs != 1:
            bad.append(f"train.num_inner_epochs={t.num_inner_epochs} (set 1)")
        if bad:
            raise ConfigError("train.schedule", t.schedule,
                              "is exact only on-policy (one optimizer step per rollout batch); change "
                              + " and ".join(bad) + ", or use train.schedule=recompute")
    if local % t.optimizer_steps_per_iteration:
        raise ConfigError("train.optimizer_steps_per_iteration", t.optimizer_steps_per_iteration,
                          f"must divide the {local} samples each process holds")
