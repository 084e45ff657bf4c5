"""Typed run configuration: ``params.yaml`` + ``--preset`` + a stage's ``run:`` + ``--set`` -> :class:`RunConfig`.

Everything downstream takes a ``RunConfig`` (or one of its sections), never a raw dict. This module is the bottom of
the house: it imports nothing from lean but the registry and small leaf modules (``tests/test_architecture.py``).

* Each section documents and checks its own fields (``validate``). A field that names something (a schedule, a
  model family, an SDE kind, ...) is a :func:`choice` of the registry of that kind (``lean.config.registry.CATALOG``),
  which the module that owns the names declares.
* The rules that span sections live with their owners (the family's in ``lean.models``, the layout's in
  ``lean.parallel.layout``, sequence parallelism's in ``lean.models.sequence_parallel``, ...); ``lean.configure``
  composes them in one small function and :func:`lean.configure.load_config` runs it after :func:`read_config`.
* Every error is a :class:`ConfigError` whose message is one line naming the key, the value and what is allowed (a
  did-you-mean where a name is close); the CLI prints it and exits with status 2. A key that moved answers with its
  new place (:data:`MOVED`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lean.config.dtypes import DTYPES, or_model
from lean.config.presets import PRESETS
from lean.config.prompts import read_prompts
from lean.config.registry import catalog


class ConfigError(ValueError):
    """A bad configuration value. ``str(err)`` is a single line meant for the user."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config error: {key}={value!r}: {allowed}")


# ---------------------------------------------------------------- checks shared by the sections


def suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(key: str, value: Any, options: Iterable[str]) -> None:
    options = list(options)
    if value not in options:
        raise ConfigError(key, value, f"must be one of {', '.join(map(str, options))}" + suggest(str(value), options))


def check_positive(key: str, value: float, strict: bool = True) -> None:
    if (value <= 0) if strict else (value < 0):
        raise ConfigError(key, value, "must be > 0" if strict else "must be >= 0")


