"""Online Diffusion-DPO on flow matching, as FlowGRPO ships it beside GRPO.

Source: github.com/yifan123/flow_grpo, commit ac4c86e: scripts/train_sd3_dpo.py ("the script"), config/dpo.py,
flow_grpo/stat_tracking.py ("stat_tracking"). Wallace et al. 2023 (Diffusion-DPO), arXiv:2311.12908.

Rollout: the run's SDE sampler (the script :619-631, FlowGRPO's SDE at every step, CFG 4.5), by the reference
weights (:618; ``algorithm.dpo.sample_from``); only the final latents x_0 are kept, which is what Diffusion-DPO
ranks (the script's ``latents[-1]`` at :652 keeps the batch's last trajectory instead, a slip: the dpo-sd3 preset's
header).

Pairs: in every prompt group the best sample is chosen (w) and the worst rejected (l), the first index on a tie; a
group whose rewards are all equal still gives the pair (w, l) = (its second, its first sample)
(stat_tracking:38-52). The targets are +1 at w, -1 at l, 0 elsewhere; the reward's size enters nothing else.

Loss of pair p at draw j (:871-939): a noise level on diffusers' 1000-point training grid, sigma = shift(1 - i/1000)
with i = floor(1000 sigmoid(z)), z ~ N(0, 1) (logit-normal; :890-902), one noise eps for both samples (:884-886),
x_t = (1 - sigma) x_0 + sigma eps; with e(x) = mean_D (v(x_t) - (eps - x_0))^2 the flow-matching error of the
trained weights and e_ref that of the reference (no gradient):

    logit_pj = -beta / 2 [(e(w) - e_ref(w)) - (e(l) - e_ref(l))]
    loss_pj  = -log sigmoid(logit_pj)                           (:926-939; beta = algorithm.dpo.beta, 100)

L = 1/(P K) sum_p sum_j loss_pj per optimizer step, K = int(0.99 N) draws (:320; 39 of 40). Training forwards are
conditional only (no CFG, :868-869).

The reference is a second copy of the trainable weights (``lean.models.snapshot.Snapshot``), the starting ones, copied
from the trained weights every ``algorithm.dpo.ref_update_every`` optimizer steps (before a rollout, :614-615):
FlowGRPO's "ref" adapter, which starts equal to the learner and is copied into with its ``ref_update_step`` (the
config's comment: 40 makes it OnlineDPO).

Why no Lean schedule: the trained forwards are at re-noised x_t, never a rollout step (``lean.algorithms.
clean_samples``).

What differs from the source: a pair's two samples must sit on one process (lean lays out whole groups); the source
pads the pair count to a multiple of the processes with random duplicates (:804-817), lean needs no padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lean.algorithms.base import StepLoss
from lean.algorithms.clean_samples import (
    CleanSampleAlgorithm,
    Velocities,
    logit_normal_sigmas,
    per_sample_mean,
    renoise,
)
from lean.config.checks import check_positive, choice, choices
from lean.config.registry import Registry
from lean.config.sections import register_options

if TYPE_CHECKING:
    from lean.config import RunConfig

DPO_SAMPLERS: Registry[str] = Registry(
    "DPO sampler",
    [
        ("reference", "the reference weights roll out (the script :618: its ref adapter)"),
        ("policy", "the trained weights roll out (on-policy pairs)"),
    ],
)
CHOSEN, REJECTED = 1.0, -1.0


def best_and_worst(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """+1 at each group's best sample, -1 at its worst (first index on a tie; all equal: the second is chosen, the
    first rejected, as stat_tracking:42-47), 0 elsewhere; float64 [N]."""
    targets = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for g in group_ids.unique():
        members = torch.nonzero(group_ids == g).flatten()
        r = rewards[members]
        best, worst = int(torch.argmax(r)), int(torch.argmin(r))
        if best == worst:
            worst, best = 0, 1
        targets[members[best]], targets[members[worst]] = CHOSEN, REJECTED
    return targets


class DPO(CleanSampleAlgorithm):
    """Diffusion-DPO on each group's best/worst pair (module docstring; ``algorithm.dpo``)."""

    rollout = "sde"
    uses_snapshot = True
    unit_size = 2

    def __init__(self, cfg: RunConfig, sigmas: Tensor | None):
        super().__init__(cfg, sigmas)
        self.group_size = cfg.train.group_size

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple[str, object, str] | None:
        t, how = cfg.train, cfg.algorithm.reward_combination
        if how != "sum":
            return "algorithm.reward_combination", how, "dpo ranks a group by its weighted reward sum: needs sum"
        if t.group_size < 2:
            return "train.group_size", t.group_size, "dpo pairs two samples of a group: needs >= 2"
        ranks = (world_size or 1) // cfg.parallel.sequence_parallel  # data-parallel ranks: each holds P / ranks groups
        if ranks > 1 and t.prompts_per_iteration % ranks:
            return (
                "train.prompts_per_iteration",
                t.prompts_per_iteration,
                f"dpo pairs within a group, so each rank needs whole groups: a multiple of the {ranks} data ranks",
            )
        return None

    def snapshot_decay(self, optimizer_steps: int) -> float | None:
        every = self.cfg.dpo.ref_update_every
        return 0.0 if every and optimizer_steps > 0 and optimizer_steps % every == 0 else None

    @property
    def rolls_out_snapshot(self) -> bool:
        return self.cfg.dpo.sample_from == "reference"

    @property
    def untracked_forwards_per_term(self) -> int:
        return 1  # the reference's

    @property
    def trained_share(self) -> float:
        return 2 / self.group_size

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        return best_and_worst(rewards.double(), group_ids)

    def units(self, targets: Tensor, group_ids: Tensor) -> Tensor:
        """[P, 2]: (chosen, rejected) local rows of every local group, in group order."""
        pairs = []
        for g in group_ids.unique():
            members = torch.nonzero(group_ids == g).flatten()
            t = targets[members].cpu()
            if not ((t == CHOSEN).any() and (t == REJECTED).any()):
                raise ValueError(f"group {int(g)} is split over processes: dpo needs whole groups on each")
            pairs.append(torch.stack([members[t == CHOSEN][0], members[t == REJECTED][0]]))
        return torch.stack(pairs) if pairs else torch.zeros(0, 2, dtype=torch.long)

    def noise_levels(self, generator: torch.Generator) -> Tensor:
        return logit_normal_sigmas(
            torch.randn(self.draws_per_unit, generator=generator, dtype=torch.float64), self.sample.shift
        )

    def unit_loss(self, velocities: Velocities, x0, rows, targets, draw_t, noise) -> StepLoss:
        """x0 [2P, ...] and rows [2P] are pair-major: (w_1, l_1, w_2, l_2, ...)."""
        t, eps = draw_t.repeat_interleave(2), noise.repeat_interleave(2, dim=0)
        x_t = renoise(x0, t, eps)
        dtype = torch.float64 if x0.dtype == torch.float64 else torch.float32
        flow = (eps.to(x0.device) - x0).to(dtype)
        with torch.no_grad():  # first: the snapshot's weights are swapped in place
            ref_error = per_sample_mean((velocities.snapshot(x_t, t, rows).to(dtype) - flow) ** 2)
        error = per_sample_mean((velocities.policy(x_t, t, rows).to(dtype) - flow) ** 2)
        gap = (error - ref_error).view(-1, 2)  # [P, (w, l)]
        logit = -0.5 * self.cfg.dpo.beta * (gap[:, 0] - gap[:, 1])
        policy = -torch.nn.functional.logsigmoid(logit)
        return StepLoss(policy, None, torch.ones_like(policy).detach())

    def reference_unit_loss(self, velocities: Velocities, x0, rows, targets, draw_t, noise) -> Tensor:
        """Each sample in its own forward, the loss as log(1 + e^-logit) per pair (float64). Every reference forward
        runs before the first trained one (the snapshot's weights are swapped in place)."""
        x, eps = x0.double(), noise.double().to(x0.device)
        inputs = []  # (x_t, sigma, row, flow target) of each sample, pair-major
        for i in range(x.shape[0]):
            sigma = draw_t[i // 2 : i // 2 + 1].double().to(x.device)
            inputs.append(
                ((1 - sigma) * x[i : i + 1] + sigma * eps[i // 2], sigma, rows[i : i + 1], eps[i // 2] - x[i])
            )
        ref = [((velocities.snapshot(x_t, s, r).double() - u) ** 2).mean() for x_t, s, r, u in inputs]
        own = [((velocities.policy(x_t, s, r).double() - u) ** 2).mean() for x_t, s, r, u in inputs]
        diff = [a - b for a, b in zip(own, ref)]
        beta = self.cfg.dpo.beta
        return torch.stack(
            [torch.nn.functional.softplus(beta / 2 * (diff[2 * p] - diff[2 * p + 1])) for p in range(len(diff) // 2)]
        )


@register_options("algorithm.dpo")
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
