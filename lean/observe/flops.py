"""FLOPs of the work a block runs: torch's per-operator formulas, counted by a dispatch mode that does only that.

``FlopCounter`` counts exactly what ``torch.utils.flop_counter.FlopCounterMode`` counts (its formula registry, its
decomposition of every operator that has a composite kernel, its list of size and stride queries it lets pass), and
nothing else: no module hierarchy (``FlopCounterMode`` hooks every module call to attribute FLOPs to modules, and
rebuilds its set of skipped operators on every operator). lean attributes FLOPs to regions itself
(``lean.observe.metrics.FlopTally``), so the total is all it reads.

Why it matters: every operator under a dispatch mode runs through Python. On a tiny model an iteration counted by
``FlopCounterMode`` took 5x the CPU of an uncounted one (0.13 s against 0.025 s: flux at the tests' size); the
decision what to do with an operator is made here once per operator, not per call. ``lean train`` counts its first
iteration and ``lean plan`` counts every block on the meta device, so most of the tests' and the planner's CPU went
there. ``tests/test_flops.py`` checks the counts equal ``FlopCounterMode``'s on every family's iteration.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DispatchKey
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Queries about a tensor's layout: FlopCounterMode hands them back (NotImplemented) so that tensors with their own
# size and stride policy answer them.
_LAYOUT_QUERIES = frozenset(
    {
        aten.sym_is_contiguous.default,
        aten.is_contiguous.default,
        aten.is_contiguous.memory_format,
        aten.is_strides_like_format.default,
        aten.is_non_overlapping_and_dense.default,
        aten.size.default,
        aten.sym_size.default,
        aten.stride.default,
        aten.sym_stride.default,
        aten.storage_offset.default,
        aten.sym_storage_offset.default,
        aten.numel.default,
        aten.sym_numel.default,
        aten.dim.default,
        torch.ops.prim.layout.default,
    }
)

_PASS, _DECOMPOSE, _RUN = "pass", "decompose", "run"


def _shapes(value: Any) -> Any:
    """``value`` with every tensor replaced by its shape, through tuples, lists and dicts (what torch's formulas read;
    ``torch.utils._pytree.tree_map`` does the same at several times the cost)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (tuple, list)):
        return type(value)(_shapes(v) for v in value) if type(value) in (tuple, list) else [_shapes(v) for v in value]
    if isinstance(value, dict):
        return {k: _shapes(v) for k, v in value.items()}
    return value


def _formula(func: torch._ops.OpOverload) -> Any:
    """``func``'s FLOP formula as ``formula(args, kwargs, out)``, or None. Most of torch's registered formulas read
    shapes and are registered wrapped in a function that maps every tensor to its shape (``functools.wraps``: the
    formula itself is its ``__wrapped__``); those get the shapes from :func:`_shapes`, the others the tensors."""
    registered = flop_registry.get(func._overloadpacket)
    if registered is None:
        return None
    on_shapes = getattr(registered, "__wrapped__", None)
    if on_shapes is None:
        return lambda args, kwargs, out: registered(*args, **kwargs, out_val=out)
    return lambda args, kwargs, out: on_shapes(*_shapes(args), **_shapes(kwargs), out_shape=_shapes(out))


def _decides(func: torch._ops.OpOverload) -> tuple[str, Any]:
    """What to do with ``func``, once per operator: hand a layout query back; decompose an operator that has a
    composite kernel (its parts are counted); otherwise run it and count it with its formula, if it has one."""
    if func in _LAYOUT_QUERIES:
        return _PASS, None
    formula = _formula(func)
    composite = DispatchKey.CompositeImplicitAutograd
    decomposes = func is not torch.ops.prim.device.default and (
        composite in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), composite)
    )
    return (_DECOMPOSE if decomposes else _RUN), formula


class FlopCounter(TorchDispatchMode):
    """``with FlopCounter() as c: ...`` then ``c.total`` (or ``c.get_total_flops()``): the FLOPs of the matmuls,
    convolutions and attention the block ran, by torch's formulas (a multiply-add is 2 FLOPs)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self._decided: dict[Any, tuple[str, Any]] = {}

    def get_total_flops(self) -> int:
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decided = self._decided.get(func)
        if decided is None:
            decided = self._decided[func] = _decides(func)
        action, formula = decided
        if action is _PASS:
            return NotImplemented
        if action is _DECOMPOSE:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.total += formula(args, kwargs, out)
        return out