def check_fraction(key: str, value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(key, value, "must be in [0, 1)")


def prompts_of_file(key: str, path: str) -> list[str]:
    """``lean.config.prompts.read_prompts(path)``; a missing, empty or malformed file is a config error of ``key``."""
    try:
        return read_prompts(path)
    except (OSError, ValueError) as err:
        raise ConfigError(key, path, str(err)) from None


def choice(kind: str, default: str | None = None, *, also: tuple[str, ...] = ()) -> Any:
    """A field whose value is a name of the registry of ``kind`` (``lean.config.registry.CATALOG``) or one of ``also``;
    its default is ``default``, or None: the registry's own (its first name, so a name is spelled in its owner only)."""
    metadata = {"registry": kind, "also": also}
    if default is not None:
        return field(default=default, metadata=metadata)
    return field(default_factory=functools.partial(_registry_default, kind), metadata=metadata)


def _registry_default(kind: str) -> str:
    return catalog(kind).default


def choices(section: Any, prefix: str) -> None:
    """Check every :func:`choice` field of ``section`` against its registry (keys ``<prefix>.<field>``)."""
    for f in dataclasses.fields(section):
        if "registry" in f.metadata:
            allowed = [*catalog(f.metadata["registry"]), *f.metadata["also"]]
            check_choice(f"{prefix}.{f.name}", getattr(section, f.name), allowed)


MODEL_DTYPE = "model"  # model.vae_dtype, sample.latent_dtype: model.dtype's
AUTO = "auto"  # train.schedule: lean picks the fastest predicted schedule that fits (lean.schedules); layouts too


# ---------------------------------------------------------------- sections


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


@dataclass
class SampleConfig:
    """The sampler: sigma grid, SDE, guidance, and which steps are stochastic and trained."""

    num_steps: int = 10
    """Sampling steps per trajectory (FlowGRPO trains with 10)."""
    shift: float | None = None
    """Time shift of the sigma grid (FlowMatchEulerDiscreteScheduler's ``shift``, Wan's ``flow_shift``). None: from
    ``model.pretrained``'s ``scheduler/scheduler_config.json``, else the family's published scheduler config; a
    dynamically shifting one (FLUX.1) gives e^mu at the run's image token count (``lean.models.time_shift``). The run
    logs the resolved value."""
    sigma_grid: str = choice("sigma grid")
    """Sigma grid of a published pipeline: a name of ``lean.sampling.sde.SIGMA_GRIDS``."""
    shift_terminal: float | None = None
    """Stretch the shifted grid so that its last non-zero sigma is this value (a scheduler config's
    ``shift_terminal``: Qwen-Image's 0.02; ``lean.sampling.sde.sigma_schedule``). None: the scheduler config's, read as
    ``shift`` is when ``shift`` is None (``lean.models.terminal_stretch``), else no stretch."""
    sde_kind: str = choice("SDE kind")
    """Stochastic step: a name of ``lean.sampling.sde.SDE_KINDS``."""
    noise_level: float = 0.7
    cfg: bool = True
    """True classifier-free guidance: one [uncond, cond] batch."""
    negative_prompt: str = ""
    """CFG's unconditional prompt (an edit keeps its reference image under it). FlowGRPO's Qwen-Image scripts: " "."""
    guidance_scale: float = 4.5
    guidance_scale_2: float | None = None
    """A two-expert family's CFG scale on the low-noise expert's steps (WanPipeline's ``guidance_scale_2``; Wan2.2's
    published runs: 3.0 beside 4.0); None: ``guidance_scale`` on every step."""
    guidance_embed: float | None = None
    """FLUX-style distilled guidance value instead of CFG (needs cfg: false)."""
    uncond_grad: bool = False
    """Differentiate the unconditional CFG branch too (false: it is a constant, which is cheaper)."""
    timestep_fraction: float = 0.99
    """Share of the steps trained per sample; the last step never is."""
    timestep_fraction_of: str = choice("timestep fraction base")
    """What the fraction is of: a name of ``lean.sampling.sde.FRACTION_BASES`` (FlowGRPO: all N steps, DanceGRPO: the N
    - 1 trainable ones)."""
    timestep_selection: str = choice("timestep selection")
    """Which steps each sample trains: a name of ``lean.sampling.sde.STEP_SELECTIONS``."""
    sde_window: int = 0
    """FlowGRPO-Fast: > 0 -> only a window of this many steps is stochastic (and trained)."""
    sde_window_max_start: int | None = None
    """The window starts in [0, this]; default: it stays in the first half."""
    tail_solver: str = choice("ODE solver")
    """The solver of the deterministic steps after the last SDE step: a name of ``lean.sampling.sde.ODE_SOLVERS``
    (euler, or MixGRPO-Flash's dpmsolver++). The steps before it are Euler steps either way."""
    tail_compress: float = 1.0
    """MixGRPO-Flash: the steps after the last SDE step L run on a coarser grid of int(max((N - L) x tail_compress,
    1)) points (``lean.sampling.sde.tail_sigmas``; 1: the run's own grid). Needs ``sigma_grid: uniform``."""
    truncate_timestep: bool = False
    """The model sees floor(1000 sigma) / 1000 instead of sigma (DanceGRPO feeds int(1000 sigma) / 1000); the SDE step
    uses the exact sigma either way."""
    init_same_noise: bool = False
    """Every sample of a group starts from the same x_0 (DanceGRPO's --init_same_noise); the SDE noise still
    differs."""

    latent_dtype: str = choice("dtype", MODEL_DTYPE, also=(MODEL_DTYPE,))
    """Precision of the trajectory x_0..x_N, stored for the update and fed to each step (the network sees it cast to
    ``model.dtype``), at least ``model.dtype``'s: a name of ``lean.config.dtypes.DTYPES``, or ``model``. DanceGRPO and
    FlowGRPO's SD3 and Wan scripts keep it in float32 (their SDE step returns float32); FlowGRPO's FLUX script casts it
    back to bf16 every step."""

    def validate(self) -> None:
        """The fields alone; which SDE kind runs on which grid is ``lean.sampling.sde.check_config``'s."""
        check_positive("sample.num_steps", self.num_steps)
        if self.num_steps < 2:
            raise ConfigError("sample.num_steps", self.num_steps, "must be >= 2 (the last step is never trained)")
        if self.shift is not None:
            check_positive("sample.shift", self.shift)
        if self.shift_terminal is not None and not 0 < self.shift_terminal < 1:
            raise ConfigError("sample.shift_terminal", self.shift_terminal, "must be in (0, 1)")
        choices(self, "sample")
        check_positive("sample.noise_level", self.noise_level)
        check_positive("sample.guidance_scale", self.guidance_scale, strict=False)
        if self.guidance_scale_2 is not None:
            check_positive("sample.guidance_scale_2", self.guidance_scale_2, strict=False)
        if self.guidance_embed is not None:
            check_positive("sample.guidance_embed", self.guidance_embed, strict=False)
            if self.cfg:
                raise ConfigError(
                    "sample.guidance_embed",
                    self.guidance_embed,
                    "distilled guidance replaces CFG: set sample.cfg=false",
                )
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError("sample.timestep_fraction", self.timestep_fraction, "must be in (0, 1]")
        check_positive("sample.sde_window", self.sde_window, strict=False)
        if self.sde_window > self.num_steps - 1:
            raise ConfigError(
                "sample.sde_window", self.sde_window, f"must be <= sample.num_steps - 1 = {self.num_steps - 1}"
            )
        if not 0 < self.tail_compress <= 1:
            raise ConfigError("sample.tail_compress", self.tail_compress, "must be in (0, 1]")
        last_start = self.num_steps - 1 - self.sde_window
        if self.sde_window_max_start is not None and not 0 <= self.sde_window_max_start <= last_start:
            raise ConfigError(
                "sample.sde_window_max_start",
                self.sde_window_max_start,
                f"must be in [0, num_steps - 1 - sde_window = {last_start}]",
            )


@dataclass
class RewardModelConfig:
    """``reward.models.<name>``: where a model reward (``lean.rewards.MODEL_REWARDS``) loads from and how it runs."""

    folder: str | None = None
    """A local model folder (the layout each reward needs: ``lean.rewards.models``, docs/rewards.md)."""
    batch_size: int = 32
    """Images (video frames) per forward."""
    dtype: str = choice("dtype", DTYPES.default)
    """What the reward model computes in: a name of ``lean.config.dtypes.DTYPES``."""
    device: str | None = None
    """Where it runs (``cuda:1``, ``cpu``); None: the run's device."""

    def validate(self, key: str) -> None:
        """The fields alone; the folder's files are checked by the reward (``lean.rewards.check_config``)."""
        check_positive(f"{key}.batch_size", self.batch_size)
        choices(self, key)


@dataclass
class RemoteRewardConfig:
    """``reward.remote.<name>``: the reward is computed by a ``lean reward serve`` server (``lean.rewards.remote``)."""

    url: str = ""
    """The server's base URL, e.g. http://10.0.0.5:8100 (the client posts to <url>/score)."""
    token_env: str | None = None
    """An environment variable holding the server's bearer token (None: no token)."""
    timeout_s: float = 120.0
    """Per request."""
    retries: int = 3
    """Attempts after the first; then a RewardServerError naming the URL."""
    backoff_s: float = 1.0
    """The wait after failed attempt k is backoff_s * 2^k."""

    def validate(self, key: str) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"{key}.url", self.url, "must be an http:// or https:// URL of a lean reward server")
        if self.token_env is not None and not os.environ.get(self.token_env):
            raise ConfigError(f"{key}.token_env", self.token_env, "this environment variable is not set")
        check_positive(f"{key}.timeout_s", self.timeout_s)
        check_positive(f"{key}.retries", self.retries, strict=False)
        check_positive(f"{key}.backoff_s", self.backoff_s, strict=False)


