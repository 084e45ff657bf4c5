"""TreeGRPO (Ding & Ye, ICLR 2026, arXiv 2512.08153; github.com/zh-ding/TreeGRPO): GRPO's clipped surrogate on a tree
rollout whose SDE steps are its branch points, each edge trained with the mean of the normalised rewards of the
leaves below it (the "tree advantage").

Source. The repository has no snapshot here (``fetch`` answers that none can be had, so no commit hash and no line
numbers); its files as the code index stores them were read instead: ``train.py`` (the trainer), ``schedulers_with_
logprob/flow_match_euler_discrete.py`` (the SDE step) and the README; ``configs/base.yaml`` and the tree pipeline
``pipelines_with_logprob/stablediffusion3.py`` only through a third-party analysis that quotes them. Citations are by
function: ``train.py``'s RLTrainer methods.

The tree (``RLTrainer.__init__``: ``tree_steps = [0, .., w - 1]``; ``sample``: ``sd3_pipeline_with_logprob(...,
tree_steps, tree_k, tree_use_ode)``; the scheduler's ``tree_k``, ``use_ode``). On the steps P = tree_steps every node
draws k children from its Gaussian, x'_j = mu + std eps_j (j = 1..k); every other step is an Euler ODE step
x' = x + dt v with no log-prob, not trained (``use_ode``). A tree has k^w leaves and (k^w - 1)/(k - 1) trained nodes
of k edges each (README: "Training samples per epoch"). lean's tree (``lean.sampling.tree``) with ``branch_points`` P
and ``branching`` k is that tree; :meth:`TreeGRPO.steps` makes P the SDE steps and the trained ones, the others ODE.
The step is FlowGRPO's SDE (``sample.sde_kind: flow_grpo``): std = noise_level sqrt(sigma / (1 - sigma)) sqrt(-dt),
log p the mean over the latent's elements of the Gaussian log-density.

Tree advantage (``sample``, ``update_advantages``). Per prompt, over the leaves of its trees (one tree a prompt here,
``sample.num_trees = 1``: a group is a tree), with mu and the population std sigma (``std(unbiased=False)``):

    a_l  = (r_l - mu) / (sigma + 1e-8)                                  each leaf l
    A(c) = mean_{children c' of c} A(c'),  A(leaf) = a_l                each node c, recursively
         = (1 / |Lv(c)|) sum_{l under c} a_l                            (the tree is full: equal subtrees)

and the edge u -> c trains with A(c) clamped to +-adv_clip_max (``treegrpo_update``). lean computes a_l with
``lean.algorithms.groups.group_advantages`` (``algorithm.adv_std: population``, ``adv_eps: 1e-8`` as the source, not
clamped), the subtree means with ``tree_targets.fused_rewards`` (its ``mean`` fusion of the leaves' values) and the
clamp with ``tree_targets.edge_targets``: float64 where the source computes in float32. Unlike BranchGRPO's depth-wise
advantages (``lean.algorithms.branch_grpo``) no depth is renormalised: A(c) keeps the reward gap's scale.

Loss (``treegrpo_update``, ``train``). One training sample is a trained node u (its x, sigma, embeddings, the k
children's x' and old log-probs); with r_e = exp(log p_theta(x'_e | x_u) - log p_old) and clip range c:

    l_e   = max(-A_e r_e, -A_e clip(r_e, 1 - c, 1 + c))                 (no KL: ``approx_kl`` is only logged)
    l_u   = sum_{e = u -> c} l_e                                          (``tree.loss_agg: sum``; ``mean``: / k)

The process's N_u trained nodes are shuffled and backpropagated one at a time under Accelerate's accumulation with
``gradient_accumulation_steps = max(1, N_u // 2)`` = G (``train``), which divides each loss by G and steps the
optimizer every G nodes (clipping the gradient norm at 1.0 first): two optimizer steps per rollout of G nodes each
(N_u even; the README's 2 prompts a process give N_u = 30, G = 15), one inner epoch; the processes' gradients are
averaged. lean's objective per update weighs every trained edge 1/G (:meth:`TreeGRPO.kept_terms`):

    L = (1 / max(1, floor(N_u / 2))) sum_{trained edges e of the process} [l_e + beta KL_e]

(beta = 0 as the source; GRPO's KL term where set). With ``train.edges_per_update`` = 2G edges the update is split
into the source's count of optimizer steps (``lean.schedules.edge_updates``: shuffled edges, where the source shuffles
nodes, so a node's k edges may land in different steps), each edge still weighing 1/G; by default one update per tree
rollout (every edge on-policy).

Exactness. On-policy r = 1 identically and the loss is linear in A: Retain (one kept graph per trained node, its k
edges' log-prob terms on it) and Reweight (one buffer per trained edge) give Recompute's gradient; with
``edges_per_update`` the first update is recompute-free and the later ones recomputed (the exact hybrid,
``lean.schedules.hybrid``), as the LeanGRPO paper classes TreeGRPO (App. G, Table 5: target recomputation,
graph-colocated).

Not reproduced: the window's slide (``run``: ``tree_steps += tree.s`` every ``tree.tou`` epochs, 1 every 50 of 300):
a lean tree's branch points are fixed, those of the source's first 50 epochs; the SDE step's std clamp to
[e^-5, e^2] (binds only at a std outside it: none on a 10-step grid at noise 0.7); several trees a prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lean.algorithms.branch_grpo import tree_problem, tree_rows
from lean.algorithms.groups import group_advantages
from lean.algorithms.grpo import GRPO
from lean.algorithms.tree_targets import edge_grid, edge_targets, fused_rewards
from lean.sampling.sde import StepSelection
from lean.sampling.tree import tree_shape

if TYPE_CHECKING:
    from torch import Tensor

    from lean.config import RunConfig


class TreeGRPO(GRPO):
    trains_trees = True

    @classmethod
    def problem(cls, cfg: RunConfig, world_size: int | None = None) -> tuple | None:
        if (problem := tree_problem(cfg, "TreeGRPO")) is not None:
            return problem
        if cfg.sample.sde_window:
            return "sample.sde_window", cfg.sample.sde_window, "TreeGRPO's SDE steps are its branch points: set 0"
        if cfg.algorithm.reward_combination != "sum":
            why = "TreeGRPO normalises the leaves' weighted reward (sum)"
            return "algorithm.reward_combination", cfg.algorithm.reward_combination, why
        return None

    @classmethod
    def working_overrides(cls, cfg: RunConfig) -> list[str]:
        """TreeGRPO's tree on ``cfg``'s steps: binary branches at w consecutive steps from 0 (its tree_steps
        [0, .., w - 1]), w = log2(group_size) where the group is a power of 2 (else 4 and the group 16, the
        README's k = 2, w = 4), at most num_steps - 1 of them; the SDE steps its branch points."""
        s, t = cfg.sample, cfg.train
        w = next((w for w in range(1, 8) if 2**w == t.group_size), None)
        w = min(w or 4, s.num_steps - 1)
        fix = [f"sample.tree.branch_points=[{','.join(str(i) for i in range(w))}]", "sample.tree.branching=2"]
        if t.group_size != 2**w:
            fix.append(f"train.group_size={2**w}")
        if s.sde_window:
            fix.append("sample.sde_window=0")
        if cfg.algorithm.skip_zero_advantage:
            fix.append("algorithm.skip_zero_advantage=false")
        if cfg.algorithm.reward_combination != "sum":
            fix.append("algorithm.reward_combination=sum")
        if t.optimizer_steps_per_iteration != 1 or t.num_inner_epochs != 1:
            fix += ["train.optimizer_steps_per_iteration=1", "train.num_inner_epochs=1"]
        return fix

    @classmethod
    def steps(cls, cfg: RunConfig, iteration: int, batch_size: int) -> StepSelection | None:
        """The branch points are the SDE steps and every sample trains them (the tree keeps each edge on its first
        leaf's row: ``lean.run.iteration.on_tree``); the other steps are ODE steps (the source's ``use_ode``)."""
        shape = tree_shape(cfg.sample)
        if shape is None:
            return None
        stochastic = torch.zeros(shape.num_steps, dtype=torch.bool)
        stochastic[list(shape.branch_points)] = True
        return StepSelection(stochastic=stochastic, trained=stochastic.expand(batch_size, -1).clone())

    def kept_terms(self, targets: Tensor, trained: Tensor, iteration: int) -> tuple[Tensor | None, int | Tensor]:
        """Every trained edge, each weighing 1/G with G = max(1, floor(N_u / 2)), N_u the process's trained nodes
        (its trained edges over k): the N of 1/(N K) is G / K, K the trained steps of a leaf."""
        edges = int(trained.sum())
        nodes = edges // self.sample.tree.branching
        return None, max(1, nodes // 2) / int(trained[0].sum())

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        """[N, num_steps] float64: each edge's tree advantage at (its first leaf, its step), 0 elsewhere."""
        shape = tree_shape(self.sample)
        trees = tree_rows(shape, group_ids)
        cfg = self.cfg
        leaves = group_advantages(
            rewards, group_ids, global_std=cfg.global_std, eps=cfg.adv_eps, std_estimator=cfg.adv_std
        )
        edges = edge_targets(shape, fused_rewards(shape, leaves.view(trees, -1)), cfg.adv_clip_max)
        return edge_grid(shape, edges, len(rewards))
