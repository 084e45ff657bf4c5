"""MixGRPO: GRPO on mixed ODE/SDE rollouts whose SDE steps form a window that slides over training.

Source: github.com/Tencent-Hunyuan/MixGRPO, commit e5cdd6a: fastvideo/train_grpo_flux.py ("the script"),
fastvideo/utils/grpo_states.py ("states"), fastvideo/utils/sampling_utils.py ("sampling") and
scripts/finetune/finetune_flux_grpo_MixGRPO{,_Flash,_Flash*}.sh.

The sampler. With N sampling steps, a window of w steps starting at s is stochastic (FlowGRPO's SDE, sampling:157-210)
and trained; every other step is a deterministic Euler step (sampling:198-199, the script :237-239):

    s(g) = floor(g / move_every) x stride, rolled back to 0 past the last start      (states:85-99, :136-139)
    window(g) = [s, min(s + w, N - 2))                                                (states:141-148, script :919)

at iteration g (the script's global_step, from 0: it reads the window before it moves it, :945-947). The window never
reaches step N - 2 (``max_timesteps = sampling_steps - 2``). The published runs shift the window by one step every 25
iterations (Flash: 20) for 300 iterations, so it covers steps 0..14 (Flash 0..17); Flash* (stride 0) keeps it at
steps 0..3. Where the source would start a window at N - 2 itself (with stride 1: at iteration (N - 2) x
move_every, 575 with 25 steps), that window is empty and the script stops on an undefined ratio (:611-612; Flash:
sampling:44); lean rolls back to 0 instead, so from then on its windows run one block ahead of the source's.

MixGRPO-Flash runs the steps after the window with DPM-Solver++(2M) on a coarser grid (``sample.tail_solver``,
``sample.tail_compress``; ``lean.sampling.sde.dpm_solver_pp_step`` and ``lean.sampling.sde.tail_sigmas``). They are
untracked ODE steps and leave the objective alone.

The objective is GRPO's (``lean.algorithms.grpo``) on the window's steps, with the script's surrogate (:567-583):

    loss_bj = max(-A_b r_bj, -A_b clip(r_bj, 1 - c, 1 + c)),    L = 1/(N K) sum_b sum_{j in window} loss_bj

(the script divides by its gradient accumulation count and len(window), over one sample per forward: the same
1/(N K) per update). Its advantages are computed per reward model and summed with the models' weights before the
clamp (:429-456, ``multi_reward_mix: advantage_aggr``): the presets' ``algorithm.reward_combination: per_reward``
(``lean.algorithms.reward_combination``; ``sum`` is its ``reward_aggr``). Its KL term (:583, kl_coeff 0 in every script)
is a squared log-ratio, not GRPO's; lean's ``algorithm.beta`` stays 0 in the presets.

Why Retain and Reweight stay exact: inside the window the steps are GRPO's on-policy SDE steps (ratio identically 1,
loss linear in A); the ODE steps outside it carry no trained term. The certificate (``lean equivalence``) checks it
as it does GRPO's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lean.algorithms.grpo import GRPO
from lean.config.checks import check_positive
from lean.config.sections import register_options
from lean.sampling.sde import window_selection

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.sampling.sde import StepSelection


def window_start(iteration: int, num_steps: int, move_every: int, stride: int) -> int:
    """The window's first step at ``iteration``: floor(iteration / move_every) x stride, back to 0 once it would pass
    the last start N - 3 (a window must hold at least one step s < N - 2), as the source's roll-back resets it
    (grpo_states.py:95-97, :136-139)."""
    if stride == 0:
        return 0
    starts = (num_steps - 3) // stride + 1  # 0, stride, ..., the last one <= N - 3
    return (iteration // move_every) % starts * stride


class MixGRPO(GRPO):
    """GRPO with the sliding SDE window of the module docstring (``algorithm.mixgrpo``)."""

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        if cfg.sample.sde_window:
            return "sample.sde_window", cfg.sample.sde_window, "mixgrpo slides its own window: algorithm.mixgrpo.window"
        if cfg.sample.num_steps < 3:
            return "sample.num_steps", cfg.sample.num_steps, "mixgrpo's window ends before step N - 2: needs N >= 3"
        return None

    @classmethod
    def steps(cls, cfg: RunConfig, iteration: int, batch_size: int) -> StepSelection:
        m, n = cfg.algorithm.mixgrpo, cfg.sample.num_steps
        start = window_start(iteration, n, m.move_every, m.stride)
        return window_selection(n, batch_size, start, min(m.window, n - 2 - start))


@register_options("algorithm.mixgrpo")
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
