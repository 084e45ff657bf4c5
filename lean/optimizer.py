"""The optimizer step, the single place where gradients cross processes: average, check, clip, AdamW, EMA.

Every schedule leaves its gradients in ``param.grad`` and calls :meth:`TrainState.step` once per update. The
gradients are averaged over processes there and nowhere else (one flat all-reduce: with LoRA the gradient is small,
and all schedules then sync at the same, explicit point; Reweight's delayed sync relies on it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from lean.distributed import World
from lean.iteration import NonFiniteError
from lean.schedules.base import flat_grad, set_grads


class TrainState:
    """The trainable parameters, their AdamW state and EMA copy, and the number of optimizer steps taken."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], train_cfg, world: World):
        t = train_cfg
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay
        )
        self.ema = [p.detach().clone() for p in self.params] if t.ema else None
        self.ema_decay, self.ema_every, self.ema_warmup = t.ema_decay, t.ema_every, t.ema_warmup
        self.ema_repeats = t.ema_repeats
        self.max_grad_norm = t.max_grad_norm
        self.world = world
        self.steps = 0
        self.iteration = 0  # for messages: the iteration whose update is being applied
        self.on_synced_grads: Callable[[list[torch.nn.Parameter]], None] | None = None  # see capture_synced_grads

    def step(self) -> dict:
        """Average gradients across processes, clip, AdamW, EMA."""
        grads = self.world.all_reduce_mean_(flat_grad(self.params, [p.grad for p in self.params]))
        for p in self.params:
            p.grad = None
        set_grads(self.params, grads)
        if not torch.isfinite(grads).all():  # one read per update: a non-finite gradient is never applied
            bad = [n for n, p in zip(self.names, self.params) if not torch.isfinite(p.grad).all()]
            raise NonFiniteError(
                f"non-finite gradient of {bad[0]} (and {len(bad) - 1} more tensors) at iteration {self.iteration}"
            )
        if self.on_synced_grads is not None:
            self.on_synced_grads(self.params)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        decay = ema_decay(self.steps, self.ema_decay, self.ema_every, self.ema_warmup)
        if self.ema is not None and decay is not None:
            with torch.no_grad():  # applied ema_repeats times to the same weights: e <- p + decay^r (e - p)
                for e, p in zip(self.ema, self.params):
                    e.lerp_(p, 1 - decay**self.ema_repeats)
        return {"grad_norm": float(norm)}  # a read, once per update, for the logs

    def ema_state_dict(self) -> dict[str, Tensor] | None:
        """A copy of the EMA weights keyed as the trainable parameters (``Policy.lora_state_dict``'s keys), or None
        without ``train.ema``."""
        return None if self.ema is None else {n: e.detach().clone() for n, e in zip(self.names, self.ema)}

    @contextlib.contextmanager
    def ema_swapped_in(self, use_ema: bool = True) -> Iterator[bool]:
        """Inside the block the trainable parameters hold the EMA weights (copied in place, so the policy's
        forward reads them), and their own values again after it; yields whether it swapped (``use_ema`` and
        ``train.ema`` on). The evaluation's weights (``lean.evaluation``)."""
        if not use_ema or self.ema is None:
            yield False
            return
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            for p, e in zip(self.params, self.ema):
                p.copy_(e)
        try:
            yield True
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, own):
                    p.copy_(v)

    # ------------------------------------------------------------ save / restore (equivalence, bench, checkpoints)

    def state_dict(self) -> dict:
        return {
            "params": [p.detach().clone() for p in self.params],
            "optimizer": _clone(self.optimizer.state_dict()),
            "ema": None if self.ema is None else [e.clone() for e in self.ema],
            "optimizer_steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
        self.optimizer.load_state_dict(_clone(state["optimizer"]))
        if state["ema"] is not None:  # on this process's device, whatever device saved it
            self.ema = [e.to(p.device, copy=True) for e, p in zip(state["ema"], self.params)]
        self.steps = state["optimizer_steps"]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def ema_decay(step: int, decay: float, every: int, warmup: bool) -> float | None:
    """The EMA decay applied after optimizer step ``step`` (counted from 1: the steps taken, this one included), or
    None when the EMA is not updated after it.

    * ``warmup`` false: ``decay`` after every ``every``-th step (steps every, 2 every, ...).
    * ``warmup`` true: FlowGRPO's ``EMAModuleWrapper`` (line numbers of flow_grpo at ac4c86e: flow_grpo/ema.py:33-37
      ``get_current_decay``, :45 the interval), which its scripts call as ``ema.step(params, global_step)`` after
      ``global_step += 1`` (scripts/train_sd3.py:952-955): the decay ``min((1 + step) / (10 + step), decay)`` after
      the steps where ``(step + 1) % every == 0``. With every=8 and decay=0.9: 8/17 after step 7, 16/25 after step
      15, ..., 80/89 after step 79, 0.9 from step 87 on.

    FlowGRPO calls ``ema.step`` once per training micro-batch (scripts/train_sd3.py:954-955 sit in the ``for i,
    sample`` loop), so each update is applied ``gradient_accumulation_steps`` times to the same weights (2 in its SD3
    recipes, 6 in FLUX's, 1 in Wan's): ``train.ema_repeats``, which :class:`TrainState` applies as the decay's power.
    """
    if not warmup:
        return decay if step % every == 0 else None
    if (step + 1) % every:
        return None
    return min((1 + step) / (10 + step), decay)


@contextlib.contextmanager
def capture_synced_grads(state: TrainState) -> Iterator[list[Tensor]]:
    """Inside the block, the synchronised gradients of the last optimizer step are copied into the yielded list
    (just before clipping): what the equivalence certificate compares."""
    captured: list[Tensor] = []

    def keep(params: list[torch.nn.Parameter]) -> None:
        captured[:] = [p.grad.detach().clone() for p in params]

    state.on_synced_grads = keep
    try:
        yield captured
    finally:
        state.on_synced_grads = None


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree
