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

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lean.config import ConfigError, check_positive, register_options
from lean.config.dtypes import storage_dtype
from lean.sampling.rollout import (
    RolloutHooks,
    RolloutLoop,
    RolloutPlan,
    StepNoise,
    forward_rows,
    predicted_x0,
    velocity,
)
from lean.sampling.sde import compute_dtype, ode_step, sde_step_with_logprob
from lean.sampling.transition import Transition

if TYPE_CHECKING:
    from lean.sampling.options import SampleConfig


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

    def trees_per_micro_batch(self, rows: int) -> int:
        """Whole trees rolled out together in a micro-batch of ``rows`` rows (at least one)."""
        return max(1, rows // self.leaves)

    def first_leaves(self, i: int, tree_ids: torch.Tensor) -> torch.Tensor:
        """The first leaf of each node of step i (0 <= i <= n) of the trees ``tree_ids`` among their leaves, tree by
        tree: tree t's node r is named by leaf t L + r L/live(i) (an edge of step i by its child's, at step i + 1)."""
        return (tree_ids[:, None] * self.leaves + torch.arange(self.live(i))[None] * self.leaves_under(i)).flatten()

    def leaves_under(self, i: int) -> int:
        """Leaves below each node of step i, L / live(i): node (i, r) holds leaves r L/live(i) to (r+1) L/live(i)-1."""
        return self.leaves // self.live(i)


def edge_cells(shape: TreeShape, batch: int) -> torch.Tensor:
    """Host bool [batch, num_steps]: the cells of the local batch's grid that name an edge, (first leaf, step): leaf l
    of its tree names an edge of step i iff l mod L/live(i+1) == 0 (``tree_rollout``). All True on a flat rollout."""
    leaf = torch.arange(batch)[:, None] % shape.leaves
    under = torch.tensor([shape.leaves_under(i + 1) for i in range(shape.num_steps)])[None]
    return leaf % under == 0


def tree_shape(cfg: SampleConfig) -> TreeShape | None:
    """The run's tree (``sample.tree`` over ``sample.num_steps``), or None for the flat rollout."""
    return cfg.tree.shape(cfg.num_steps) if cfg.tree.branch_points else None


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

    depth_pruning: list[int] = field(default_factory=list)
    """Child depths whose edges do not train (the edges of step d - 1 for depth d; the root is depth 0): pruning of
    the gradient, not of the rollout (BranchGRPO's --depth_pruning, :1268-1318; its launch script sets none)."""
    depth_pruning_slide_interval: int | None = None
    """Slide the pruned depths one shallower every this many iterations (BranchGRPO's --depth_pruning_slide with
    --depth_pruning_slide_interval, :1278-1295); null: a fixed set."""
    depth_pruning_stop_depth: int | None = None
    """The slide stops when the shallowest pruned depth reaches it; null: max(branch_points), the last branching
    node's depth (BranchGRPO's default, :1280-1285)."""

    def validate(self, prefix: str) -> None:
        points = self.branch_points
        if any(b <= a for a, b in zip(points, points[1:])) or any(q < 0 for q in points):
            raise ConfigError(f"{prefix}.branch_points", points, "must be increasing steps from 0")
        if self.branching < 2:
            raise ConfigError(f"{prefix}.branching", self.branching, "must be >= 2 (one child is no branch)")
        check_positive(f"{prefix}.branch_noise_scale", self.branch_noise_scale)
        if self.depth_pruning and not points:
            raise ConfigError(f"{prefix}.depth_pruning", self.depth_pruning, "prunes a tree's edges: set branch_points")
        if self.depth_pruning_slide_interval is not None:
            check_positive(f"{prefix}.depth_pruning_slide_interval", self.depth_pruning_slide_interval)
        if self.depth_pruning_stop_depth is not None and self.depth_pruning_stop_depth < 0:
            raise ConfigError(f"{prefix}.depth_pruning_stop_depth", self.depth_pruning_stop_depth, "must be >= 0")

    def shape(self, num_steps: int) -> TreeShape:
        """The tree over ``num_steps`` sampling steps; a branch at the last step is refused (its children would decode
        the same x0-prediction), and so are pruned depths off the tree or pruning every step."""
        if self.branch_points and self.branch_points[-1] > num_steps - 2:
            k = len(self.branch_points)  # as many points (the same leaves), spread over the steps there are
            spacing = max(1, (num_steps - 2) // max(k - 1, 1))
            fits = [i * spacing for i in range(k)]
            raise ConfigError(
                "sample.tree.branch_points",
                self.branch_points,
                f"a branch needs a step after it: at most sample.num_steps - 2 = {num_steps - 2}, e.g. {fits}",
                [f"sample.tree.branch_points=[{','.join(map(str, fits))}]"] if fits[-1] <= num_steps - 2 else None,
            )
        depths = set(self.depth_pruning)
        if any(not 1 <= d <= num_steps for d in depths) or len(depths) >= num_steps - 1:
            raise ConfigError(
                "sample.tree.depth_pruning",
                self.depth_pruning,
                f"distinct depths in [1, sample.num_steps = {num_steps}], fewer than {num_steps - 1} (some must train)",
            )
        return TreeShape(num_steps, tuple(self.branch_points), self.branching)

    def pruned_steps(self, num_steps: int, iteration: int) -> torch.Tensor:
        """Host bool [num_steps]: the steps whose edges do not train at ``iteration`` (0-based; BranchGRPO's
        current_step = iteration + 1, :1857). With D the pruned depths and a slide interval I, the set is

            {d - s : d in D},   s = min((iteration + 1) // I, max(0, min D - stop_depth))     (:1286-1294)

        (s = 0 without a slide); depth d is the child of step d - 1, and a depth slid to 0 (the root) prunes nothing."""
        pruned = torch.zeros(num_steps, dtype=torch.bool)
        if not self.depth_pruning:
            return pruned
        shift = 0
        if self.depth_pruning_slide_interval is not None:
            stop = self.depth_pruning_stop_depth
            stop = (max(self.branch_points) if self.branch_points else 0) if stop is None else stop
            shift = min((iteration + 1) // self.depth_pruning_slide_interval, max(0, min(self.depth_pruning) - stop))
        for depth in self.depth_pruning:
            if 1 <= depth - shift <= num_steps:
                pruned[depth - shift - 1] = True
        return pruned


def tree_rollout(policy, plan: RolloutPlan, shape: TreeShape, hooks: RolloutHooks | None = None, kappa: float = 1.0):
    """Roll out ``len(plan.generators) // shape.leaves`` trees (``plan.generators``: every leaf's stream, tree by tree;
    a group is one tree); return what each leaf decodes [B, ...], as :func:`lean.sampling.rollout.rollout` does.

    Each node runs one forward per step; at a step its edges are its children, sampled from the node's mean with the
    edge's own noise: x'_e = mu_u + kappa_i std_i eps_e (kappa at a branch point, 1 elsewhere), scored under
    N(mu_u, std_i^2) (BranchGRPO's ``flux_step_with_split``, :229-311). The velocity and x of each edge are its parent's
    by index, so autograd keeps one graph per node with its children's log-prob terms on it.

    Edges are named by a leaf: edge (i, c) of tree t by its first leaf t L + c L/live(i+1), which draws its noise
    from that leaf's stream (the root's from its first leaf's, or ``plan.init_generators``). The transition handed to
    ``hooks.on_step`` has those leaves as ``rows``, so a tree's edges sit on the local batch's [B, num_steps] grid at
    (first leaf, step) and every schedule's per-row bookkeeping applies. Without branch points every leaf is a tree
    and this is the flat rollout, draw for draw. Trees run in micro-batches of ``plan.micro_batch // L`` trees (at
    least one), each through all its steps; a tracked step (``hooks.track_grad``) tracks the nodes with an edge among
    ``hooks.rows_tracked(i)`` (cells of step i by first leaf; None: every node), in forwards of
    ``plan.grad_micro_batch`` nodes, the others in one forward without autograd: each part's edges go to ``on_step``
    as a transition of their own (a hybrid's first update: ``lean.schedules.hybrid.EdgeUpdates``)."""
    hooks = hooks or RolloutHooks()
    leaves, batch = shape.leaves, len(plan.generators)
    trees = batch // leaves
    init = plan.init_generators or plan.generators
    roots = policy.init_latents(
        [init[t * leaves] for t in range(trees)], storage_dtype(plan.sampler.cfg.latent_dtype, policy.dtype)
    )
    steps = TreeSteps(policy, plan, hooks, shape, kappa)
    target = None
    per_micro_batch = shape.trees_per_micro_batch(plan.micro_batch or batch)
    for first in range(0, trees, per_micro_batch):
        tree_ids = torch.arange(first, min(first + per_micro_batch, trees))
        done = steps.roll_out(roots[tree_ids], tree_ids)
        target = done.new_empty((batch, *done.shape[1:])) if target is None else target
        rows = slice(first * leaves, (first + len(tree_ids)) * leaves)
        target[rows] = done
        if hooks.on_finished is not None:
            hooks.on_finished(rows, done)
    return target


def placed(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One tensor of the rows of ``parts`` (host ids, values), each at its id: the one part itself when it is all."""
    if len(parts) == 1:
        return parts[0][1]
    out = parts[0][1].new_empty((sum(len(ids) for ids, _ in parts), *parts[0][1].shape[1:]))
    for ids, values in parts:
        out[ids.to(out.device)] = values
    return out


class TreeSteps:
    """The steps of :func:`tree_rollout`, a micro-batch of trees at a time."""

    def __init__(self, policy, plan: RolloutPlan, hooks: RolloutHooks, shape: TreeShape, kappa: float):
        self.loop = RolloutLoop(policy, plan, hooks)  # the grid, which steps are stochastic
        self.policy, self.plan, self.hooks, self.shape, self.kappa = policy, plan, hooks, shape, kappa
        if shape.num_steps != self.loop.num_steps:
            raise ValueError(f"a tree over {shape.num_steps} steps on a grid of {self.loop.num_steps}")

    def edges(self, i: int, tree_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each edge's parent among the micro-batch's nodes of step i, its first leaf in the local batch), host ids
        [trees x edges(i)], tree by tree."""
        s = self.shape
        parents = torch.arange(len(tree_ids))[:, None] * s.live(i) + s.parent(i)[None]
        return parents.flatten(), self.shape.first_leaves(i + 1, tree_ids)

    def roll_out(self, roots: torch.Tensor, tree_ids: torch.Tensor) -> torch.Tensor:
        """All steps of the trees ``tree_ids`` from their roots [trees, ...]; returns their leaves' decode target."""
        loop, plan, hooks = self.loop, self.plan, self.hooks
        x, x0 = roots, None
        for i in range(loop.num_steps):
            nodes = x.shape[0]
            emb = plan.emb.index(self.shape.first_leaves(i, tree_ids))  # each node's prompt: its tree's
            tracked = loop.stochastic[i] and hooks.track_grad(i)
            x_next, x0_parts = [], []  # (ids, values) of each forward's part
            for part, grad in forward_rows(nodes, tracked, None, self.tracked_nodes(i, tree_ids) if tracked else None):
                ids = torch.arange(nodes)[part]
                v = self.velocity(x[part], loop.grid[i], emb.index(part), grad)
                if i == loop.num_steps - 1 and plan.decode == "x0_prediction":
                    x0_parts.append((ids, predicted_x0(v.detach(), x[part], loop.grid, i)))
                if not loop.stochastic[i]:
                    if i in self.shape.branch_points:
                        raise ValueError(f"a branch at step {i}, an ODE step: a branch needs a stochastic step")
                    x_next.append((ids, ode_step(v.detach(), x[part], loop.grid, i).to(x.dtype)))
                else:
                    x_next.append(self.branch(i, x, v, tree_ids, ids))
            x0 = placed(x0_parts) if x0_parts else x0
            x = placed(x_next)
            if hooks.progress is not None:
                hooks.progress(i)
        return x if x0 is None else x0

    def tracked_nodes(self, i: int, tree_ids: torch.Tensor) -> torch.Tensor | None:
        """Host bool [nodes of step i]: the nodes one of whose edges is among ``hooks.rows_tracked(i)`` (None: all)."""
        rows = self.hooks.rows_tracked(i)
        if rows is None:
            return None
        parents, leaves = self.edges(i, tree_ids)
        mine = torch.zeros(len(tree_ids) * self.shape.live(i), dtype=torch.bool)
        mine[parents[rows[leaves]]] = True
        return mine

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, emb, tracked: bool) -> torch.Tensor:
        """The nodes' velocities: tracked in forwards of ``plan.grad_micro_batch`` nodes (one graph each), else one
        forward without autograd."""
        nodes = x.shape[0]
        size = (self.plan.grad_micro_batch or nodes) if tracked else nodes
        parts = []
        for start in range(0, nodes, size):
            rows = slice(start, min(start + size, nodes))
            with torch.set_grad_enabled(tracked):
                parts.append(velocity(self.policy, x[rows], sigma, emb.index(rows), self.plan.sampler.cfg))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def branch(
        self, i: int, x: torch.Tensor, v: torch.Tensor, tree_ids: torch.Tensor, nodes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step i's edges from the nodes ``nodes`` (host ids among x's rows; ``v`` their velocities): each child drawn
        from its parent's Gaussian, their transition handed to ``on_step``; returns (the edges' ids among the step's,
        their children x_{i+1}, detached). The edges stay node by node, b at a branch."""
        parents, leaves = self.edges(i, tree_ids)
        at = torch.full((x.shape[0],), -1, dtype=torch.long)
        at[nodes] = torch.arange(len(nodes))  # each node's row in v
        edges = torch.nonzero(at[parents] >= 0).flatten()
        parents, leaves = parents[edges], leaves[edges]
        noise = StepNoise(
            [self.plan.generators[int(leaf)] for leaf in leaves], tuple(x.shape[1:]), compute_dtype(x), x.device
        )
        scale = self.kappa if i in self.shape.branch_points else 1.0
        sample = x[parents.to(x.device)]
        with torch.set_grad_enabled(v.requires_grad):
            nxt, log_prob, mean, std = sde_step_with_logprob(
                self.plan.sampler.sde, v[at[parents].to(x.device)], sample, i, noise=scale * noise.take(i)
            )
        if self.hooks.on_step is not None:
            step = Transition(index=i, rows=leaves, sample=sample, next_sample=nxt, log_prob=log_prob)
            step = dataclasses.replace(step, mean=mean, std=std, sigmas=self.plan.sampler.sigmas)
            self.hooks.on_step(step.on_policy())
        return edges, nxt.detach()
