"""Recompute: the FlowGRPO / DanceGRPO baseline.

Rollout (no gradients anywhere) stores, for every stochastic step i of every sample, x_i, x_{i+1} and
log p_old(x_{i+1} | x_i). After rewards and advantages A are known, the update loop recomputes every trained step with
gradients:

    for epoch in 1..num_inner_epochs:                      # off-policy when > 1
        shuffle the local samples; split them into S = optimizer_steps_per_iteration chunks
        for each chunk C (|C| = N/S samples), in micro-batches of train_batch_size:
            for j in 1..K:                                 # the j-th trained step of each sample
                mu_theta, log p_theta = policy_step(x_{t_bj}, scoring the stored x_{t_bj + 1})
                loss = sum_b [clipped_surrogate(log p_theta - log p_old, A_b) + beta KL(mu_theta, mu_ref)] / (|C| K)
                loss.backward()
            optimizer_step()                              # sync, clip, AdamW; later chunks are off-policy

With S = 1 and one epoch the loop is on-policy: log p_theta equals log p_old up to floating-point rounding (ratio = 1),
which is the redundancy Retain and Reweight remove: the forward pass above already ran during the rollout.

Cost (``predict``, in the terms of ``base.IterationCosts``): it peaks in the VAE decode or in one update backward,

    memory = base + max(decode, act x train_rows_fraction + transient)      time = n f + K (f + fb) + ref
           (the K recomputed steps each cost a forward f beside the tracked forward + backward fb)
"""

from __future__ import annotations

import torch

from lean.loss import StepLoss, loss_stats, step_loss
from lean.rollout import StepOutput, iteration_generator, policy_step, reference_mean
from lean.schedules.base import IterationContext, IterationCosts, OptimizerStep, Prediction, Schedule


class Recompute(Schedule):
    tracks_rollout_graphs = False

    def __init__(self, ctx: IterationContext):
        super().__init__(ctx)
        self.samples: dict[int, torch.Tensor] = {}  # step i -> x_i [B, ...]
        self.next_samples: dict[int, torch.Tensor] = {}
        self.old_log_probs: dict[int, torch.Tensor] = {}

    def track_grad(self, i: int) -> bool:
        return False

    def on_step(self, step: StepOutput) -> None:
        if not self.any_trained[step.index]:
            return  # never trained: nothing to store
        i, rows, batch = step.index, step.rows, self.ctx.batch
        if i not in self.samples:
            self.samples[i] = step.sample.new_empty((batch, *step.sample.shape[1:]))
            self.next_samples[i] = torch.empty_like(self.samples[i])
            self.old_log_probs[i] = step.log_prob.new_empty(batch)
        self.samples[i][rows] = step.sample
        self.next_samples[i][rows] = step.next_sample
        self.old_log_probs[i][rows] = step.log_prob.detach()

    def _gather(self, store: dict[int, torch.Tensor], rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """x[b] at step steps[b] for each sample b of ``rows`` (host-side ids; views of the stored device tensors)."""
        return torch.stack([store[int(t)][int(b)] for b, t in zip(rows, steps)])

    def finish(self, advantages: torch.Tensor, optimizer_step: OptimizerStep) -> dict:
        ctx, t = self.ctx, self.ctx.cfg.train
        trained_steps = [torch.nonzero(row).flatten() for row in ctx.steps.trained]  # per sample, ascending (host)
        device = ctx.sigmas.device
        losses: list[StepLoss] = []
        step_stats = {}
        for epoch in range(t.num_inner_epochs):
            gen = iteration_generator(t.seed, ctx.iteration, purpose=1 + epoch)
            order = torch.randperm(ctx.batch, generator=gen)
            for chunk in order.chunk(t.optimizer_steps_per_iteration):
                for rows in chunk.split(t.train_batch_size):  # host-side sample ids; on the device below
                    on_device = rows.to(device)
                    for j in range(ctx.steps_per_sample):
                        steps = torch.stack([trained_steps[int(b)][j] for b in rows])
                        x = self._gather(self.samples, rows, steps)
                        nxt = self._gather(self.next_samples, rows, steps)
                        old = torch.stack([self.old_log_probs[int(s)][int(b)] for b, s in zip(rows, steps)])
                        emb, steps = ctx.emb.index(on_device), steps.to(device)
                        with ctx.region("recompute_forward"):
                            _, log_prob, mean, std = policy_step(
                                ctx.policy, x, steps, emb, ctx.cfg.sample, ctx.sigmas, next_sample=nxt
                            )
                        ref = None
                        if ctx.beta:
                            with ctx.region("reference_forward"):
                                ref = reference_mean(ctx.policy, x, steps, emb, ctx.cfg.sample, ctx.sigmas, nxt)
                        loss = step_loss(
                            log_prob, old, advantages[on_device], t.clip_range, mean=mean, ref_mean=ref, std=std
                        )
                        with ctx.region("backward"):
                            (loss.total(ctx.beta).sum() / (len(chunk) * ctx.steps_per_sample)).backward()
                        losses.append(loss)
                step_stats = optimizer_step()
        return {**loss_stats(losses, ctx.beta), **step_stats}

    @staticmethod
    def predict(c: IterationCosts) -> Prediction:
        return Prediction(
            c.base_mb + max(c.decode_mb, c.act_mb * c.train_rows_fraction + c.transient_mb),
            c.n * c.f + c.k * c.fb + c.ref,
        )