@dataclass
class RewardConfig:
    """What a sample scores: a weighted sum of registered rewards (``lean.rewards``)."""

    weights: dict[str, float] = field(default_factory=lambda: {"color_match": 1.0})
    """reward name (``lean.rewards.REWARDS`` or ``MODEL_REWARDS``, or one of ``remote``) -> weight."""
    decode: str = choice("decode target")
    """What is decoded and scored: a name of ``lean.sampling.rollout.DECODE_TARGETS`` (the final sample, or DanceGRPO's
    prediction of x_0 at the last step)."""
    async_scoring: bool = True
    """Decode and score each rollout micro-batch in a worker thread while the next one rolls out
    (``lean.run.async_scoring``); false: score each micro-batch after the rollout, in the training thread. The rewards
    are the same."""
    models: dict[str, RewardModelConfig] = field(default_factory=dict)
    """model reward name -> its folder, batch size, dtype and device; every entry's folder is checked (but for a
    reward ``remote`` names: ``lean reward serve`` checks it on the server)."""
    remote: dict[str, RemoteRewardConfig] = field(default_factory=dict)
    """reward name -> the server that computes it (the name need not be registered in this process)."""

    def validate(self) -> None:
        """The fields alone; which rewards exist and what their folders hold is ``lean.rewards.check_config``'s."""
        choices(self, "reward")
        if not self.weights:
            raise ConfigError("reward.weights", self.weights, "name at least one reward")
        for name, remote in self.remote.items():
            remote.validate(f"reward.remote.{name}")
        for name, entry in self.models.items():
            entry.validate(f"reward.models.{name}")


