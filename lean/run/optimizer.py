"""The optimizer step, the single place where gradients cross processes: average, check, clip, AdamW, EMA.

Every schedule leaves its gradients in ``param.grad`` and calls :meth:`TrainState.step` once per update. The
gradients are averaged over processes there and nowhere else (one flat all-reduce: with LoRA the gradient is small,
and all schedules then sync at the same, explicit point; Reweight's delayed sync relies on it).
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import time
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from lean.config.run_sections import EMA_UNITS, EMAConfig, OptimizerConfig
from lean.models.snapshot import Snapshot, swapped_in
from lean.parallel.distributed import World
from lean.parallel.grad_sync import BackwardSync
from lean.parallel.sharding import full, is_sharded, like, local_mb
from lean.run.iteration import NonFiniteError
from lean.schedules.base import flat_grad, set_grads

OPTIMIZER_STEP, ITERATION = EMA_UNITS  # what ema.every counts


class TrainState:
    """The trainable parameters, their AdamW state and EMA copy, and the number of optimizer steps taken."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        optimizer: OptimizerConfig,
        ema: EMAConfig,
        world: World,
        sync_each_backward: bool = False,
    ):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        o = optimizer
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay
        )
        self.max_grad_norm = o.max_grad_norm
        self.ema = [p.detach().clone() for p in self.params] if ema.enabled else None
        self.ema_options = ema  # the decay schedule (ema_decay) and its repeats
        self.world = world
        self.sharded = any(is_sharded(p) for p in self.params)  # FSDP full fine-tune (lean.parallel.sharding)
        # grad_sync=per_backward on whole gradients: each backward's synced as it ends (lean.parallel.grad_sync)
        self.backward_sync = BackwardSync(self.params, world) if sync_each_backward and not self.sharded else None
        self.sync_s = 0.0  # seconds in the gradient all-reduces since the last read (the metrics' time_sync_s)
        # grad_sync=per_update on a sharded full fine-tune: reduce-scatters what FSDP2 accumulated unsharded
        self.reduce_accumulated: Callable[[], int] | None = None
        self.steps = 0
        self.iteration = 0  # for messages: the iteration whose update is being applied
        self.on_synced_grads: Callable[[list[torch.nn.Parameter]], None] | None = None  # see capture_synced_grads
        self.snapshot: Snapshot | None = None  # the algorithm's second weights, saved with the rest (Trainer sets it)
        self.algorithm = None  # the run's algorithm, whose state (Algorithm.state_dict) is saved with the rest

    def step(self) -> dict:
        """Average gradients across processes, clip, AdamW, EMA."""
        if self.sharded and self.reduce_accumulated is not None:  # per_update: the accumulation, once
            start = time.perf_counter()
            self.reduce_accumulated()
            self.sync_s += time.perf_counter() - start
        if self.sharded:  # FSDP reduce-scattered (and averaged) the gradient into the shards (each backward, or now)
            if self.world.sequence_parallel > 1:  # averaged over W = D x P: the sum over a group's tokens is P x that
                torch._foreach_mul_(
                    [p.grad.to_local() for p in self.params if p.grad is not None], self.world.sequence_parallel
                )
            finite = all_finite(self.params, self.world)
        else:
            grads = self._synced_flat_gradient()
            for p in self.params:
                p.grad = None
            set_grads(self.params, grads)
            finite = bool(torch.isfinite(grads).all())  # one read per update: a non-finite gradient is never applied
        if not finite:
            bad = [n for n, p in zip(self.names, self.params) if not torch.isfinite(full(p.grad)).all()]
            raise NonFiniteError(
                f"non-finite gradient of {bad[0]} (and {len(bad) - 1} more tensors) at iteration {self.iteration}"
            )
        if self.on_synced_grads is not None:
            self.on_synced_grads(self.params)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.ema_options.unit == OPTIMIZER_STEP:
            self._update_ema(self.steps)
        return {"grad_norm": float(full(norm))}  # a read, once per update, for the logs

    def _synced_flat_gradient(self) -> Tensor:
        """The whole gradients averaged over processes, flat: synced as each backward ended
        (``parallel.grad_sync=per_backward``, :class:`~lean.parallel.grad_sync.BackwardSync`), or in one all-reduce
        now."""
        if self.backward_sync is not None:
            return self.backward_sync.take()
        start = time.perf_counter()
        grads = self.world.reduce_gradients_(flat_grad(self.params, [p.grad for p in self.params]))
        self.sync_s += time.perf_counter() - start
        return grads

    def take_sync_seconds(self) -> float:
        """Seconds in the whole gradients' all-reduces since the last call (the per-backward ones included)."""
        seconds, self.sync_s = self.sync_s, 0.0
        if self.backward_sync is not None:
            seconds, self.backward_sync.seconds = seconds + self.backward_sync.seconds, 0.0
        return seconds

    def end_iteration(self) -> None:
        """After an iteration's last optimizer step: the EMA update of ``ema.unit: iteration`` (Flow-Factory's
        ``ema_step(step=self.epoch)`` after its update, src/flow_factory/trainers/grpo.py:87-91 at a0b2bc5)."""
        if self.ema_options.unit == ITERATION:
            self._update_ema(self.iteration)

    def _update_ema(self, count: int) -> None:
        """The EMA update after unit ``count`` of ``ema.unit`` (:func:`ema_decay`), if one is due."""
        options = self.ema_options
        decay = ema_decay(count, options.decay, options.every, options.warmup, EMA_FIRST_COUNT[options.unit])
        if self.ema is not None and decay is not None:
            with torch.no_grad():  # applied ema.repeats times to the same weights: e <- p + decay^r (e - p)
                for e, p in zip(self.ema, self.params):
                    e.lerp_(p, 1 - decay**options.repeats)

    def ema_state_dict(self) -> dict[str, Tensor] | None:
        """A copy of the EMA weights keyed as the trainable parameters (``Policy.lora_state_dict``'s keys), whole
        (gathered when sharded: then every process must call it), or None without ``ema.enabled``."""
        return None if self.ema is None else {n: full(e).detach().clone() for n, e in zip(self.names, self.ema)}

    @contextlib.contextmanager
    def ema_swapped_in(self, use_ema: bool = True) -> Iterator[bool]:
        """Inside the block the trainable parameters hold the EMA weights (copied in place, so the policy's
        forward reads them), and their own values again after it; yields whether it swapped (``use_ema`` and
        ``ema.enabled``). The evaluation's weights (``lean.evaluation``)."""
        if not use_ema or self.ema is None:
            yield False
            return
        with swapped_in(self.params, self.ema):
            yield True

    # ------------------------------------------------------------ save / restore (equivalence, bench, checkpoints)

    def state_dict(self, whole: bool = False) -> dict:
        """Weights, AdamW state, EMA, the algorithm's snapshot and state, and step count, as copies. Sharded tensors
        stay shards unless ``whole`` (gathered: every process must call it; what a checkpoint file holds, loadable at
        any number of processes)."""
        copy = (lambda t: full(t).detach().clone()) if whole else (lambda t: t.detach().clone())  # noqa: E731
        return {
            "params": [copy(p) for p in self.params],
            "optimizer": _map_tensors(self.optimizer.state_dict(), copy),
            "ema": None if self.ema is None else [copy(e) for e in self.ema],
            "snapshot": None if self.snapshot is None else [copy(v) for v in self.snapshot.values],
            "algorithm": None if self.algorithm is None else copy_module.deepcopy(self.algorithm.state_dict()),
            "optimizer_steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (whole or sharded tensors: each goes to its parameter's layout)."""
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(like(v, p))
        optimizer = _map_tensors(state["optimizer"], lambda t: t.detach().clone())
        for index, slots in optimizer["state"].items():  # AdamW's moments are laid out as their parameter
            p = self.params[index]
            for key, value in slots.items():
                if value.shape == p.shape:
                    slots[key] = like(value, p)
        self.optimizer.load_state_dict(optimizer)
        if state["ema"] is not None:  # on this process's device, whatever device saved it
            self.ema = [like(e, p).clone() for e, p in zip(state["ema"], self.params)]
        if self.snapshot is not None and state.get("snapshot") is not None:
            self.snapshot.values = [like(v, p).clone() for v, p in zip(state["snapshot"], self.params)]
        if self.algorithm is not None and state.get("algorithm") is not None:
            self.algorithm.load_state_dict(copy_module.deepcopy(state["algorithm"]))
        self.steps = state["optimizer_steps"]

    def resident_mb(self, policy: torch.nn.Module) -> float:
        """MiB this process holds of the policy's weights, the trained weights' gradients, AdamW's moments and the
        EMA (its shards, under ``parallel.shard=fsdp``)."""
        states = [t for slots in self.optimizer.state.values() for t in slots.values() if t.dim() > 0]
        grads = [p.grad for p in self.params if p.grad is not None]
        snapshot = self.snapshot.values if self.snapshot is not None else []
        return local_mb([*policy.parameters(), *grads, *states, *(self.ema or []), *snapshot])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


EMA_FIRST_COUNT = {OPTIMIZER_STEP: 1, ITERATION: 0}  # ema.unit -> the count t after its first unit


def ema_decay(step: int, decay: float, every: int, warmup: bool, first: int = 1) -> float | None:
    """The EMA decay applied after the unit counted ``step`` (``first`` for the first unit), or None when the EMA is
    not updated after it. ``ema.unit: optimizer_step``: the optimizer steps taken, this one included (``first`` 1,
    FlowGRPO's ``global_step``); ``iteration``: the iteration's index (``first`` 0, Flow-Factory's ``epoch``).

    * ``warmup`` false: ``decay`` after every ``every``-th unit (the units every, 2 every, ...).
    * ``warmup`` true: the schedule both sources' ``EMAModuleWrapper`` computes from the count they pass it: the decay
      ``min((1 + step) / (10 + step), decay)`` after the units where ``(step + 1) % every == 0``. FlowGRPO (line
      numbers of flow_grpo at ac4c86e: flow_grpo/ema.py:33-37 ``get_current_decay``, :45 the interval) is called as
      ``ema.step(params, global_step)`` after ``global_step += 1`` (scripts/train_sd3.py:952-955): with every=8 and
      decay=0.9, 8/17 after step 7, 16/25 after step 15, ..., 80/89 after step 79, 0.9 from step 87 on. Flow-Factory
      (a0b2bc5: src/flow_factory/ema/ema_utils.py:38-52 ``power_warmup_decay`` with its default warmup_steps 10,
      ema.py:102-113) is called with the epoch, counted from 0, after the epoch's update (trainers/grpo.py:87-91):
      with every=4 and decay=0.9, 4/13 after iteration 3, 8/17 after 7, ..., 0.9 from iteration 83 on. The same
      formula on counts that start one apart: FlowGRPO's warm-up updates one step before its plain schedule would,
      Flow-Factory's at the same units.

    FlowGRPO calls ``ema.step`` once per training micro-batch (scripts/train_sd3.py:954-955 sit in the ``for i,
    sample`` loop), so each update is applied ``gradient_accumulation_steps`` times to the same weights (2 in its SD3
    recipes, 6 in FLUX's, 1 in Wan's): ``ema.repeats``, which :class:`TrainState` applies as the decay's power.
    """
    if not warmup:
        return decay if (step - first + 1) % every == 0 else None
    if (step + 1) % every:
        return None
    return min((1 + step) / (10 + step), decay)


@contextlib.contextmanager
def capture_synced_grads(state: TrainState) -> Iterator[list[Tensor]]:
    """Inside the block, the synchronised gradients of the first optimizer step are copied into the yielded list
    (just before clipping): what the equivalence certificate compares (the on-policy update; with several per
    rollout the later ones are Recompute's, ``lean.schedules.hybrid``)."""
    captured: list[Tensor] = []

    def keep(params: list[torch.nn.Parameter]) -> None:
        if not captured:
            captured[:] = [full(p.grad).detach().clone() for p in params]  # whole (gathered when sharded)

    state.on_synced_grads = keep
    try:
        yield captured
    finally:
        state.on_synced_grads = None


def all_finite(params: list[torch.nn.Parameter], world: World) -> bool:
    """Whether every gradient is finite on every process (the gradients are shards: one small all-reduce)."""
    local = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in params if p.grad is not None)
    flag = torch.tensor([0.0 if local else 1.0], device=params[0].device)
    return float(world.all_reduce_mean_(flag)) == 0.0


def _map_tensors(tree, fn):
    """``tree`` (dicts and lists) with ``fn`` applied to every tensor in it."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    return tree
