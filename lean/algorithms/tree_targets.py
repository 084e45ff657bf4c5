"""Targets over a tree rollout (``lean.sampling.tree``): every node's reward fused from its leaves, depth-wise
advantages, and each edge's target, as BranchGRPO computes them (Fredreic1849/BranchGRPO@19fbb9f,
``fastvideo/train_branchgrpo_flux.py``; docs/design/tree-rollouts.md, section 1).

Reward fusion (``compute_node_rewards_from_leaves``, :545-652), for T trees at once, R_n = the leaves' rewards:

    mean                R(u) = (1/|Lv(u)|) sum_{l under u} r_l                                          (:643-649)
    log_prob_softmax    bottom-up: a one-child node copies its child's R; a node with children c_1..c_b takes
                        R(u) = sum_k softmax_k(alpha log p(c_k | u)) R(c_k), alpha = 1, the rollout's log-probs
                        (constants for the update)                                                       (:615-641)

Depth-wise advantages (``compute_hierarchical_advantages_by_depth``, :655-689), per tree and per depth d = step d
(the root is depth 0), over the n_d = live(d) nodes of that depth:

    A(u) = 0                                   if n_d <= 1 or std_d < 1e-6
    A(u) = (R(u) - mean_d R) / (std_d + 1e-8)  otherwise, std_d with Bessel's correction (torch's default)

The edge u -> c trains with its child's advantage A(c) (:1204), clamped to +-adv_clip_max (:1547). At a depth of two
nodes the advantages are +-1/sqrt(2) whatever the rewards' gap. BranchGRPO fuses in float32; lean in float64.
"""

from __future__ import annotations

import torch

from lean.sampling.tree import TreeShape

FUSIONS = ("mean", "log_prob_softmax")
STD_FLOOR, STD_EPS = 1e-6, 1e-8  # BranchGRPO's (:674, :680)


def fused_rewards(
    shape: TreeShape, leaf_rewards: torch.Tensor, fusion: str = "mean", log_probs: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Every node's reward: a list over steps 0..n of [T, live(i)] (float64), the last the leaves' ``leaf_rewards``
    [T, L]. ``log_prob_softmax`` reads ``log_probs``: per step i, the old log-prob of each edge [T, edges(i)]."""
    leaves = leaf_rewards.to(torch.float64)
    n = shape.num_steps
    if fusion == "mean":
        return [leaves.view(len(leaves), shape.live(i), shape.leaves_under(i)).mean(-1) for i in range(n + 1)]
    if fusion != "log_prob_softmax":
        raise ValueError(f"reward fusion {fusion!r}: one of {', '.join(FUSIONS)}")
    rewards = [leaves]
    for i in reversed(range(n)):  # step i's nodes from step i + 1's
        below = rewards[0]
        if i in shape.branch_points:
            weights = torch.softmax(log_probs[i].to(torch.float64).view(len(leaves), shape.live(i), -1), dim=-1)
            below = (weights * below.view_as(weights)).sum(-1)
        rewards.insert(0, below)
    return rewards


def depthwise_advantages(node_rewards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each node's advantage against the other nodes of its tree at its depth: a list over steps of [T, live(i)]."""
    out = []
    for rewards in node_rewards:
        if rewards.shape[1] <= 1:
            out.append(torch.zeros_like(rewards))
            continue
        std = rewards.std(dim=1, keepdim=True)
        normalised = (rewards - rewards.mean(dim=1, keepdim=True)) / (std + STD_EPS)
        out.append(torch.where(std < STD_FLOOR, torch.zeros_like(normalised), normalised))
    return out


def edge_targets(
    shape: TreeShape, node_advantages: list[torch.Tensor], clip: float | None = None
) -> list[torch.Tensor]:
    """Each edge's target: the advantage of the node it leads to, per step i of [T, edges(i)], clamped to +-``clip``
    when given."""
    targets = [node_advantages[i + 1] for i in range(shape.num_steps)]
    return [t.clamp(-clip, clip) for t in targets] if clip is not None else targets


def edge_grid(shape: TreeShape, edges: list[torch.Tensor], batch: int) -> torch.Tensor:
    """[batch, num_steps] float64: each edge's target (``edges``, per step i [T, edges(i)]) at (its first leaf, i), 0
    elsewhere: the local batch's grid the schedules read a tree's targets on (``lean.sampling.tree``)."""
    grid = torch.zeros((batch, shape.num_steps), dtype=torch.float64, device=edges[0].device)
    trees = torch.arange(len(edges[0]))
    for i, values in enumerate(edges):
        grid[shape.first_leaves(i + 1, trees), i] = values.flatten().to(grid)
    return grid
