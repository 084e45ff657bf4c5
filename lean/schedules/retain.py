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

    memory = base + K act + max(decode, transient)      time = (n - K) f + K fb + score + ref
"""

from __future__ import annotations

import torch

from lean.loss import loss_stats, step_loss
from lean.rollout import StepOutput
from lean.schedules.base import IterationCosts, OptimizerStep, Prediction, Schedule


class Retain(Schedule):
    exact_only_on_policy = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.kept: list[tuple[StepOutput, torch.Tensor | None]] = []

    def on_step(self, step: StepOutput) -> None:
        if step.log_prob.requires_grad:
            self.kept.append((step, self.ctx.reference_mean(step)))

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        ctx = self.ctx
        total, losses = 0.0, []
        kept, n = ctx.kept_samples(advantages)
        for step, ref in self.kept:
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
            losses.append(loss)
        self.kept.clear()  # the graphs die with the backward
        if losses:
            with ctx.region("backward"):
                total.backward()
        return {**loss_stats(losses, ctx.beta), **optimizer_step()}

    @staticmethod
    def predict(c: IterationCosts) -> Prediction:
        return Prediction(
            c.base_mb + c.k * c.act_mb + max(c.decode_mb, c.transient_mb),
            (c.n - c.k) * c.f + c.k * c.fb + c.score + c.ref,
        )