@dataclass
class MixGRPOConfig:
    """MixGRPO's sliding SDE window (``lean/algorithms/mixgrpo.py``): steps [s, s + window) are SDE steps and trained,
    the others ODE steps; s = floor(iteration / move_every) x stride, rolled back to 0 past the last trainable start."""

    window: int = 4
    """SDE (and trained) steps per rollout (MixGRPO's --group_size 4)."""
    move_every: int = 25
    """Iterations before the window moves (--iters_per_group: 25; Flash 20)."""
    stride: int = 1
    """Steps the window moves by (--prog_overlap_step: 1; 0 freezes it at the first steps, Flash*)."""

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.window", self.window)
        check_positive(f"{prefix}.move_every", self.move_every)
        check_positive(f"{prefix}.stride", self.stride, strict=False)


@dataclass
class NFTConfig:
    """DiffusionNFT's keys (``lean/algorithms/nft.py``)."""

    beta: float = 1.0
    """beta: the implicit positive policy is beta v_theta + (1 - beta) v_old, the negative (1 + beta) v_old -
    beta v_theta (config/nft.py: 1.0; its multi-reward and OCR recipes 0.1)."""
    kl_weight: float = 1e-4
    """Weight of mean (v_theta - v_ref)^2 against the reference (adapter off) (config/nft.py: train.beta 1e-4)."""
    old_decay: str = choice("old-policy decay")
    """How the old (sampling) policy follows the trained one after each rollout's updates: a name of
    ``lean.algorithms.nft.OLD_POLICY_DECAYS``."""

    def validate(self, prefix: str) -> None:
        choices(self, prefix)
        check_positive(f"{prefix}.beta", self.beta)
        check_positive(f"{prefix}.kl_weight", self.kl_weight, strict=False)


@dataclass
class DPOConfig:
    """Online Diffusion-DPO's keys (``lean/algorithms/dpo.py``)."""

    beta: float = 100.0
    """beta of the logit -beta / 2 [(e_w - e_w^ref) - (e_l - e_l^ref)] (FlowGRPO config/dpo.py: 100)."""
    ref_update_every: int = 40
    """Optimizer steps between copies of the trained weights into the reference (and sampler): FlowGRPO's
    OnlineDPO (its config's comment: 40); 0: never, the reference stays the starting weights (its shipped 1e7)."""
    sample_from: str = choice("DPO sampler")
    """Which weights roll out: a name of ``lean.algorithms.dpo.DPO_SAMPLERS``."""

    def validate(self, prefix: str) -> None:
        choices(self, prefix)
        check_positive(f"{prefix}.beta", self.beta)
        check_positive(f"{prefix}.ref_update_every", self.ref_update_every, strict=False)


@dataclass
class AlgorithmConfig:
    """What is optimised (``lean.algorithms``): the algorithm and its keys. GRPO's (``lean/algorithms/grpo.py``): the
    group advantages, the clipped surrogate and the KL term."""

    name: str = choice("algorithm")
    """A name of ``lean.algorithms.ALGORITHMS``."""
    clip_range: float = 1e-4
    """PPO's clip range c of the surrogate max(-A r, -A clip(r, 1 - c, 1 + c))."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to [-adv_clip_max, adv_clip_max]."""
    global_std: bool = False
    """Normalise advantages by the std of the whole batch instead of the group's."""
    adv_std: str = choice("std estimator")
    """The std of the advantage normalisation: a name of ``lean.algorithms.STD_ESTIMATORS`` (FlowGRPO: population,
    DanceGRPO: unbiased)."""
    adv_eps: float = 1e-4
    """A = (r - mean) / (std + adv_eps) (FlowGRPO 1e-4, DanceGRPO 1e-8)."""
    beta: float = 0.0
    """KL weight against the reference policy (adapter off)."""
    kl_form: str = choice("KL form")
    """The KL term: a name of ``lean.algorithms.KL_FORMS`` (exact: the KL of the two Gaussian steps; flow_grpo:
    FlowGRPO's SD3/FLUX scripts, which divide by the SDE's noise scale before its sqrt(-dt) factor)."""
    skip_zero_advantage: bool = False
    """Samples whose advantage is 0 (a group with equal rewards) leave the update, and the loss is averaged over the
    others (FlowGRPO's SD3, Fast and Wan scripts filter them; its FLUX script does not)."""
    all_zero_advantage: str = choice("all-zero advantage")
    """With ``skip_zero_advantage``, when every sample of a process has advantage 0: a name of
    ``lean.algorithms.ALL_ZERO_ADVANTAGES`` (drop: none is trained, the update's gradient is 0; keep: all are, so the
    KL term keeps acting, as FlowGRPO's Wan script, which adds 1e-6 to their advantages; lean keeps them at 0)."""
    zero_advantage_order: str = choice("zero-advantage order", AUTO, also=(AUTO,))
    """With ``skip_zero_advantage`` and several updates per rollout, a name of
    ``lean.schedules.recompute.ZERO_ADVANTAGE_ORDERS``: ``filter_then_split`` (FlowGRPO: the kept samples are split
    into the updates), ``split_then_filter`` (the updates' samples are drawn from all before the rollout, each update
    drops its zero-advantage ones: what the hybrid schedules need), or ``auto``: the second under a hybrid schedule,
    else the first."""
    mixgrpo: MixGRPOConfig = field(default_factory=MixGRPOConfig)
    """``algorithm.name: mixgrpo``'s window."""
    nft: NFTConfig = field(default_factory=NFTConfig)
    """``algorithm.name: nft``'s keys."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """``algorithm.name: dpo``'s keys."""

    def validate(self) -> None:
        choices(self, "algorithm")
        self.mixgrpo.validate("algorithm.mixgrpo")
        self.nft.validate("algorithm.nft")
        self.dpo.validate("algorithm.dpo")
        for key in ("clip_range", "adv_clip_max"):
            check_positive(f"algorithm.{key}", getattr(self, key))
        for key in ("adv_eps", "beta"):
            check_positive(f"algorithm.{key}", getattr(self, key), strict=False)


