"""The ``sample`` section: the sigma grid, the SDE, guidance, and which steps are stochastic and trained (registered
with ``lean.config.sections``)."""

from __future__ import annotations

from dataclasses import dataclass

from lean.config.checks import ConfigError, check_positive, choice, choices
from lean.config.dtypes import MODEL_DTYPE
from lean.config.sections import register_options


@register_options("sample")
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
    sde_window_min_start: int = 0
    """The drawn window starts in [this, sde_window_max_start] (Flow-Factory draws from its sde_steps list, which starts
    at 1); 0: from the first step. Needs a window drawn at each iteration (no ``sde_window_start``)."""
    sde_window_start: int | None = None
    """The window's first step, the same at every iteration (FlowGRPO's Qwen-Image pipeline re-seeds its draw with a
    process index the script never passes); None: drawn uniformly in [0, sde_window_max_start] at each iteration."""
    sde_steps_drawn: int = 0
    """> 0: only this many steps of the window, drawn uniformly without replacement at each iteration (the same for
    every sample), are stochastic and trained; its other steps are ODE steps (UniRL's AllSDEScheduler num_sde_steps:
    3 of steps 0..4, each 60 % of the rollouts). 0: the whole window. Needs ``sde_window`` >= this."""
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
    ``model.dtype``): a name of ``lean.config.dtypes.DTYPES``, or ``model``; at least ``model.dtype``'s, except that
    float16 under a bfloat16 model stays float16 (``lean.config.dtypes.storage_dtype``). DanceGRPO and FlowGRPO's SD3
    and Wan scripts keep it in float32 (their SDE step returns float32); FlowGRPO's FLUX script casts it back to bf16
    every step; Flow-Factory stores it in float16 (its ``latent_storage_dtype`` default, each step's sample rounded to
    it before its log-prob)."""

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
        if self.sde_steps_drawn and not 0 < self.sde_steps_drawn <= self.sde_window:
            raise ConfigError(
                "sample.sde_steps_drawn", self.sde_steps_drawn, f"must be in [0, sample.sde_window = {self.sde_window}]"
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
        if self.sde_window_min_start != 0:
            self._check_window_min_start()
        if self.sde_window_start is not None and not (self.sde_window and 0 <= self.sde_window_start <= last_start):
            raise ConfigError(
                "sample.sde_window_start",
                self.sde_window_start,
                f"needs sample.sde_window > 0 and must be in [0, num_steps - 1 - sde_window = {last_start}]",
            )

    def _check_window_min_start(self) -> None:
        """``sde_window_min_start`` bounds a drawn window's start from below: in [0, the max start]."""
        if not self.sde_window or self.sde_window_start is not None:
            raise ConfigError(
                "sample.sde_window_min_start",
                self.sde_window_min_start,
                "needs sample.sde_window > 0 drawn at each iteration (sample.sde_window_start: null)",
            )
        max_start = window_max_start(self.num_steps, self.sde_window, self.sde_window_max_start)
        if not 0 <= self.sde_window_min_start <= max_start:
            raise ConfigError(
                "sample.sde_window_min_start", self.sde_window_min_start, f"must be in [0, the max start {max_start}]"
            )


def window_max_start(num_steps: int, window: int, max_start: int | None) -> int:
    """The last start a drawn window of ``window`` steps may take: ``max_start``, or by default
    ``max(0, num_steps // 2 − window)`` (the window stays in the first half, as FlowGRPO-Fast)."""
    return max(0, num_steps // 2 - window) if max_start is None else max_start
