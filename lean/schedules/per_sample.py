"""Per-trajectory gradients of ``nn.Linear`` parameters from one batched backward.

For a linear layer y = x W^T + b applied to rows r (batch) and tokens t, the weight gradient is a sum over rows:

    dL/dW = sum_r sum_t delta_rt^T x_rt,     delta = dL/dy,        dL/db = sum_r sum_t delta_rt

so the gradient that row r alone contributes is sum_t delta_rt^T x_rt. Capturing x (forward hook) and delta (a hook
on the output tensor) therefore yields every row's gradient from the same batched backward, at the cost of one small
einsum per adapted layer. With classifier-free guidance the batch is [uncond rows, cond rows]; row r belongs to
trajectory r mod b. This lets Reweight keep trajectories apart without giving up batching.
"""

from __future__ import annotations

import torch


def linear_owners(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> dict[torch.nn.Linear, list] | None:
    """Map each ``nn.Linear`` holding trainable params to them; None if some trainable param is not in a Linear."""
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


class PerSampleGrads:
    """Every tracked forward through an owning Linear keeps its input; a backward run while ``accumulating`` adds
    each row's gradient into ``buffers[trajectories[row mod b]]`` (a [n_trajectories, n_params] flat layout)."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], buffers: torch.Tensor):
        owners = linear_owners(model, params)
        if owners is None:
            raise ValueError("per-sample gradients need every trainable parameter to live in an nn.Linear")
        offsets, start = {}, 0
        for p in params:
            offsets[id(p)] = start
            start += p.numel()
        self.offsets = offsets
        self.buffers = buffers
        self.trajectories: torch.Tensor | None = None  # local trajectory id of each batch row (before CFG doubling)
        self.accumulating = False  # only the backward of the advantage-weighted term is split per trajectory
        self.handles = [m.register_forward_hook(self._forward_hook) for m in owners]
        self.owners = owners

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _forward_hook(self, module, inputs, output):
        if not output.requires_grad:
            return
        x = inputs[0].detach()
        output.register_hook(lambda delta: self._accumulate(module, x, delta.detach()))

    def _accumulate(self, module: torch.nn.Linear, x: torch.Tensor, delta: torch.Tensor) -> None:
        if not self.accumulating:
            return
        rows = x.shape[0]
        traj = self.trajectories
        if rows % len(traj):
            raise RuntimeError(f"layer input has {rows} rows, not a multiple of {len(traj)} trajectories")
        owner = traj.repeat(rows // len(traj)).to(x.device)  # CFG: [uncond rows, cond rows]
        x3 = x.reshape(rows, -1, x.shape[-1])
        d3 = delta.reshape(rows, -1, delta.shape[-1])
        for p in self.owners[module]:
            g = torch.einsum("rto,rti->roi", d3, x3) if p is module.weight else d3.sum(dim=1)
            start = self.offsets[id(p)]
            self.buffers[:, start:start + p.numel()].index_add_(0, owner, g.reshape(rows, -1).to(self.buffers.dtype))
