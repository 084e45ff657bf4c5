"""AWM: advantage-weighted matching, a flow-matching loss on the rollout's clean samples weighted by the advantage.

Source: github.com/scxue/advantage_weighted_matching at 12b1397 ("Initial commit of code"; the newest, be51372, changes
only the GenEval configs' KL weight): advantage_weighted_matching/scripts/train_sd3_awm.py ("the script"),
config/dgx_awm.py ``pickscore_sd3_no_cfg_1node`` (the recipe train_awm_scripts_pickscore/train_single_node.sh runs),
config/base_awm.py, flow_grpo/stat_tracking.py. Line numbers (":N") are the script's.

Rollout: deterministic, by the trained policy (``off_policy = False``), no CFG; each sample's last latent is its clean
x_0 (:1209).

Targets: GRPO's group advantages over the std of all rewards plus 1e-4 (``global_std``, stat_tracking.py:26-31), then

    A'_b = clip(A_b, -C, C) / C * a_max      (:1293-1299; C = ``algorithm.adv_clip_max``, a_max = ``advantage_max``)

Noise levels: K = ``algorithm.awm.draws`` indices of the rollout's grid, one per stratum of the first M = int(N f) steps
(f = ``sample.timestep_fraction``; ``time_draw`` discrete, :1172-1180; discrete_wo_init starts at step 1, :1197-1205):

    bounds = long(linspace(s0, M, K + 1)),  i_k = bounds_k + long(u_k (bounds_{k+1} - bounds_k)),  t_k = sigma_{i_k}

and a fresh eps per draw: x_t = (1 - t) x_0 + t eps (:1212-1232). Loss of sample b at draw k, in float64 (:237),
v = v_theta(x_t, t), v_ref the reference's (adapter off), v_ema the EMA policy's (:1265-1289):

    e = mean_D (v - (eps - x_0))^2                                                          (:238-239)
    log p = -w(e, t)   w (``weighting``, :240-251): uniform e | t  t e | t2  t^2 e | huber  t (sqrt(e + 1e-10) - 1e-5)
                       | ghuber  t ((e + 1e-10)^q - 1e-10^q) / q,  q = ``ghuber_power``
    policy = max(-A' r, -A' clip(r, 1 - c, 1 + c)),  r = exp(log p - sg(log p))             (:1305-1327)
    kl = beta mean_D (v - v_ref)^2 + beta_ema mean_D (v - v_ema)^2                          (:1330-1352, 'Uniform')

On-policy the old log-prob is the update's own forward (:1282-1284), so r = 1 to the bit: the policy term's value is
-A' and its gradient A' grad w (the clip never acts). L = 1/(N K) sum_b sum_k (policy + kl) per optimizer step: each
micro-batch's mean over its K x B terms, divided by the accumulation count (accelerate's ``accumulate``, :1265, :1372),
which spans the whole rollout (dgx_awm.py:330-331): one optimizer step per rollout.

The EMA policy is a second copy of the trainable weights (``lean.models.snapshot.Snapshot``, the script's "ema" LoRA
adapter): a copy at the start (:649-658), then after each rollout's update ema <- d ema + (1 - d) theta, d =
min(``ema_decay``, 0.001 s) after s optimizer steps (``ema_decay_kind`` linear; constant: d = ``ema_decay``,
:1409-1419). It gives v_ema only; the trained weights roll out.

Why no Lean schedule: every trained forward is at a freshly re-noised x_t, never a rollout step
(``lean.algorithms.clean_samples``).

What differs from the source:
  * the K noise levels are drawn per sample from its own stream (``lean.schedules.renoised``); the script draws them
    once per micro-batch, shared by its samples (:1172-1180), and its noises from the global RNG: the same
    distribution per sample, another joint one;
  * the script computes the EMA term only when beta > 0 (:1272, :1330) and needs beta > 0 to run at all (:1286 reads
    ``log_prob_ref``); lean weighs each term by its own key;
  * ``optimizer_steps_per_iteration`` and ``num_inner_epochs`` must be 1: with several accumulation windows the
    script's later ones compare with an old log-prob of its pre-update pass (:1227-1238), which lean does not keep, and
    the script has no inner-epoch loop (``num_inner_epochs`` is never read);
  * not built: the time draws logit_normal, uniform and discrete_with_init (:1138-1196), the ELBO KL weights
    (:1334-1335, :1343-1344), ``sum_first`` (:1301-1304), ``off_policy`` sampling by the EMA adapter (:883-884),
    ``train.cfg`` (:211-224): none is in the published configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.algorithms.base import StepLoss
from lean.algorithms.clean_samples import CleanSampleAlgorithm, Velocities, per_sample_mean, renoise
from lean.algorithms.reward_combination import combined_advantages
from lean.config.checks import ConfigError, check_positive, choice, choices
from lean.config.registry import Registry
from lean.config.sections import register_options

if TYPE_CHECKING:
    from lean.config import RunConfig

WEIGHTINGS: Registry[str] = Registry(
    "AWM weighting",
    [
        ("ghuber", "t ((e + 1e-10)^q - 1e-10^q) / q (the published configs, q = 0.25, dgx_awm.py:341-342)"),
        ("uniform", "e, the plain flow-matching error"),
        ("t", "t e"),
        ("t2", "t^2 e"),
        ("huber", "t (sqrt(e + 1e-10) - 1e-5)"),
    ],
)
TIME_DRAWS: Registry[str] = Registry(
    "AWM time draw",
    [
        ("discrete", "one grid step per stratum of steps [0, M) (the PickScore config, dgx_awm.py:367)"),
        ("discrete_wo_init", "one grid step per stratum of steps [1, M) (the GenEval and OCR configs, :88, :228)"),
    ],
)
EMA_DECAY_KINDS: Registry[str] = Registry(
    "AWM EMA decay",
    [
        ("linear", "d = min(ema_decay, 0.001 s) after s optimizer steps (dgx_awm.py:346, the script :1412-1413)"),
        ("constant", "d = ema_decay (:1410-1411)"),
    ],
)
FLOOR = 1e-10  # inside the (g)huber root (:247, :249)


def matching_weight(kind: str, error: Tensor, t: Tensor, power: float) -> Tensor:
    """w(e, t) = -log p of the module docstring [b], from the flow-matching error e [b] and the noise level t [b]."""
    if kind == "uniform":
        return error
    if kind == "t":
        return t * error
    if kind == "t2":
        return t**2 * error
    if kind == "huber":
        return t * (torch.sqrt(error + FLOOR) - FLOOR**0.5)
    return t * ((error + FLOOR) ** power - FLOOR**power) / power


class AWM(CleanSampleAlgorithm):
    """Advantage-weighted matching (module docstring; ``algorithm.awm``)."""

    rollout = "ode"
    uses_snapshot = True  # the EMA policy of the regulariser

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        t = cfg.train
        if cfg.sample.sde_window:
            return "sample.sde_window", cfg.sample.sde_window, "awm rolls out ODE steps only: set 0"
        if t.optimizer_steps_per_iteration != 1:
            return (
                "train.optimizer_steps_per_iteration",
                t.optimizer_steps_per_iteration,
                "awm's ratio is 1 only in its on-policy recipe, one optimizer step per rollout: set 1",
            )
        if t.num_inner_epochs != 1:
            return "train.num_inner_epochs", t.num_inner_epochs, "the AWM script has no inner epochs: set 1"
        return None

    def snapshot_decay(self, optimizer_steps: int) -> float:
        o = self.cfg.awm
        return o.ema_decay if o.ema_decay_kind == "constant" else min(o.ema_decay, 0.001 * optimizer_steps)

    @property
    def kl_weight(self) -> float:
        """1 when either regulariser is on: the regulariser carries its own weights beta and beta_ema."""
        o = self.cfg.awm
        return 1.0 if o.beta or o.ema_beta else 0.0

    @property
    def untracked_forwards_per_term(self) -> int:
        o = self.cfg.awm
        return (1 if o.beta else 0) + (1 if o.ema_beta else 0)

    @property
    def draws_per_unit(self) -> int:
        return self.cfg.awm.draws

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        return combined_advantages(self.cfg, rewards, group_ids, components, self.reward_weights)

    def weights(self, targets: Tensor) -> Tensor:
        """A' = clip(A, -C, C) / C * a_max [B] (a_max None: clip(A, -C, C))."""
        c, a_max = self.cfg.adv_clip_max, self.cfg.awm.advantage_max
        clipped = targets.clamp(-c, c)
        return clipped if a_max is None else clipped / c * a_max

    def noise_levels(self, generator: torch.Generator) -> Tensor:
        """K grid levels sigma_i, one step i per stratum (module docstring), float64 [K]."""
        k, first = self.cfg.awm.draws, 1 if self.cfg.awm.time_draw == "discrete_wo_init" else 0
        bounds = torch.linspace(first, int(self.sample.num_steps * self.sample.timestep_fraction), k + 1).long()
        steps = bounds[:-1] + (torch.rand(k, generator=generator) * (bounds[1:] - bounds[:-1])).long()
        return self.sigmas[:-1].cpu().double()[steps]

    def unit_loss(self, velocities: Velocities, x0, rows, targets, draw_t, noise) -> StepLoss:
        x_t, o = renoise(x0, draw_t, noise), self.cfg.awm
        v_ema = velocities.snapshot(x_t, draw_t, rows).double() if o.ema_beta else None  # first: swapped in place
        v = velocities.policy(x_t, draw_t, rows).double()
        t = draw_t.to(device=x0.device, dtype=torch.float64)
        error = per_sample_mean((v - (noise.double() - x0.double())) ** 2)
        log_p = -matching_weight(o.weighting, error, t, o.ghuber_power)
        ratio = torch.exp(log_p - log_p.detach())
        policy = -self.weights(targets).to(device=x0.device, dtype=torch.float64) * ratio
        kl = None
        if self.kl_weight:
            kl = torch.zeros_like(policy)
            if o.beta:
                kl = kl + o.beta * per_sample_mean((v - velocities.reference(x_t, draw_t, rows).double()) ** 2)
            if o.ema_beta:
                kl = kl + o.ema_beta * per_sample_mean((v - v_ema) ** 2)
        return StepLoss(policy, kl, ratio.detach())

    def reference_unit_loss(self, velocities: Velocities, x0, rows, targets, draw_t, noise) -> Tensor:
        """Through the x_0-prediction: x_t - t v - x_0 = -t (v - (eps - x_0)), so e = mean_D (x0_hat - x_0)^2 / t^2;
        the surrogate's max of its unclipped and clipped terms written out; float64 throughout."""
        x0, noise, o = x0.double(), noise.double(), self.cfg.awm
        t = draw_t.double().to(x0.device)
        t_b = t.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - t_b) * x0 + t_b * noise
        v_ema = velocities.snapshot(x_t, draw_t, rows).double() if o.ema_beta else None
        v = velocities.policy(x_t, draw_t, rows).double()
        x0_hat = x_t - t_b * v
        error = ((x0_hat - x0) ** 2).flatten(1).mean(1) / t**2
        log_p = -matching_weight(o.weighting, error, t, o.ghuber_power)
        r = torch.exp(log_p - log_p.detach())
        a = self.weights(targets.double().to(x0.device))
        c = self.cfg.clip_range
        loss = torch.maximum(-a * r, -a * torch.clamp(r, 1 - c, 1 + c))
        if o.beta:
            loss = loss + o.beta * ((v - velocities.reference(x_t, draw_t, rows).double()) ** 2).flatten(1).mean(1)
        if o.ema_beta:
            loss = loss + o.ema_beta * ((v - v_ema) ** 2).flatten(1).mean(1)
        return loss


