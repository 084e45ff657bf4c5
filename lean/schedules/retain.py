"""LeanGRPO-Retain: keep the rollout's own graphs and backpropagate them once the advantages are known.

On-policy (one optimizer step per rollout batch, one inner epoch, same dtype and process), the update's forward pass
at trained step j is the rollout's forward pass at step j: same weights, same x_j, same noise. Retain therefore runs
the trained steps of the rollout with autograd on (other steps under ``no_grad``) and keeps, per trained step, the
log-prob and transition mean together with their graphs and saved activations. After rewards and advantages A:

    L = 1/(N K) sum_b sum_{j in T_b} [ max(-A_b r_bj, -A_b clip(r_bj, 1-c, 1+c)) + beta KL_bj ],
        r_bj = exp(log p_bj - stopgrad(log p_bj)) = 1,  so  dL/dtheta = 1/(N K) sum_bj [ -A_b dlog p_bj + beta dKL_bj ]

and one ``L.backward()`` replaces Recompute's K forward + backward passes: no second forward. The price is memory: the
activations of (trained steps x local batch) forward passes stay alive until the backward; ``lean plan`` predicts it
(``predict``, in the terms of ``base.IterationCosts``):

    memory = base + K act h + max(decode, transient)      time = (n - K) f + K fb + score + ref

where h is the share of the local batch whose graphs are held at once: 1 in the slice layout, one finishing unit
(a group) / B in the group layout, where each group is backpropagated as soon as it is scored (``finish_rows``).
"""

from __future__ import annotations

import torch

from lean.loss import loss_stats, step_loss
from lean.rollout import StepOutput
from lean.schedules.base import IterationCosts, OptimizerStep, Prediction, Schedule, trainable


class Retain(Schedule):
    exact_only_on_policy = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.kept: list[tuple[StepOutput, torch.Tensor | None]] = []  # (step with its graph, reference mean)
        self.losses = []  # every backpropagated step's loss terms, for the stats
        self.unscaled = False  # an early finish under skip_zero_advantage used N = 1 (N is known only at the end)

    def on_step(self, step: StepOutput) -> None:
        if step.log_prob.requires_grad:
            self.kept.append((step, self.ctx.reference_mean(step)))

    def finish_rows(self, rows: slice, advantages: torch.Tensor) -> None:
        """Group layout: backpropagate the kept steps of the scored groups ``rows`` and free their graphs, so the
        next group's rollout starts with none of them held."""
        inside = [rows.start <= step.rows.start and step.rows.stop <= rows.stop for step, _ in self.kept]
        done = [e for e, yes in zip(self.kept, inside) if yes]
        self.kept = [e for e, yes in zip(self.kept, inside) if not yes]
        kept, n = self.ctx.kept_samples(advantages)
        if kept is not None:  # N counts the kept samples of every group, known after the last one: scale then
            self.unscaled, n = True, 1
        self._backward(done, advantages, kept, n)

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        kept, n = self.ctx.kept_samples(advantages)
        self._backward(self.kept, advantages, kept, 1 if self.unscaled else n)
        self.kept = []
        if self.unscaled:
            for p in trainable(self.ctx.policy):
                if p.grad is not None:
                    p.grad.div_(n)
        return {**loss_stats(self.losses, self.ctx.beta), **optimizer_step()}

    def _backward(self, entries: list, advantages: torch.Tensor, kept: torch.Tensor | None, n) -> None:
        """One backward of the loss terms of ``entries`` (their graphs die with it), weighted 1/(n K)."""
        ctx, total = self.ctx, 0.0
        for step, ref in entries:
            loss = step_loss(
                step.log_prob,
                step.log_prob.detach(),
                advantages[step.rows],
                ctx.cfg.train.clip_range,
                mean=step.mean,
                ref_mean=ref,
                std=step.std,
                kl_weight=ctx.kl_weights[step.index],
            )
            weights = ctx.term_weights(step.rows, step.index, n, kept)
            total = total + (weights * loss.total(ctx.beta)).sum()
            self.losses.append(loss)
        if entries:
            with ctx.region("backward"):
                total.backward()

    @staticmethod
    def predict(c: IterationCosts) -> Prediction:
        return Prediction(
            c.base_mb + c.k * c.act_mb * c.held_fraction + max(c.decode_mb, c.transient_mb),
            (c.n - c.k) * c.f + c.k * c.fb + c.score + c.ref,
        )
