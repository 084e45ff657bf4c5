"""Per-trajectory gradients of ``nn.Linear`` parameters from one batched backward.

For a linear layer y = x W^T + b applied to rows r (batch) and tokens t, the weight gradient is a sum over rows:

    dL/dW = sum_r sum_t delta_rt^T x_rt,     delta = dL/dy,        dL/db = sum_r sum_t delta_rt

so the gradient that row r alone contributes is sum_t delta_rt^T x_rt. Capturing x (forward hook) and delta (a hook
on the output tensor) therefore yields every row's gradient from the same batched backward, at the cost of one small
einsum per adapted layer. With classifier-free guidance the batch is [uncond rows, cond rows]; row r belongs to
trajectory r mod b. This lets Reweight keep trajectories apart without giving up batching.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lean.algorithms import Algorithm, StepLoss
from lean.algorithms.base import step_targets

PROVISIONAL_ADVANTAGE = 1.0  # Â: what a trajectory is backpropagated with before its advantage is known


def linear_owners(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> dict[torch.nn.Linear, list] | None:
    """Map each ``nn.Linear`` holding trainable params to them; None if some trainable param is not in a Linear, or if a
    sequence-parallel model trains its base weights (the fused projections multiply by them without calling their
    modules: ``lean.models.sequence_parallel``; a LoRA adapter's factors are recorded there)."""
    if getattr(model, "sequence_parallel", None) is not None and getattr(model, "full_finetune", False):
        return None
    wanted = {id(p) for p in params}
    owners: dict[torch.nn.Linear, list] = {}
    found = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            mine = [p for p in (module.weight, module.bias) if p is not None and id(p) in wanted]
            if mine:
                owners[module] = mine
                found.update(id(p) for p in mine)
    return owners if found == wanted else None


class TrajectoryBuffers:
    """One gradient buffer per trajectory, stored parameter-major: parameter p owns a contiguous [n_traj, p.numel()]
    block, so per-row gradients land with one contiguous ``index_add_`` per parameter."""

    def __init__(self, params: list[torch.nn.Parameter], n_trajectories: int):
        self.params = params
        total = sum(p.numel() for p in params)
        self.storage = torch.zeros(n_trajectories * total, dtype=params[0].dtype, device=params[0].device)
        self.blocks, start = {}, 0
        for p in params:
            self.blocks[id(p)] = self.storage[start : start + n_trajectories * p.numel()].view(n_trajectories, -1)
            start += n_trajectories * p.numel()

    def block(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.blocks[id(p)]

    def add(self, trajectory: int, grads) -> None:
        for p, g in zip(self.params, grads):
            if g is not None:
                self.blocks[id(p)][trajectory] += g.reshape(-1)

    def combine(self, weights: torch.Tensor) -> torch.Tensor:
        """sum_b weights[b] * buffer[b], as one flat vector in parameter order."""
        return torch.cat([weights.to(self.storage.dtype) @ self.blocks[id(p)] for p in self.params])

    @property
    def trajectories(self) -> int:
        return next(iter(self.blocks.values())).shape[0]

    def combine_rows(self, rows: slice, coefficients: torch.Tensor) -> torch.Tensor:
        """sum_{b in rows} coefficients[b] buffer[b mod n]: the buffers of the local rows ``rows`` (at most n of
        them, whole units), each in its slot."""
        slots = torch.arange(rows.start, rows.stop, device=coefficients.device) % self.trajectories
        return self.combine_slots(slots, coefficients[rows])

    def combine_slots(self, slots: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        """sum_i coefficients[i] buffer[slots[i]], as one flat vector in parameter order."""
        weights = torch.zeros(self.trajectories, dtype=torch.float64, device=coefficients.device)
        weights.index_add_(0, slots, coefficients.to(torch.float64))
        return self.combine(weights)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


def lora_entries(model: torch.nn.Module, owners: dict[torch.nn.Linear, list]) -> set[torch.nn.Linear] | None:
    """Per LoRA adapter, the first of its factors that trains (A, or B under a frozen A): each other owner's output
    lies between the loss and an entry's output. None if an owner is not a LoRA factor."""
    entries, factors = set(), set()
    for module in model.modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not isinstance(lora_b, torch.nn.ModuleDict):
            continue
        for name in lora_a.keys() & lora_b.keys():
            mine = [m for m in (lora_a[name], lora_b[name]) if m in owners]
            entries.update(mine[:1])
            factors.update(mine)
    return entries if factors == set(owners) else None


class PerSampleGrads:
    """Every tracked forward through an owning Linear keeps its input; a backward run by :meth:`backward` adds each
    row's gradient into the buffer of trajectory ``trajectories[row mod b]``.

    The batched parameter gradient is then not needed. With LoRA owners and ``to_entries`` (a caller that
    backpropagates each graph before the next is recorded, and calls :meth:`release` after its last backward) the
    backward goes to the outputs of each adapter's first trained factor instead of to the parameters: it still
    reaches every owner's output, so every hook fires, and autograd skips the weight gradients beside them.

    Code that multiplies by a slice of an owner's weight without calling the module (sequence parallelism's fused
    projections) announces the product through ``module.per_sample.record(module, x, y, rows, cols)``."""

    def __init__(
        self,
        model: torch.nn.Module,
        params: list[torch.nn.Parameter],
        buffers: TrajectoryBuffers,
        to_entries: bool = False,
    ):
        owners = linear_owners(model, params)
        if owners is None:
            raise ValueError("per-sample gradients need every trainable parameter to live in an nn.Linear")
        self.buffers, self.params = buffers, params
        self.trajectories: torch.Tensor | None = None  # local trajectory id of each batch row (before CFG doubling)
        self.accumulating = False  # only the backward of the advantage-weighted term is split per trajectory
        self.handles = [m.register_forward_hook(self._forward_hook) for m in owners]
        self.owners = owners
        self.entries = lora_entries(model, owners) if to_entries else None
        self.entry_outputs: list[torch.Tensor] = []  # the entries' outputs of the graph recorded since release()
        for m in owners:
            m.per_sample = self

    def backward(
        self,
        loss: torch.Tensor,
        trajectories: torch.Tensor,
        retain_graph: bool,
        buffers: TrajectoryBuffers | None = None,
    ) -> None:
        """Each forward row's gradient of ``loss`` into the buffer of its trajectory ``trajectories`` [rows] (on the
        device), in ``buffers`` (None: the ones it holds; given, they are held from then on)."""
        self.buffers = buffers or self.buffers
        self.trajectories, self.accumulating = trajectories, True
        try:
            targets = self.entry_outputs or self.params
            torch.autograd.grad(loss, targets, retain_graph=retain_graph, allow_unused=True)
        finally:
            self.accumulating = False

    def release(self) -> None:
        """The recorded graph is freed: drop the entries' outputs that kept a reference into it."""
        self.entry_outputs = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for m in self.owners:
            del m.per_sample

    def _forward_hook(self, module, inputs, output):
        self.record(module, inputs[0], output)

    def record(self, module: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, rows=None, cols=None) -> None:
        """``y = x W[rows, cols]^T (+ b[rows])`` was computed with ``module``'s weight (slices, or None: whole): each
        batch row's gradient goes to that part of the weight's buffers when the backward reaches ``y``."""
        if not y.requires_grad:
            return
        x = x.detach()
        y.register_hook(lambda delta: self._accumulate(module, x, delta.detach(), rows, cols))
        if self.entries is not None and module in self.entries:
            self.entry_outputs.append(y)

    def _accumulate(
        self, module: torch.nn.Linear, x: torch.Tensor, delta: torch.Tensor, rows: slice | None, cols: slice | None
    ) -> None:
        if not self.accumulating:
            return
        n, traj = x.shape[0], self.trajectories
        if n % len(traj):
            raise RuntimeError(f"layer input has {n} rows, not a multiple of {len(traj)} trajectories")
        x3 = x.reshape(n, -1, x.shape[-1])
        d3 = delta.reshape(n, -1, delta.shape[-1])
        for p in self.owners[module]:
            if p is not module.weight:
                g = d3.sum(dim=1)
                part = (rows or slice(None),)
            elif d3.shape[-1] > x3.shape[-1]:  # same product, transposed: BLAS is several times
                g = torch.bmm(x3.transpose(1, 2), d3).transpose(1, 2)  # faster with the long side last (LoRA B)
                part = (rows or slice(None), cols or slice(None))
            else:
                g = torch.bmm(d3.transpose(1, 2), x3)  # [rows, out, in]
                part = (rows or slice(None), cols or slice(None))
            if n > len(traj):  # CFG in the graph: [uncond, cond] rows of one trajectory
                g = g.reshape(n // len(traj), len(traj), *g.shape[1:]).sum(dim=0)
            block = self.buffers.block(p).view(-1, *p.shape)[(slice(None), *part)]
            block.index_add_(0, traj, g.to(block.dtype))


class TermCells(NamedTuple):
    """Where a step's loss terms sit on the targets: its rows, at step ``index`` (what ``step_targets`` reads: the
    rows of [B] targets, or the cells (row, index) of a tree's [B, num_steps])."""

    rows: slice | torch.Tensor
    index: int


def logged_with_true_targets(
    algorithm: Algorithm,
    kept: list[tuple[TermCells, StepLoss]],
    targets: torch.Tensor,
    kl_factors: torch.Tensor | None = None,
) -> list[StepLoss]:
    """Loss terms backpropagated with a provisional target Â, for the logs, with the true targets (and the rows'
    regulariser factors [B], where the algorithm has them)."""
    return [
        StepLoss(
            algorithm.policy_term(t.ratio, step_targets(targets, cells)),
            t.kl,
            t.ratio,
            None if kl_factors is None or t.kl is None else kl_factors[cells.rows],
        )
        for cells, t in kept
    ]
