"""Stochastic sampling steps with exact Gaussian log-probabilities, the ODE step, and step selection.

A flow-matching model predicts a velocity ``v = model_output`` at noise level ``σ`` (``x_σ = (1−σ)·x0 + σ·x1``,
``x1`` pure noise). Sampling walks the descending schedule ``sigmas[0] > ... > sigmas[N] = 0`` (``SIGMA_GRIDS``: the
grid each published pipeline uses). Step ``i`` goes from ``σ = sigmas[i]`` to ``σ' = sigmas[i+1]``. An SDE step is a
Gaussian transition ``x' ~ N(mean_θ(x), std²·I)``; GRPO trains on ``log p(x' | x)`` of the steps it sampled. Four SDEs
are offered (``SDE_KINDS``):

* ``flow_grpo``        — FlowGRPO's reverse SDE with ``σ_t = noise_level·sqrt(σ/(1−σ))``.
* ``flow_grpo_linear`` — the same SDE with ``σ_t`` linear in ``σ`` (FlowGRPO's Wan2.1 script).
* ``cps``              — coefficients-preserving sampling: re-noise the predicted ``x0`` at level ``σ'``.
* ``dance``            — DanceGRPO's SDE with constant ``σ_t = noise_level``.

All steps compute in float32 (float64 when the sample is float64), hand back ``x'`` in the sample's dtype, and the
mean and the log-prob in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.config import ConfigError
from lean.config.registry import Registry
from lean.sampling.options import window_max_start

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.sampling.options import SampleConfig

SDE_KINDS: Registry[str] = Registry(
    "SDE kind",
    [
        ("flow_grpo", "FlowGRPO's reverse SDE, noise scale eta sqrt(sigma / (1 - sigma))"),
        ("flow_grpo_linear", "FlowGRPO's Wan2.1 SDE, noise scale linear in sigma"),
        ("cps", "coefficients-preserving sampling"),
        ("dance", "DanceGRPO's SDE, constant noise scale"),
    ],
)
SIGMA_GRIDS: Registry[str] = Registry(
    "sigma grid",
    [
        ("euler", "StableDiffusion3Pipeline's FlowMatchEulerDiscreteScheduler"),
        ("uniform", "FluxPipeline and DanceGRPO"),
        ("unipc", "WanPipeline's UniPCMultistepScheduler"),
    ],
)
ODE_SOLVERS: Registry[str] = Registry(
    "ODE solver",
    [
        ("euler", "x' = x + (sigma' - sigma) v"),
        ("dpmsolver++", "DPM-Solver++(2M), midpoint, on the data prediction x0 = x - sigma v (MixGRPO-Flash)"),
    ],
)
EULER = ODE_SOLVERS.default
SQRT_DT_KINDS = ("flow_grpo", "flow_grpo_linear")  # transition std = noise scale s x sqrt(-dt)
STEP_SELECTIONS: Registry[str] = Registry(
    "timestep selection",
    [
        ("first", "the first K steps for every sample (FlowGRPO)"),
        ("random", "a random K-subset per sample (DanceGRPO)"),
    ],
)

FRACTION_BASES: Registry[str] = Registry(
    "timestep fraction base",
    [
        ("all", "K = floor(N x fraction) of the N steps (FlowGRPO)"),
        ("trainable", "K = floor((N - 1) x fraction) of the N - 1 steps that can be trained (DanceGRPO)"),
    ],
)

Generators = torch.Generator | Sequence[torch.Generator] | None
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def incompatibility(kind: str, grid: str, noise_level: float) -> tuple[str, str] | None:
    """(key, what is wrong) when an SDE kind cannot run on a sigma grid or at a noise level, else None."""
    if kind == "flow_grpo" and grid == "unipc":
        return "sigma_grid", (
            "starts at 1 - 1e-6, where flow_grpo's noise scale sqrt(sigma/(1-sigma)) is ~1000: use "
            "sample.sde_kind=flow_grpo_linear (FlowGRPO's Wan SDE)"
        )
    if kind == "cps" and noise_level > 1:
        return "noise_level", "cps needs noise_level in (0, 1]"
    return None


def check_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """The SDE kind runs on the sigma grid at the noise level (:func:`incompatibility`); a compressed tail needs the
    uniform grid, whose time it re-spaces (:func:`tail_sigmas`)."""
    s = cfg.sample
    problem = incompatibility(s.sde_kind, s.sigma_grid, s.noise_level)
    if problem is not None:
        key, allowed = problem
        raise ConfigError(f"sample.{key}", getattr(s, key), allowed)
    if s.tail_compress != 1 and s.sigma_grid != "uniform":
        raise ConfigError(
            "sample.tail_compress", s.tail_compress, "re-spaces the uniform grid's time: set sample.sigma_grid=uniform"
        )
    if s.tail_compress != 1 and s.tail_solver == EULER:  # the source compresses for its DPM solver only
        raise ConfigError(
            "sample.tail_compress", s.tail_compress, "compresses the steps of a multistep tail: set sample.tail_solver"
        )
    if s.shift_terminal is not None and s.sigma_grid == "unipc":  # UniPC's scheduler has no terminal stretch
        raise ConfigError("sample.shift_terminal", s.shift_terminal, "stretches the euler and uniform grids only")


def compute_dtype(x: Tensor) -> torch.dtype:
    """What a step computes in: float64 for float64 samples, else float32 (half-precision samples included)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sigma_pair(sigmas: Tensor, index: int | Tensor, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(σ, σ') at ``index`` as tensors of shape [B, 1, ..., 1] (broadcastable to ``x``) in ``dtype``.

    An int index (one step for the whole batch) selects on the device; only a CPU index tensor is checked on the
    host (checking a device tensor would wait for the device every step)."""
    sigmas = sigmas.to(device=x.device, dtype=dtype)
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    if isinstance(index, int):
        if not 0 <= index < len(sigmas) - 1:
            raise ValueError(f"index={index}: must be in [0, len(sigmas) - 2 = {len(sigmas) - 2}]")
        return sigmas[index].expand(shape), sigmas[index + 1].expand(shape)
    if index.device.type == "cpu":
        if index.min() < 0 or index.max() >= len(sigmas) - 1:
            raise ValueError(f"index={index}: must be in [0, len(sigmas) - 2 = {len(sigmas) - 2}]")
        index = index.to(x.device)
    index = index.expand(x.shape[0])
    return sigmas[index].view(shape), sigmas[index + 1].view(shape)


def _noise(x: Tensor, generator: Generators, dtype: torch.dtype) -> Tensor:
    """Standard normal noise shaped like ``x``, drawn on each generator's device (CPU by default) then moved to
    ``x.device``. A list of generators draws sample ``b`` from ``generator[b]`` alone, so batching cannot change it."""
    if isinstance(generator, Sequence):
        if len(generator) != x.shape[0]:
            raise ValueError(f"generator: got {len(generator)} generators for a batch of {x.shape[0]}")
        eps = torch.cat([torch.randn((1, *x.shape[1:]), generator=g, device=g.device, dtype=dtype) for g in generator])
    else:
        device = generator.device if generator is not None else torch.device("cpu")
        eps = torch.randn(x.shape, generator=generator, device=device, dtype=dtype)
    return eps.to(x.device)


@dataclass(frozen=True)
class Sde:
    """A stochastic sampler: its kind (one of ``SDE_KINDS``), its noise level ``η > 0`` and the 1-D sigma grid it
    walks (descending, last entry 0; e.g. :func:`sigma_schedule`)."""

    kind: str
    noise_level: float
    sigmas: Tensor

    def __post_init__(self):
        if self.kind not in SDE_KINDS:
            raise ValueError(f"kind={self.kind!r}: must be one of {', '.join(SDE_KINDS)}")
        if not self.noise_level > 0:
            raise ValueError(f"noise_level={self.noise_level!r}: must be > 0")

    @classmethod
    def of(cls, cfg: SampleConfig, sigmas: Tensor) -> Sde:
        """The sampler ``cfg`` (``sample.sde_kind``, ``sample.noise_level``) on ``sigmas``."""
        return cls(cfg.sde_kind, cfg.noise_level, sigmas)


def _flow_grpo_transition(sde: Sde, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
    """FlowGRPO's reverse SDE, ``dt = σ'−σ``:

    * ``flow_grpo``: ``s = η·sqrt(σ/(1−σ̃))`` with ``σ̃ = sigmas[1]`` when ``σ == 1`` (else ``σ``);
    * ``flow_grpo_linear``: ``s = η·(σ_N + (σ_1 − σ_N)·σ)``, ``σ_1 = sigmas[1]``, ``σ_N = sigmas[−1]`` (η = 1 is
      FlowGRPO's Wan2.1 SDE, where ``σ_N = 0``);

    ``mean = x·(1 + s²/(2σ)·dt) + v·(1 + s²(1−σ)/(2σ))·dt``; ``std = s·sqrt(−dt)``."""
    dt = sigma_next - sigma
    sigma_max = sde.sigmas[1].to(device=x.device, dtype=x.dtype)
    if sde.kind == "flow_grpo":
        # σ = 1 would divide by zero: FlowGRPO evaluates the noise scale at sigmas[1] there instead.
        s = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * sde.noise_level
    else:
        sigma_min = sde.sigmas[-1].to(device=x.device, dtype=x.dtype)
        s = (sigma_min + (sigma_max - sigma_min) * sigma) * sde.noise_level
    mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, s * torch.sqrt(-dt)


def _cps_transition(sde: Sde, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
    """Coefficients-preserving sampling: ``std = σ'·sin(ηπ/2)``; ``x̂0 = x − σv``; ``x̂1 = x + (1−σ)v``;
    ``mean = (1−σ')·x̂0 + sqrt(σ'² − std²)·x̂1``. At the last step ``σ' = 0`` so ``std = 0``, ``x' = mean``."""
    std = sigma_next * math.sin(sde.noise_level * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    return x0 * (1 - sigma_next) + x1 * torch.sqrt((sigma_next**2 - std**2).clamp_min(0)), std


def _dance_transition(sde: Sde, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
    """DanceGRPO's SDE: ``dσ = σ'−σ``; ``x̂0 = x − σv``; ``score = −(x − (1−σ)x̂0)/σ²``;
    ``mean = x + dσ·v − ½η²·score·dσ``; ``std = η·sqrt(σ−σ')``."""
    d_sigma = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = x + d_sigma * v + (-0.5 * sde.noise_level**2 * score) * d_sigma
    return mean, sde.noise_level * torch.sqrt(sigma - sigma_next)


# kind -> (sde, x, v, σ, σ') -> (mean, std) of the Gaussian transition x' ~ N(mean, std² I)
TRANSITIONS = {
    "flow_grpo": _flow_grpo_transition,
    "flow_grpo_linear": _flow_grpo_transition,
    "cps": _cps_transition,
    "dance": _dance_transition,
}


def _log_prob(kind: str, x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log p(x' | x) [B], averaged over the non-batch dimensions: the Gaussian's
    ``−(x'−mean)²/(2std²) − log std − log sqrt(2π)``, or for ``cps`` ``−(x'−mean)²`` (constants and scale dropped,
    as in FlowGRPO; only ratios/differences of it are used)."""
    sq_err = (x_next - mean) ** 2
    if kind == "cps":
        log_prob = -sq_err
    else:
        log_prob = -sq_err / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def sde_step_with_logprob(
    sde: Sde,
    model_output: Tensor,
    sample: Tensor,
    index: int | Tensor,
    *,
    prev_sample: Tensor | None = None,
    generator: Generators = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One stochastic step ``x -> x' = mean + std·ε`` (``ε ~ N(0, I)``) of ``sde`` from ``σ = sigmas[index]`` to
    ``σ' = sigmas[index+1]``, with its log-prob; ``x = sample`` and ``v = model_output`` [B, ...] of one dtype,
    ``index`` an int or a LongTensor [B] (per-sample steps). Each kind's mean and std: :data:`TRANSITIONS`; the
    log-prob: :func:`_log_prob`.

    ``prev_sample``: score this ``x'`` instead of sampling one (it is detached; gradients reach ``model_output``
    through the mean only). ``generator``: a ``torch.Generator`` or one per sample (:func:`_noise`), ignored when
    ``prev_sample`` is given. ``noise``: the draw ε itself (on the sample's device, in the compute dtype;
    ``lean.sampling.rollout.StepNoise`` draws a rollout's noise ahead of the device).

    Returns ``(prev_sample, log_prob, prev_sample_mean, std_dev_t)``: ``x'`` in the sample's dtype (detached when
    given); ``mean`` and ``log_prob`` [B] in the compute dtype (float32; float64 for float64 input: a KL between two
    means rounded to bfloat16 would be mostly rounding); ``std_dev_t`` the standard deviation of the Gaussian
    transition itself (``s·sqrt(−dt)`` for the flow_grpo kinds, ``std`` otherwise), shape [B, 1, ..., 1] in the
    compute dtype, so that ``‖mean_θ − mean_ref‖²/(2·std_dev_t²)`` is the KL of two steps. x' is scored as stored (in
    the sample's dtype), so sampling and later re-scoring give the same log-prob.
    """
    dtype = compute_dtype(sample)
    x, v = sample.to(dtype), model_output.to(dtype)
    sigma, sigma_next = _sigma_pair(sde.sigmas, index, x, dtype)
    mean, std = TRANSITIONS[sde.kind](sde, x, v, sigma, sigma_next)
    if prev_sample is None:
        eps = noise if noise is not None else _noise(x, generator, dtype)
        prev_sample = (mean + std * eps).detach().to(sample.dtype)
    else:
        prev_sample = prev_sample.detach()
    return prev_sample, _log_prob(sde.kind, prev_sample.to(dtype), mean, std), mean, std


def ode_step(model_output: Tensor, sample: Tensor, sigmas: Tensor, index: int | Tensor) -> Tensor:
    """Deterministic Euler step ``x' = x + (σ' − σ)·v``, computed in float32 (float64 for float64 samples) and
    returned in the sample's dtype."""
    dtype = compute_dtype(sample)
    sigma, sigma_next = _sigma_pair(sigmas, index, sample, dtype)
    return (sample.to(dtype) + (sigma_next - sigma) * model_output.to(dtype)).to(sample.dtype)


def dpm_solver_pp_step(
    sample: Tensor, x0: Tensor, prev_x0: Tensor | None, sigma_prev: Tensor | None, sigma: Tensor, sigma_next: Tensor
) -> Tensor:
    """One deterministic DPM-Solver++ step (Lu et al. 2022, arXiv:2211.01095, eq. 5 and the 2M midpoint form) from
    sigma to sigma' on the data prediction x0 = x - sigma v, with alpha = 1 - sigma, lambda = log(alpha / sigma),
    h = lambda' - lambda:

        first order:   x' = (sigma' / sigma) x - alpha' (e^-h - 1) D0                         (DDIM)
        second order:  x' = (sigma' / sigma) x - alpha' (e^-h - 1) (D0 + D1 / 2),  D1 = (D0 - D_prev) / r,
                       r = (lambda - lambda_prev) / h

    where D0 = x0, D_prev = ``prev_x0`` (the previous step's, at ``sigma_prev``; None: first order). At sigma' = 0
    (lambda' = inf) the step is x0, first order, as MixGRPO's solver takes its last step
    (fastvideo/utils/sampling_utils.py:308, :328-337, :436). Computed in the sample's compute dtype, returned in its
    dtype."""
    dtype = compute_dtype(sample)
    if float(sigma_next) == 0:
        return x0.to(sample.dtype)
    x, d0 = sample.to(dtype), x0.to(dtype)
    sigma, sigma_next = sigma.to(dtype), sigma_next.to(dtype)
    lam, lam_next = torch.log((1 - sigma) / sigma), torch.log((1 - sigma_next) / sigma_next)
    h = lam_next - lam
    step = d0
    if prev_x0 is not None:
        sigma_prev = sigma_prev.to(dtype)
        r = (lam - torch.log((1 - sigma_prev) / sigma_prev)) / h
        step = d0 + (d0 - prev_x0.to(dtype)) / (2 * r)
    return (sigma_next / sigma * x - (1 - sigma_next) * torch.expm1(-h) * step).to(sample.dtype)


def tail_sigmas(sigmas: Tensor, last_sde: int, compress: float, shift: float) -> Tensor:
    """The sigmas after the SDE window whose last step is ``last_sde`` = L (MixGRPO-Flash,
    fastvideo/utils/sampling_utils.py:41-54): with N steps and t = linspace(1, 0, N + 1) the uniform grid's time,
    int(max((N - L) x compress, 1)) points from t_{L+1} to 0, shifted as the grid is (:func:`sigma_schedule`); with
    ``compress`` 1, the run's own ``sigmas[L + 1:]``. On ``sigmas``' device and dtype."""
    if compress == 1:
        return sigmas[last_sde + 1 :]
    n = len(sigmas) - 1
    start = torch.linspace(1, 0, n + 1, dtype=torch.float32)[last_sde + 1]
    t = torch.linspace(float(start), 0, int(max((n - last_sde) * compress, 1)), dtype=torch.float32)
    return (shift * t / (1 + (shift - 1) * t)).to(device=sigmas.device, dtype=sigmas.dtype)


def rollout_sigmas(sigmas: Tensor, stochastic: Sequence[bool], cfg: SampleConfig) -> Tensor:
    """The grid a rollout walks: ``sigmas`` up to the step after the last SDE step, then :func:`tail_sigmas` (the run's
    own grid unless ``sample.tail_compress`` < 1). The trained steps, all SDE steps, keep their sigmas."""
    last_sde = max((i for i, s in enumerate(stochastic) if s), default=None)
    if last_sde is None or cfg.tail_compress == 1:
        return sigmas
    return torch.cat([sigmas[: last_sde + 1], tail_sigmas(sigmas, last_sde, cfg.tail_compress, cfg.shift)])


def sigma_schedule(num_steps: int, shift: float, grid: str = "euler", terminal: float | None = None) -> Tensor:
    """The ``num_steps + 1`` descending sampling sigmas (last entry 0) of a published pipeline, as float64 (from the
    float32 values diffusers computes). With ``f(s) = shift·s/(1 + (shift−1)·s)`` and ``n = num_steps``:

    * ``euler`` (``StableDiffusion3Pipeline``, FlowGRPO's SD3 runs): ``FlowMatchEulerDiscreteScheduler(shift)
      .set_timesteps(n).sigmas``: ``f`` of a linspace from 1 to the scheduler's ``sigma_min`` (which diffusers has
      already shifted once, e.g. 0.00893 for shift 3), then 0. ``sigmas[0] = 1``.
    * ``uniform`` (``FluxPipeline``, i.e. FlowGRPO's FLUX runs, and DanceGRPO): ``f(linspace(1, 0, n + 1))`` in
      float32 (FluxPipeline passes ``linspace(1, 1/n, n)`` and appends 0: the same points). FLUX's
      resolution-dependent ``mu`` is ``shift = e^mu``.
    * ``unipc`` (``WanPipeline``, FlowGRPO's Wan runs): ``UniPCMultistepScheduler(use_flow_sigmas, flow_shift=shift)
      .set_timesteps(n).sigmas`` (diffusers 0.42: ``f(linspace(1, 1/1000, n + 1)[:n])`` with ``f(1)`` nudged to
      ``1 − 1e-6``, then 0).

    ``terminal`` (a scheduler config's ``shift_terminal``, Qwen-Image's 0.02) stretches the shifted non-zero sigmas
    so that the last is ``terminal``: ``1 − (1 − s) (1 − terminal) / (1 − s_last)``, as
    ``FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal`` does before appending 0 (``euler`` and ``uniform``).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler  # local: heavy import

    if grid not in SIGMA_GRIDS:
        raise ValueError(f"grid={grid!r}: must be one of {', '.join(SIGMA_GRIDS)}")
    if grid == "unipc":
        if terminal is not None:
            raise ValueError("the unipc grid has no terminal stretch")
        scheduler = UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=shift, prediction_type="flow_prediction")
        scheduler.set_timesteps(num_steps)
        return scheduler.sigmas.to(torch.float64)
    if grid == "uniform":
        s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float32)
        sigmas = shift * s / (1 + (shift - 1) * s)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
        scheduler.set_timesteps(num_steps)
        sigmas = scheduler.sigmas
    if terminal is not None:
        one_minus = 1 - sigmas[:-1]
        sigmas = torch.cat([1 - one_minus / (one_minus[-1] / (1 - terminal)), sigmas[-1:]])
    return sigmas.to(torch.float64)


@dataclass(frozen=True)
class StepSelection:
    """Which sampling steps are stochastic and which each sample trains on.

    ``stochastic``: BoolTensor [num_steps]; SDE steps (the others are ODE steps, neither stored nor trained).
    ``trained``: BoolTensor [B, num_steps]; ``trained[b, i]`` -> sample ``b``'s step ``i`` enters the loss. Always a
    subset of ``stochastic`` and never the last step.
    ``window_start``: first step of the FlowGRPO-Fast SDE window, ``None`` without a window.
    """

    stochastic: Tensor
    trained: Tensor
    window_start: int | None = None
    shared_grad_steps: Tensor | None = None
    """The steps some sample of *any* process trains, when the processes must track the same steps (a sharded
    policy's passes are collectives: ``lean.parallel.sharding``); None: this process's own."""

    @property
    def grad_steps(self) -> Tensor:
        """BoolTensor [num_steps]: steps that at least one sample trains on (where a rollout needs a graph)."""
        return self.trained.any(dim=0) if self.shared_grad_steps is None else self.shared_grad_steps


def window_selection(num_steps: int, batch_size: int, start: int, size: int) -> StepSelection:
    """Steps ``start .. start + size - 1`` stochastic and trained for every sample, all others ODE steps
    (FlowGRPO-Fast's window, MixGRPO's sliding one). The last step is never in it."""
    if not (size >= 1 and 0 <= start and start + size <= num_steps - 1):
        raise ValueError(f"window [{start}, {start + size}): must lie in [0, num_steps - 1 = {num_steps - 1}]")
    stochastic = torch.zeros(num_steps, dtype=torch.bool)
    stochastic[start : start + size] = True
    return StepSelection(stochastic=stochastic, trained=stochastic.expand(batch_size, -1).clone(), window_start=start)


def num_trained_steps(num_steps: int, timestep_fraction: float, base: str = "all") -> int:
    """``K = clip(floor(M·timestep_fraction), 1, num_steps−1)`` trained steps, the last step never, with ``M = N``
    for ``base="all"`` (FlowGRPO: 10 x 0.99 -> 9) and ``M = N − 1`` for ``"trainable"`` (DanceGRPO: 12 steps x 0.6
    -> 6, where "all" gives 7). A 1e-9 slack absorbs binary rounding of decimal fractions (100 x 0.29 =
    28.999999999999996 -> 29, not 28)."""
    if base not in FRACTION_BASES:
        raise ValueError(f"base={base!r}: must be one of {', '.join(FRACTION_BASES)}")
    m = num_steps if base == "all" else num_steps - 1
    return max(1, min(math.floor(m * timestep_fraction + 1e-9), num_steps - 1))


@dataclass(frozen=True)
class StepRule:
    """How a rollout of ``num_steps`` steps chooses its stochastic and trained steps (``sample.*``: the keys of the
    same names, ``fraction_of`` is ``timestep_fraction_of``, ``selection`` is ``timestep_selection``).

    Without a window (``sde_window == 0``) every step is stochastic, and ``K = num_trained_steps(...)`` steps (of
    ``fraction_of``) are trained per sample: ``selection="first"`` (FlowGRPO) steps ``0..K−1`` for every sample,
    ``"random"`` (DanceGRPO) the first ``K`` entries of ``randperm(num_steps−1)`` of each sample's stream.

    With a window ``w = sde_window > 0`` (FlowGRPO-Fast) a start ``s`` is drawn uniformly from
    ``[sde_window_min_start, sde_window_max_start]`` (min 0 by default; Flow-Factory's sde_steps start at 1), or is
    ``sde_window_start`` at every iteration when set; steps ``s..s+w−1`` are stochastic and trained for every sample,
    all others are ODE steps; ``timestep_fraction`` and ``selection`` are ignored then. With ``sde_steps_drawn = k >
    0`` only ``k`` steps of the window, the first ``k`` of a ``randperm(w)`` drawn after the start (UniRL's
    ``rng.choice(pool, k, replace=False)``, scheduler_utils.py:118-124 at 1a7b501), are stochastic and trained, the
    window's others ODE steps. The default ``sde_window_max_start = max(0, num_steps // 2 − w)`` keeps the window in
    the first half of the schedule (steps ``< num_steps // 2``) where it fits, as FlowGRPO-Fast does; it must satisfy
    ``s + w ≤ num_steps − 1`` so the last step is never in the window.
    """

    num_steps: int
    timestep_fraction: float = 1.0
    fraction_of: str = "all"
    selection: str = "first"
    sde_window: int = 0
    sde_window_max_start: int | None = None
    sde_window_start: int | None = None
    sde_window_min_start: int = 0
    sde_steps_drawn: int = 0

    @classmethod
    def of(cls, cfg: SampleConfig) -> StepRule:
        """The sampler's rule (``sample.*``)."""
        return cls(
            cfg.num_steps,
            timestep_fraction=cfg.timestep_fraction,
            fraction_of=cfg.timestep_fraction_of,
            selection=cfg.timestep_selection,
            sde_window=cfg.sde_window,
            sde_window_max_start=cfg.sde_window_max_start,
            sde_window_start=cfg.sde_window_start,
            sde_window_min_start=cfg.sde_window_min_start,
            sde_steps_drawn=cfg.sde_steps_drawn,
        )


def _drawn_window(rule: StepRule, batch_size: int, generator: torch.Generator | None) -> StepSelection:
    """The window of ``rule`` (``sde_window > 0``) at its fixed start, else at one drawn with ``generator`` (the
    global RNG when None); with ``sde_steps_drawn`` only that many of its steps, drawn next from ``generator``."""
    n, w = rule.num_steps, rule.sde_window
    if w > n - 1:
        raise ValueError(f"sde_window={w}: must be <= num_steps - 1 = {n - 1}")
    max_start = window_max_start(n, w, rule.sde_window_max_start)
    if not 0 <= max_start <= n - 1 - w:
        raise ValueError(f"sde_window_max_start={max_start}: must be in [0, {n - 1 - w}]")
    if not 0 <= rule.sde_window_min_start <= max_start:
        raise ValueError(f"sde_window_min_start={rule.sde_window_min_start}: must be in [0, {max_start}]")
    start = rule.sde_window_start
    if start is None:
        start = int(torch.randint(rule.sde_window_min_start, max_start + 1, (1,), generator=generator))
    window = window_selection(n, batch_size, start, w)
    k = rule.sde_steps_drawn
    if not k:
        return window
    if not 0 < k <= w:
        raise ValueError(f"sde_steps_drawn={k}: must be in [0, sde_window = {w}]")
    # after the start, from the same stream: a window drawn as before is drawn the same
    stochastic = torch.zeros(n, dtype=torch.bool)
    stochastic[start + torch.randperm(w, generator=generator)[:k]] = True
    return StepSelection(stochastic=stochastic, trained=stochastic.expand(batch_size, -1).clone(), window_start=start)


def select_steps(
    rule: StepRule,
    batch_size: int,
    *,
    window_generator: torch.Generator | None = None,
    sample_generators: Sequence[torch.Generator] | None = None,
) -> StepSelection:
    """The stochastic and trained steps of one rollout of ``batch_size`` samples by ``rule`` (:class:`StepRule`):
    a window's start drawn with ``window_generator``, a random selection's steps of sample ``b`` with
    ``sample_generators[b]`` (the global RNG when None)."""
    num_steps = rule.num_steps
    if num_steps < 2:
        raise ValueError(f"num_steps={num_steps}: need >= 2 (the last step is never trained)")
    if rule.selection not in STEP_SELECTIONS:
        raise ValueError(f"selection={rule.selection!r}: must be one of {', '.join(STEP_SELECTIONS)}")
    if rule.sde_window > 0:
        return _drawn_window(rule, batch_size, window_generator)
    trained = torch.zeros(batch_size, num_steps, dtype=torch.bool)
    k = num_trained_steps(num_steps, rule.timestep_fraction, rule.fraction_of)
    if rule.selection == "first":
        trained[:, :k] = True
    else:
        if sample_generators is not None and len(sample_generators) != batch_size:
            raise ValueError(f"sample_generators: got {len(sample_generators)} for batch_size={batch_size}")
        for b in range(batch_size):
            g = sample_generators[b] if sample_generators is not None else None
            trained[b, torch.randperm(num_steps - 1, generator=g)[:k]] = True
    return StepSelection(stochastic=torch.ones(num_steps, dtype=torch.bool), trained=trained)
