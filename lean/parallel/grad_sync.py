"""When the trained weights' gradients cross processes: ``parallel.grad_sync`` (LeanGRPO, arXiv 2609.03528, Sec. 4.3.2
and Table 1's "coalesced sync").

    per_update    the gradient is synchronised once per optimizer step, after the schedule has accumulated (and
                  Reweight corrected) it: one all-reduce of the flat gradient (``lean.run.optimizer.TrainState``).
                  The paper's coalesced sync; Reweight needs it (App. C: a provisional gradient synchronised before
                  its advantage is known is mixed with the other samples' and cannot be corrected).
    per_backward  each backward's gradient is synchronised as soon as the backward ends (:class:`BackwardSync`: one
                  all-reduce of what that backward added to ``param.grad``, as DDP does in one bucket), and the
                  optimizer step syncs only what reached ``param.grad`` without a backward (a fold of buffers). What
                  DanceGRPO's and FlowGRPO's data parallelism and FSDP do: the paper's "Native".
    auto          per_update, except under a sharded full fine-tune, where FSDP2 reduce-scatters in every backward:
                  per_backward, what runs.

Under a sharded full fine-tune (FSDP2), per_backward is FSDP2's own reduce-scatter of every unit after every
backward; per_update turns it off (``set_requires_gradient_sync(False)``: FSDP2 accumulates each unit's gradient
unsharded) and reduce-scatters the accumulation once per optimizer step, one ``reduce_scatter_tensor`` per sharded
parameter (``lean.parallel.sharding.reduce_scatter_accumulated``). It holds the whole unsharded gradient between
the backwards: that memory is what buys the fewer collectives.

Both give the same gradient (a sum of reductions is the reduction of the sum); they differ in the number of
collectives (``comm_all_reduce_count`` / ``comm_reduce_scatter_count`` in the metrics, ``lean.observe.comms``) and
the seconds spent in them (``time_sync_s``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from lean.config import AUTO
from lean.config.registry import Registry
from lean.parallel.sharding import shards

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.parallel.distributed import World

PER_UPDATE, PER_BACKWARD = "per_update", "per_backward"
GRAD_SYNCS: Registry[str] = Registry(
    "grad sync",
    [
        (AUTO, "per_update, or per_backward under a sharded full fine-tune (FSDP2's reduce-scatter per backward)"),
        (
            PER_UPDATE,
            "one sync per optimizer step, of the accumulated (corrected) gradient: the paper's coalesced sync",
        ),
        (PER_BACKWARD, "one sync per backward, as DDP and FSDP do: the paper's Native"),
    ],
)


def sharded_full_finetune(cfg: RunConfig) -> bool:
    """FSDP2 shards the trained weights (on one process nothing is sharded, nor synchronised)."""
    return shards(cfg.parallel.shard) and cfg.model.full_finetune


def resolve_grad_sync(cfg: RunConfig) -> str:
    """``parallel.grad_sync`` with auto resolved: per_backward under a sharded full fine-tune (FSDP2's default),
    else per_update."""
    if cfg.parallel.grad_sync != AUTO:
        return cfg.parallel.grad_sync
    return PER_BACKWARD if sharded_full_finetune(cfg) else PER_UPDATE


class BackwardSync:
    """per_backward for gradients that are whole on every process: after every backward that accumulates into
    ``param.grad``, one all-reduce of what it added (averaged as :meth:`World.reduce_gradients_` averages), moved
    into a synced sum; :meth:`take` returns that sum and syncs what reached ``param.grad`` otherwise.

    A parameter's post-accumulate-grad hook marks it ready and, on the first one of a backward, queues a callback
    for the end of that backward (``queue_callback``, as DDP's reducer does): the callback syncs the ready gradients
    in one flat all-reduce and sets them to None, so the next backward's contribution is its own."""

    def __init__(self, params: list[torch.nn.Parameter], world: World):
        self.params, self.world = params, world
        self.synced = [torch.zeros_like(p) for p in params]
        self.ready: list[int] = []
        self.seconds = 0.0  # in the all-reduces
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, i: int):
        def ready(_param: torch.nn.Parameter) -> None:
            if not self.ready:
                torch.autograd.Variable._execution_engine.queue_callback(self._sync_ready)
            self.ready.append(i)

        return ready

    def _sync_ready(self) -> None:
        ready, self.ready = sorted(set(self.ready)), []
        self._sync(ready)

    def _sync(self, indices: list[int]) -> None:
        """The gradients of ``indices`` in one flat all-reduce, added to their synced sums; their ``.grad`` None."""
        grads = [self.params[i].grad for i in indices]
        start = time.perf_counter()
        flat = self.world.reduce_gradients_(torch.cat([g.reshape(-1) for g in grads]))
        self.seconds += time.perf_counter() - start
        for i, part in zip(indices, flat.split([g.numel() for g in grads])):
            self.synced[i] += part.view_as(self.synced[i])
            self.params[i].grad = None

    def take(self) -> torch.Tensor:
        """The synced gradient of every parameter, flat in their order (what the backwards synced plus what reached
        ``param.grad`` otherwise, synced now when there is any); the sums start again from zero, ``param.grad`` is
        left None."""
        rest = [i for i, p in enumerate(self.params) if p.grad is not None]
        if rest:  # a fold of buffers (Retain's provisional backward, a hybrid's writes): one more sync
            self._sync(rest)
        flat = torch.cat([g.reshape(-1) for g in self.synced])
        for g in self.synced:
            g.zero_()
        return flat

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
