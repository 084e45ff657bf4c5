"""What crossed processes during a block of work: every ``torch.distributed`` collective and transfer, counted by kind
with its bytes and seconds.

``with CollectiveLog() as log: ...`` wraps the module-level functions of ``torch.distributed`` for the block's
duration (the ones lean, Accelerate and FSDP2 call: FSDP2's ``all_gather_single`` before a block runs and its
``reduce_scatter_single`` after a block's backward, the gradient all-reduce, the rewards' gathers, sequence
parallelism's all-to-alls and FlashOverlap's sends and receives), then restores them. :meth:`CollectiveLog.metrics`:

    comm_<kind>_count   calls of that kind: all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, p2p
    comm_<kind>_mb      MiB of the tensor each call reduces or gathers (an all-reduce's or a reduce-scatter's input,
                        a gather's output, a transfer's tensor): the collective's size, not the bytes on the wire
    time_reduce_scatter_s   seconds inside the reduce-scatter calls (the sharded gradients' sync; on a GPU the call
                        is asynchronous, so this is its launch, and what it exposes shows in the backward's time)

Objects (``all_gather_object``, ``broadcast_object_list``) count as calls of their kind with 0 bytes.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict

import torch

# torch.distributed function -> (kind, which argument's tensor gives the size: its position, its keyword)
WRAPPED = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "all_gather_single": ("all_gather", 0, "output"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "all_gather_object": ("all_gather", None, None),
    "all_to_all_single": ("all_to_all", 1, "input"),
    "all_to_all": ("all_to_all", 1, "input_tensor_list"),
    "broadcast": ("broadcast", 0, "tensor"),
    "broadcast_object_list": ("broadcast", None, None),
    "send": ("p2p", 0, "tensor"),
    "recv": ("p2p", 0, "tensor"),
    # isend and irecv themselves stay: a P2POp names them and is checked against them; their batches are counted
    "batch_isend_irecv": ("p2p", 0, "p2p_op_list"),
}
KINDS = tuple(dict.fromkeys(kind for kind, _, _ in WRAPPED.values()))
_ACTIVE = threading.local()  # a call inside a wrapped call (all_gather_object's own gathers) is not counted again


def _nbytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return _nbytes(value.tensor) if hasattr(value, "tensor") else 0  # a P2POp


class CollectiveLog:
    """Counts, bytes and seconds of the collectives run inside ``with`` (every thread's; see the module docstring)."""

    def __init__(self):
        self.count: dict[str, int] = defaultdict(int)
        self.nbytes: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self._saved: dict[str, object] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> CollectiveLog:
        dist = torch.distributed
        for name, (kind, position, keyword) in WRAPPED.items():
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(original, kind, position, keyword))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.distributed, name, original)
        self._saved.clear()

    def _wrap(self, fn, kind: str, position: int | None, keyword: str | None):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if getattr(_ACTIVE, "inside", False):
                return fn(*args, **kwargs)
            size = 0
            if position is not None:
                size = _nbytes(args[position] if len(args) > position else kwargs.get(keyword))
            _ACTIVE.inside = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _ACTIVE.inside = False
                with self._lock:
                    self.count[kind] += 1
                    self.nbytes[kind] += size
                    self.seconds[kind] += time.perf_counter() - start

        return counted

    def metrics(self) -> dict[str, float]:
        """``comm_<kind>_count`` and ``comm_<kind>_mb`` of every kind (0 where none ran) and
        ``time_reduce_scatter_s``."""
        out: dict[str, float] = {}
        for kind in KINDS:
            out[f"comm_{kind}_count"] = self.count.get(kind, 0)
            out[f"comm_{kind}_mb"] = self.nbytes.get(kind, 0) / 2**20
        out["time_reduce_scatter_s"] = self.seconds.get("reduce_scatter", 0.0)
        return out
