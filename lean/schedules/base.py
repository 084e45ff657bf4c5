"""What the three schedules share: the iteration's context, the per-term loss weights, flat gradient buffers.

A schedule decides three things and nothing else:
  * ``track_grad(i)`` / ``grad_micro_batch``: which rollout steps run with autograd on, in which micro-batches;
  * ``on_step(step)``: what to do with each SDE step of the rollout (store it, keep its graph, or backpropagate it);
  * ``finish(advantages, optimizer_step)``: turn the advantages into gradients in ``param.grad`` and call
    ``optimizer_step()`` (which syncs the gradients across processes, clips, steps the optimizer) once per update.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from lean.config import RunConfig
from lean.metrics import FlopTally, PhaseTimer
from lean.rollout import StepOutput, reference_mean
from lean.sde import StepPlan


@dataclass
class IterationContext:
    """Everything about one process's share of one iteration that a schedule needs."""

    policy: object
    cfg: RunConfig
    sigmas: torch.Tensor
    emb: object  # PromptEmbeds of the local samples
    plan: StepPlan  # trained: BoolTensor [B_local, num_steps]
    tally: FlopTally = field(default_factory=FlopTally)  # counts only inside tally.measuring()
    timer: PhaseTimer = field(default_factory=PhaseTimer)

    @contextlib.contextmanager
    def region(self, name: str):
        """Time and count the FLOPs of a named part of the work (backward, recompute_forward, ...)."""
        with self.timer(name), self.tally.region(name):
            yield

    @property
    def batch(self) -> int:
        return self.plan.trained.shape[0]

    @property
    def steps_per_sample(self) -> int:
        """K: every sample trains the same number of steps."""
        return int(self.plan.trained[0].sum())

    @property
    def beta(self) -> float:
        return self.cfg.train.beta

    def term_weights(self, rows: torch.Tensor, i: int, samples_per_update: int) -> torch.Tensor:
        """Weight of each (sample, step i) loss term in the objective: 1/(N K) if step i is trained for it, else 0."""
        trained = self.plan.trained[rows, i].to(self.sigmas.dtype)
        return trained / (samples_per_update * self.steps_per_sample)

    def reference_mean(self, step: StepOutput) -> torch.Tensor | None:
        """The reference policy's transition mean at the step's x_i (None when the KL term is off)."""
        if self.beta == 0:
            return None
        index = torch.full((len(step.rows),), step.index, dtype=torch.long)
        with self.region("reference_forward"):
            return reference_mean(self.policy, step.sample, index, self.emb.index(step.rows), self.cfg.sample,
                              self.sigmas, step.next_sample)


OptimizerStep = Callable[[], dict]


class Schedule:
    """Base class; see the module docstring for the contract."""

    name = "base"
    grad_micro_batch: int | None = None

    def __init__(self, ctx: IterationContext):
        self.ctx = ctx
        self.any_trained = ctx.plan.trained.any(dim=0)  # [num_steps]: steps at least one sample trains

    def track_grad(self, i: int) -> bool:
        return bool(self.any_trained[i])

    def on_step(self, step: StepOutput) -> None:
        raise NotImplementedError

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        raise NotImplementedError


# ---------------------------------------------------------------- flat gradient buffers


def trainable(policy) -> list[torch.nn.Parameter]:
    return [p for _, p in policy.trainable_parameters()]


def flat_grad(params: list[torch.nn.Parameter], grads) -> torch.Tensor:
    """Concatenate per-parameter gradients (None -> zeros) into one vector."""
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(params, grads)])


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Write a flat gradient vector into ``param.grad`` (adding to what is there)."""
    offset = 0
    for p in params:
        n = p.numel()
        g = flat[offset:offset + n].view_as(p)
        p.grad = g.clone() if p.grad is None else p.grad + g
        offset += n