ON_NONFINITE = ("abort", "skip")


@dataclass
class TrainConfig:
    """The run loop: schedule, iterations, batches, optimizer, EMA, checkpoints and faults."""

    schedule: str = choice("schedule", also=(AUTO,))
    """Update schedule: a name of ``lean.schedules.SCHEDULES``, or auto (the fastest predicted schedule that fits
    ``memory_budget_mb``)."""
    iterations: int = 3
    prompts_per_iteration: int = 2
    """Groups per iteration, across all processes."""
    group_size: int = 4
    """Samples per prompt (k); advantages are relative to the group."""
    rollout_batch_size: int = 8
    """Samples per forward during the rollout, per process."""
    train_batch_size: int = 8
    """Samples per forward during Recompute's update, per process."""
    optimizer_steps_per_iteration: int = 1
    """> 1 is off-policy (FlowGRPO's gradient accumulation)."""
    on_policy: bool = False
    """The recipe's on-policy form: each rollout feeds one optimizer step with the recipe's samples per step. With
    S = optimizer_steps_per_iteration: prompts_per_iteration / S prompts per rollout, iterations x S rollouts, one
    optimizer step each (S becomes 1). The samples per step and the number of steps stay the recipe's; every step's
    ratio is 1, so retain, reweight and auto run it exactly. Needs num_inner_epochs 1 (a second pass reuses samples
    under moved weights)."""
    shuffle_update: bool = True
    """Recompute's update visits the local samples in a shuffled order (FlowGRPO's SD3, FLUX and Wan scripts); false:
    in rollout order (Flow-GRPO-Fast, DanceGRPO). It decides which samples share an optimizer step."""
    recompute_batching: str = choice("recompute batching")
    """Recompute's update forwards: update (FlowGRPO's: shuffled samples, train_batch_size) | rollout (the rollout's
    own micro-batches and CFG batch, so on-policy the ratio is exactly 1 where kernels are deterministic)."""
    num_inner_epochs: int = 1
    lr: float = 1e-4
    weight_decay: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    ema: bool = False
    """Keep an exponential moving average of the trained weights (written as ``lora_ema.safetensors``)."""
    ema_decay: float = 0.9
    ema_every: int = 8
    """Update the EMA every N optimizer steps (FlowGRPO's ``update_step_interval``)."""
    ema_warmup: bool = False
    """FlowGRPO's EMA schedule (flow_grpo at ac4c86e: flow_grpo/ema.py:33-37 and :45, called right after
    ``global_step += 1`` in scripts/train_sd3.py:952-955): after optimizer step s (counted from 1) with
    ``(s + 1) % ema_every == 0`` the decay is ``min((1 + s) / (10 + s), ema_decay)``. false: ``ema_decay`` after every
    ``ema_every``-th step. See ``lean.run.optimizer.ema_decay``."""
    ema_repeats: int = 1
    """Each EMA update is applied this many times (decay^r): FlowGRPO calls its EMA once per training micro-batch, so
    an update repeats gradient_accumulation_steps times (scripts/train_sd3.py at 879042c: :959-960 in the micro-batch
    loop)."""
    memory_budget_mb: float | None = None
    """For schedule auto (and a check of retain): default, what the device has."""
    seed: int = 42
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    """The prompt set; replaced by the file's prompts when ``prompts_file`` is set."""
    prompts_file: str | None = None
    """A prompt file read by ``lean.config.prompts.read_prompts`` into ``prompts`` when the config is validated: one
    prompt a line (FlowGRPO's dataset/*/train.txt; blank lines skipped), or ``.jsonl`` with a ``prompt`` field per line
    (FlowGRPO's GenEval *_metadata.jsonl)."""
    out: str = "outputs/train"
    dist_timeout_s: float | None = None
    """Every process-group operation fails after this instead of hanging; default 60 s on CPU (gloo), 30 minutes
    on GPUs (NCCL: checkpoint writes and uneven model loading can hold a rank for minutes)."""
    save_every: int = 0
    """Checkpoint every N iterations into <out>/checkpoints (0: off)."""
    keep_checkpoints: int = 2
    on_nonfinite: str = ON_NONFINITE[0]
    """What a non-finite reward, log-prob, loss or gradient does: abort | skip (undo the iteration)."""
    threads: int | None = None
    """Torch threads of each ``lean train`` process (``lean train --threads``); None: torch's default."""

    def validate(self) -> None:
        choices(self, "train")
        for key in (
            "iterations",
            "prompts_per_iteration",
            "rollout_batch_size",
            "train_batch_size",
            "optimizer_steps_per_iteration",
            "num_inner_epochs",
            "ema_every",
            "ema_repeats",
            "keep_checkpoints",
            "lr",
            "max_grad_norm",
            "adam_eps",
        ):
            check_positive(f"train.{key}", getattr(self, key))
        for key in ("dist_timeout_s", "threads"):
            if getattr(self, key) is not None:
                check_positive(f"train.{key}", getattr(self, key))
        if self.group_size < 2:
            raise ConfigError(
                "train.group_size", self.group_size, "must be >= 2 (advantages are relative to the group)"
            )
        for key in ("weight_decay", "save_every"):
            check_positive(f"train.{key}", getattr(self, key), strict=False)
        for key in ("adam_beta1", "adam_beta2", "ema_decay"):
            check_fraction(f"train.{key}", getattr(self, key))
        check_choice("train.on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        if self.memory_budget_mb is not None:
            check_positive("train.memory_budget_mb", self.memory_budget_mb)
        if self.prompts_file is not None:
            self.prompts = prompts_of_file("train.prompts_file", self.prompts_file)
        if self.on_policy:
            self.to_on_policy()
        if not self.prompts:
            raise ConfigError("train.prompts", self.prompts, "needs at least one prompt")

    def to_on_policy(self) -> None:
        """``on_policy``: S optimizer steps per rollout become S rollouts of one step each (a no-op at S = 1, so a
        validated config validates again unchanged)."""
        steps, prompts = self.optimizer_steps_per_iteration, self.prompts_per_iteration
        if self.num_inner_epochs != 1:
            raise ConfigError(
                "train.on_policy",
                True,
                f"takes one pass over each rollout; train.num_inner_epochs={self.num_inner_epochs} reuses its samples "
                "under moved weights: set train.num_inner_epochs=1",
            )
        if prompts % steps:
            raise ConfigError(
                "train.on_policy",
                True,
                f"splits an iteration's train.prompts_per_iteration={prompts} into train.optimizer_steps_per_iteration"
                f"={steps} rollouts: use a multiple of {steps}",
            )
        self.prompts_per_iteration, self.iterations = prompts // steps, self.iterations * steps
        self.optimizer_steps_per_iteration = 1


@dataclass
class ParallelConfig:
    """Where the samples, the weights and the tokens live (docs/parallelism.md); the processes come from
    ``lean launch`` (Accelerate)."""

    layout: str = choice("layout")
    """Which samples a process holds and when its schedule finishes them: a name of ``lean.parallel.layout.LAYOUTS``
    (group: whole prompt groups, each finished as soon as it is scored, so Retain holds one group's graphs; slice: a
    contiguous share, finished after the whole rollout; auto: group where it applies)."""
    shard: str = choice("shard")
    """How the policy is spread over the processes: a name of ``lean.parallel.sharding.SHARDS`` (none: a whole copy
    each; fsdp: FSDP2 ``fully_shard`` of the transformer blocks; the frozen base, and under full fine-tuning the trained
    weights, gradients and AdamW state)."""
    sequence_parallel: int = 1
    """Processes that split each trajectory's tokens (Ulysses attention, ``lean.models.sequence_parallel``): groups of
    this many consecutive processes hold the same samples, so ``lean launch -n 4`` with 2 is 2 data-parallel x 2
    sequence-parallel. The heads and the tokens (FLUX: the text tokens too) must divide by it."""
    split_decode: bool = True
    """Under sequence parallelism, each process of a group decodes and scores its share of the group's samples and
    the rewards are all-gathered (``lean.run.async_scoring``): the VAE decode and the rewards run once per sample, not
    once per process. false: every process decodes and scores all of them."""
    overlap: str = choice("overlap method", "flash")
    """How sequence parallelism's all-to-alls run beside the projections' GEMMs: a name of
    ``lean.parallel.overlap.METHODS`` (collective: one all-to-all after the projection; sliced; flash: one P2P step per
    peer, each head block sent as soon as it is computed)."""

    def validate(self) -> None:
        choices(self, "parallel")
        check_positive("parallel.sequence_parallel", self.sequence_parallel)

    def data_parallel_size(self, world_size: int | None) -> int:
        """Data-parallel ranks of ``world_size`` processes (None: not known yet, as if one)."""
        return max(1, (world_size or self.sequence_parallel) // self.sequence_parallel)


@dataclass
class EvalConfig:
    """Evaluation during ``lean train`` (``lean.evaluation``): deterministic ODE samples of fixed prompts from the
    same noise at every evaluation, scored with the run's reward, written as image grids and logged to MLflow."""

    every: int = 0
    """Evaluate every N iterations, and before the first (the base model) and after the last; 0: never."""
    prompts: list[str] | None = None
    """The eval prompts; None: the training prompts (``train.prompts``). Replaced by ``prompts_file``'s when set."""
    prompts_file: str | None = None
    """A prompt file (``lean.config.prompts.read_prompts``: one prompt a line, or ``.jsonl`` with a ``prompt``
    field)."""
    samples_per_prompt: int = 2
    """Samples of each eval prompt: the grid's columns."""
    num_steps: int | None = None
    """Euler (ODE) steps over the run's sigma grid; None: ``sample.num_steps``."""
    guidance_scale: float | None = None
    """CFG scale of the eval samples; None: ``sample.guidance_scale``."""
    seed: int = 0
    """Seed of the eval noise: every evaluation starts from the same x_1, so its images compare across iterations."""
    batch_size: int = 8
    """Samples per rollout, decode and reward call, per process."""
    use_ema: bool = True
    """With ``train.ema``: evaluate the EMA weights (those of ``lora_ema.safetensors``); false: the trained ones."""
    noise_seeds: int = 0
    """The base model's evaluation (iteration 0) is repeated with this many eval seeds (``seed``, ``seed + 1``, ...;
    no files written) and ``eval_reward_noise_std`` is the unbiased std of their mean eval rewards: how much the eval
    reward moves with the noise alone, the yardstick of a gain. 0: off; 1 is refused (no spread)."""

    def validate(self) -> None:
        check_positive("eval.every", self.every, strict=False)
        check_positive("eval.noise_seeds", self.noise_seeds, strict=False)
        if self.noise_seeds == 1:
            raise ConfigError("eval.noise_seeds", self.noise_seeds, "must be 0 (off) or >= 2: one seed has no spread")
        for key in ("samples_per_prompt", "batch_size"):
            check_positive(f"eval.{key}", getattr(self, key))
        if self.num_steps is not None:
            check_positive("eval.num_steps", self.num_steps)
        if self.guidance_scale is not None:
            check_positive("eval.guidance_scale", self.guidance_scale, strict=False)
        if self.prompts_file is not None:
            self.prompts = prompts_of_file("eval.prompts_file", self.prompts_file)
        if self.prompts is not None and not self.prompts:
            raise ConfigError("eval.prompts", self.prompts, "needs at least one prompt (or null: the training prompts)")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def samples_per_iteration(self) -> int:
        return self.train.prompts_per_iteration * self.train.group_size


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}

# Keys that moved to another section: naming the old one is a one-line error that gives the new place.
MOVED: dict[str, str] = {
    **{
        f"train.{key}": f"algorithm.{key}"
        for key in ("clip_range", "adv_clip_max", "global_std", "adv_std", "adv_eps", "beta", "kl_form")
    },
    "train.skip_zero_advantage": "algorithm.skip_zero_advantage",
    **{f"train.{key}": f"parallel.{key}" for key in ("layout", "shard")},
    **{f"model.{key}": f"parallel.{key}" for key in ("sequence_parallel", "overlap")},
}


# ---------------------------------------------------------------- reading: files, presets, stage sections, --set


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints widen to floats, nothing else)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce(key, value, next(a for a in args if a is not type(None)))
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
        return {_coerce(f"{key} key", k, args[0]): _coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):  # a section, or an entry of one (reward.models.<name>)
        value = {} if value is None else value
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a mapping of keys")
        hints = typing.get_type_hints(tp)
        for k, v in value.items():
            if f"{key}.{k}" in MOVED:
                raise ConfigError(f"{key}.{k}", v, f"moved to {MOVED[f'{key}.{k}']}")
            if k not in hints:
                raise ConfigError(f"{key}.{k}", v, "unknown key" + suggest(k, hints))
        return tp(**{k: _coerce(f"{key}.{k}", v, hints[k]) for k, v in value.items()})
    raise TypeError(f"unsupported annotation {tp} for {key}")


