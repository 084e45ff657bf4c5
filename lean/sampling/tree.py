"""Tree rollouts: trajectories that share prefixes (BranchGRPO, Fredreic1849/BranchGRPO@19fbb9f,
``fastvideo/train_branchgrpo_flux.py``; docs/design/tree-rollouts.md).

One tree per prompt. Steps i = 0..n-1 of the sampler; at every step each live node runs one forward, and at a branch
point q in P it draws b children from it (elsewhere one). With p(i) = |{q in P : q < i}|:

    live(i)  = b^p(i)                         nodes at step i (i = 0..n; step 0 is the root x_T, step n the leaves)
    edges(i) = live(i + 1)                    transitions of step i, each into one node of step i + 1
    leaves   = b^|P|                          the tree's samples: one group of train.group_size = leaves

A node is (step i, row r); the children of row r at a branch point are rows r b .. r b + b - 1 of step i + 1 (elsewhere
row r stays r), so the leaves under node (i, r) are the contiguous rows r L/live(i) .. (r + 1) L/live(i) - 1, and an
edge of step i is named by its child's row. No node objects: every per-node quantity of a tree is a tensor [live(i)]
per step. The flat rollout is the tree without branch points (live = 1): every flat run is that special case.

For BranchGRPO's launch script (P = {0, 3, 6, 9}, n = 20, b = 2): 203 forwards and 218 edges per tree, 16 leaves;
16 flat trajectories take 320 of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lean.config import ConfigError, check_positive, register_options


@dataclass(frozen=True)
class TreeShape:
    """The shape every tree of a run has: ``num_steps`` (n), ``branch_points`` (P, increasing, in [0, n - 2]) and
    ``branching`` (b)."""

    num_steps: int
    branch_points: tuple[int, ...] = ()
    branching: int = 2

    def live(self, i: int) -> int:
        """Nodes at step i (0 <= i <= n)."""
        return self.branching ** sum(1 for q in self.branch_points if q < i)

    def edges(self, i: int) -> int:
        """Transitions of step i (0 <= i < n)."""
        return self.live(i + 1)

    @property
    def leaves(self) -> int:
        return self.live(self.num_steps)

    @property
    def forwards(self) -> int:
        """Transformer forwards of one tree's rollout: one per node of steps 0..n-1."""
        return sum(self.live(i) for i in range(self.num_steps))

    @property
    def total_edges(self) -> int:
        return sum(self.edges(i) for i in range(self.num_steps))

    @property
    def is_flat(self) -> bool:
        return not self.branch_points

    def parent(self, i: int) -> torch.Tensor:
        """LongTensor [edges(i)]: the row at step i whose forward each edge of step i comes from."""
        children = torch.arange(self.edges(i))
        return children // self.branching if i in self.branch_points else children

    def leaves_under(self, i: int) -> int:
        """Leaves below each node of step i, L / live(i): node (i, r) holds leaves r L/live(i) to (r+1) L/live(i)-1."""
        return self.leaves // self.live(i)


@register_options("sample.tree")
@dataclass
class TreeOptions:
    """The rollout's tree (``lean/sampling/tree.py``); no branch point: the flat rollout."""

    branch_points: list[int] = field(default_factory=list)
    """Steps at which each live node draws ``branching`` children (BranchGRPO's launch script: [0, 3, 6, 9])."""
    branching: int = 2
    """Children per branch (BranchGRPO hard-codes 2, train_branchgrpo_flux.py:404-405)."""
    branch_noise_scale: float = 1.0
    """kappa: a branch point's children are drawn as mu + kappa std eps, while their log-prob keeps std (BranchGRPO's
    --tree_split_noise_scale, :268-273; its launch script 4.0)."""

    def validate(self, prefix: str) -> None:
        points = self.branch_points
        if any(b <= a for a, b in zip(points, points[1:])) or any(q < 0 for q in points):
            raise ConfigError(f"{prefix}.branch_points", points, "must be increasing steps from 0")
        if self.branching < 2:
            raise ConfigError(f"{prefix}.branching", self.branching, "must be >= 2 (one child is no branch)")
        check_positive(f"{prefix}.branch_noise_scale", self.branch_noise_scale)

    def shape(self, num_steps: int) -> TreeShape:
        """The tree over ``num_steps`` sampling steps; a branch at the last step is refused (its children would decode
        the same x0-prediction)."""
        if self.branch_points and self.branch_points[-1] > num_steps - 2:
            raise ConfigError(
                "sample.tree.branch_points",
                self.branch_points,
                f"a branch needs a step after it: at most sample.num_steps - 2 = {num_steps - 2}",
            )
        return TreeShape(num_steps, tuple(self.branch_points), self.branching)