@register_options("algorithm.awm")
@dataclass
class AWMConfig:
    """AWM's keys (``lean/algorithms/awm.py``); defaults: dgx_awm.py ``pickscore_sd3_no_cfg_1node`` at 12b1397."""

    draws: int = 6
    """K: noise levels per sample and rollout (dgx_awm.py:334 train.train_timesteps = 6)."""
    time_draw: str = choice("AWM time draw")
    """How the K levels are drawn from the rollout's grid: a name of ``lean.algorithms.awm.TIME_DRAWS``."""
    weighting: str = choice("AWM weighting")
    """w(e, t) = -log p: a name of ``lean.algorithms.awm.WEIGHTINGS`` (dgx_awm.py:341 'ghuber')."""
    ghuber_power: float = 0.25
    """q of the ghuber weighting (dgx_awm.py:342)."""
    advantage_max: float | None = 1.0
    """a_max: the clipped advantage is rescaled to [-a_max, a_max] (dgx_awm.py:336; None: not rescaled)."""
    beta: float = 1e-4
    """Weight of mean (v_theta - v_ref)^2 against the reference, adapter off (dgx_awm.py:333 train.beta)."""
    ema_beta: float = 1.0
    """Weight of mean (v_theta - v_ema)^2 against the EMA policy (dgx_awm.py:345 train.ema_beta)."""
    ema_decay: float = 0.3
    """d's cap (linear) or value (constant) of the EMA policy's update (dgx_awm.py:344 train.kl_ema_decay)."""
    ema_decay_kind: str = choice("AWM EMA decay")
    """A name of ``lean.algorithms.awm.EMA_DECAY_KINDS`` (dgx_awm.py:346 kl_ema_decay_type = 'linear')."""

    def validate(self, prefix: str) -> None:
        choices(self, prefix)
        check_positive(f"{prefix}.draws", self.draws)
        check_positive(f"{prefix}.ghuber_power", self.ghuber_power)
        if self.advantage_max is not None:
            check_positive(f"{prefix}.advantage_max", self.advantage_max)
        for key in ("beta", "ema_beta"):
            check_positive(f"{prefix}.{key}", getattr(self, key), strict=False)
        if not 0 <= self.ema_decay <= 1:
            raise ConfigError(f"{prefix}.ema_decay", self.ema_decay, "must be in [0, 1]")