def _build_section(name: str, raw: Any):
    return _coerce(name, raw, SECTIONS[name])


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


def _check_section(name: str, value: Any, where: str = "") -> None:
    if name not in SECTIONS:
        raise ConfigError(f"{where}{name}", value, "unknown section" + suggest(name, SECTIONS))


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one dotted override ``section.key=value`` to a raw config tree in place."""
    if "=" not in assignment:
        raise ConfigError(assignment, None, "an override must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    _check_section(parts[0], text)
    if len(parts) < 2:
        raise ConfigError(dotted, text, "name a key inside the section, e.g. train.lr=1e-4")
    node = tree.setdefault(parts[0], {}) or {}
    tree[parts[0]] = node
    for p in parts[1:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = _parse_scalar(text)


def apply_run_section(tree: dict, run: Any, where: str) -> None:
    """A stage's ``run:`` mapping (shaped like the run sections) on top of ``tree``: each key it lists replaces the
    section's value whole (a mapping value such as ``reward.weights`` is never merged)."""
    if run is None:
        return
    if not isinstance(run, Mapping):
        raise ConfigError(where, run, "must be a mapping of run sections")
    for section, keys in run.items():
        _check_section(section, keys, f"{where}.")
        if not isinstance(keys, Mapping):
            raise ConfigError(f"{where}.{section}", keys, "must be a mapping of keys")
        node = tree.setdefault(section, {}) or {}
        tree[section] = {**node, **keys}


