"""Several optimizer steps per tree rollout, by edges: BranchGRPO's updates (Fredreic1849/BranchGRPO@19fbb9f,
``fastvideo/train_branchgrpo_flux.py``; docs/design/tree-rollouts.md, section 1.5).

The tree script shuffles the process's trained edges (:1481), backpropagates them one at a time and steps the
optimizer after every G = ``--gradient_accumulation_steps`` edges, and once more for the remainder (:1592-1610). With
``train.edges_per_update`` = G and E the local trained (kept) edges, the cells (first leaf, step) of those edges on the
[B, num_steps] grid (``lean.sampling.tree``) are put in row-major order, permuted by the iteration's shared update
stream (the stream of Recompute's first-epoch shuffle), and split into

    C_1, ..., C_S,   |C_s| = G for s < S,   |C_S| = E - G (S - 1),   S = ceil(E / G)

one optimizer step each, C_1 under the rollout's weights (ratio 1), the later ones under moved weights (the clip acts).
The order depends on (seed, iteration, the cells) alone: every schedule draws the same chunks, and without width
pruning (cells known before the rollout, the same on every process) a hybrid knows C_1 before the rollout
(``lean.schedules.hybrid.EdgeUpdates``). Each edge's term keeps its weight in the objective whatever its chunk
(``lean.algorithms.branch_grpo``: the tree script's 1/(G floor(E/T))).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lean.sampling.rollout import iteration_generator
from lean.sampling.tree import tree_shape

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.schedules.base import IterationContext

UPDATE_STREAM = 1  # iteration_generator purpose: the stream of Recompute's first-epoch shuffle


def edges_per_update(cfg: RunConfig) -> int | None:
    """G, the trained edges of one optimizer step on a tree rollout, or None: one update per rollout (a flat rollout
    splits its samples by ``train.optimizer_steps_per_iteration`` instead)."""
    return cfg.train.edges_per_update if tree_shape(cfg.sample) is not None else None


def update_count(edges: int, size: int) -> int:
    """S = ceil(E / G): a step every G edges and one for the remainder (the tree script's :1592-1610)."""
    return -(-edges // size)


def first_edges(ctx: IterationContext, kept: torch.Tensor | None) -> torch.Tensor:
    """C_1: host bool [B, num_steps], the first update's cells among ``ctx``'s trained ones that the update keeps
    (``kept`` [B, num_steps], any device; None: all)."""
    cells = ctx.steps.trained.cpu()
    return edge_chunks(ctx.cfg, ctx.iteration, cells if kept is None else cells & kept.cpu())[0]


def edge_chunks(cfg: RunConfig, iteration: int, cells: torch.Tensor) -> list[torch.Tensor]:
    """The updates of ``iteration``: host bool [B, num_steps] masks C_1..C_S of the host bool ``cells`` (the trained,
    kept edges), disjoint, their union ``cells`` (module docstring)."""
    ids = torch.nonzero(cells.flatten()).flatten()
    order = ids[torch.randperm(len(ids), generator=iteration_generator(cfg.train.seed, iteration, UPDATE_STREAM))]
    chunks = []
    for chunk in order.split(edges_per_update(cfg)):
        mask = torch.zeros(cells.numel(), dtype=torch.bool)
        mask[chunk] = True
        chunks.append(mask.view_as(cells))
    return chunks
