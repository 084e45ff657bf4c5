"""What a CUDA device would refuse or wait for, checked on a CPU-only machine.

The compute device of these checks is ``meta``: tensors with shapes and dtypes but no values. A dispatch mode
(:class:`DeviceCheck`) watches every aten op, forwards and backwards, and

* raises on **device mixing**: an op whose tensor arguments sit on two devices, where CUDA raises "Expected all
  tensors to be on the same device" (0-dim CPU tensors are scalars, which CUDA accepts; copies are transfers);
* records **host syncs**: a value read back to the host (``.item()``, ``bool()``, ``.tolist()``, a copy to the CPU),
  a blocking host-to-device copy (one without ``non_blocking=True``), and a CPU index tensor indexing a device tensor
  (CUDA copies the index over first). Reads answer with placeholders (zeros, and True for a test of finiteness),
  so that an iteration runs end to end on the meta device;
* ``meta`` alone also lets some mixed ops through silently (a CPU matrix times a meta one): the check sees them first.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten
META = torch.device("meta")
_TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten.to.dtype_layout, aten.to.device, aten.lift_fresh.default}
_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default}
_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten.index_select.default,
    aten.index_add.default,
    aten.index_add_.default,
}


class DeviceMixing(RuntimeError):
    """An op got tensors on two devices (what CUDA refuses)."""


def _devices(tensors) -> set[torch.device]:
    return {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}


class DeviceCheck(TorchDispatchMode):
    """Raise on device mixing; count host syncs by kind (``self.syncs``) and where they happened (``self.where``)."""

    def __init__(self, record_where: bool = False):
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.record_where = record_where
        self.where: list[str] = []

    def _sync(self, kind: str, func) -> None:
        self.syncs[kind] += 1
        if self.record_where:
            import traceback

            frames = [f for f in traceback.extract_stack()[:-3] if "/lean/" in f.filename]
            self.where.append(f"{kind} {func}: " + (f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func in _READS:
            if tensors and tensors[0].device == META:
                self._sync("read", func)
                return True if tensors[0].dtype == torch.bool else 0
            return func(*args, **kwargs)
        if func in _TRANSFERS:
            return self._transfer(func, args, kwargs, tensors)
        if func in _INDEXING and len(_devices(tensors)) > 1 and tensors[0].device == META:
            self._sync("cpu index", func)
            args, kwargs = _moved((args, kwargs), META)
            return func(*args, **kwargs)
        devices = _devices(tensors)
        if len(devices) > 1:
            raise DeviceMixing(f"{func}: tensors on {', '.join(sorted(map(str, devices)))}")
        return func(*args, **kwargs)

    def _transfer(self, func, args, kwargs, tensors):
        source = tensors[-1] if func is aten.copy_.default else tensors[0]
        target = tensors[0].device if func is aten.copy_.default else kwargs.get("device", source.device)
        target = torch.device(target) if target is not None else source.device
        if source.device == META and target.type == "cpu":  # a download: placeholder values
            self._sync("read", func)
            out = torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
            return tensors[0].copy_(out) if func is aten.copy_.default else out
        if source.device.type == "cpu" and target == META and not kwargs.get("non_blocking", False):
            if source.dim() > 0:
                self._sync("blocking upload", func)
        return func(*args, **kwargs)


def _moved(tree, device):
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([x.to(device) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