def _deep_merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``, merging nested sections (but never ``reward.weights``: a preset's reward replaces)."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "weights":
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_params(path: str | os.PathLike) -> dict:
    """The whole params file: the run sections and the stages' own sections (``bench``, ``prepare``, ...)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError("--params", str(path), "file does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError("--params", str(path), f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError("--params", str(path), "must hold a mapping")
    return tree


def read_config(
    params: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    preset: str | None = None,
    tree: dict | None = None,
    stage: str | None = None,
    variant: str | None = None,
) -> RunConfig:
    """The run config, typed but not yet validated (``lean.configure.load_config`` validates it). Layers, each on
    top of the one before: the run sections of ``params`` (or ``tree``), the preset, the ``stage`` section's
    ``run:`` mapping of ``params`` (then its ``<variant>.run:``, a second run of the stage), the ``--set``
    overrides."""
    whole = read_params(params) if params is not None else {}
    raw = dict(tree) if tree is not None else {k: v for k, v in whole.items() if k in SECTIONS}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(
                "--preset", preset, "unknown preset" + suggest(preset, PRESETS) + f"; known: {', '.join(PRESETS)}"
            )
        raw = _deep_merge(raw, yaml.safe_load(PRESETS[preset].read_text()) or {})
    raw = _deep_merge({}, raw)
    if stage is not None:
        apply_run_section(raw, (whole.get(stage) or {}).get("run"), f"{stage}.run")
        if variant is not None:
            section = ((whole.get(stage) or {}).get(variant) or {}).get("run")
            apply_run_section(raw, section, f"{stage}.{variant}.run")
    for item in overrides:
        apply_override(raw, item)
    for name in raw:
        _check_section(name, raw[name])
    return RunConfig(**{name: _build_section(name, raw.get(name)) for name in SECTIONS})
