"""GARDO: GRPO with diversity-aware advantages and a KL term on the uncertain samples only, to a reference that is
reset now and then, as FlowGRPO's code computes it.

Source: github.com/yifan123/flow_grpo at 94e23ee: scripts/train_sd3_gardo.py (":N" below), flow_grpo/stat_tracking.py
(type ``gardo``, "st:N"), config/grpo_gardo.py (the preset ``gardo-sd3``) and scripts/single_node/grpo_gardo_sd3.sh.
The rollout, the SDE step, the clipped surrogate and the KL's form are FlowGRPO's SD3 script's
(``lean.algorithms.grpo``).

Rewards. Every reward of ``reward.weights`` is scored (FlowGRPO's multi_score: ocr 0.8, aesthetic 0.1, imagereward 0.1,
each kept unweighted beside the weighted sum); the advantage reads the main reward alone (:799-801 put
``config.main_reward`` in place of the weighted sum: ``algorithm.gardo.main_reward``), the gate ranks it against the
others (:826, ``algorithm.gardo.gate_rewards``), and the diversity d_i is a group-wise reward's value
(``algorithm.gardo.diversity_reward``: ``lean.rewards.diversity``, the cosine distance of sample i's image features to
its nearest group mate, st:16-18, st:29-39). Columns: ``components`` [N, R] in ``reward.weights`` order.

Targets (st:25-50 from :824; the tracker is cleared every iteration, :856, so the mean is the group's in this batch).
Sample i of group g, main reward r_i:

    w_i = 1 if r_i < mean_g r, else d_i / mean_g d                                             (st:42)
    A_i = clamp((r_i - mean_g r) w_i, -adv_clip_max, adv_clip_max)                   [N]       (st:49-50, :966-970)

no division by a std (the tracker's std, st:43-46, is not read for ``gardo``; nor are ``algorithm.global_std``,
``adv_std``, ``adv_eps`` and ``reward_combination`` here).

The gate (:825-836), over the gathered batch of N samples; rank_k(i) in 1..N is sample i's rank by reward k, the
highest first:

    u_i = rank_main(i) - mean_{k in gate rewards} rank_k(i)                              [N]       (:833)
    t   = percentile_{100 - 100 c} {u_i : u_i >= 0}         (numpy's linear interpolation, :835)
    g_i = u_i > t                                                                        [N]       (:836)

c is set by a controller (RiskCompensator, :218-237) just before t, from m = mean {u_i >= 0} (:834): c = c_0 at the
first iteration; after it c (1 + a) when m is above each of the last W means, c (1 - a) when below each of them, else
c; then clipped to [c_min, c_max], and m joins the W means (c_0 = a = 0.1, c_min 0.02, c_max 0.2, W 20: :219-225,
:229-237; ``algorithm.gardo.gate_*``).

The loss of sample b at trained step j (:966-990), r the ratio, kl_bj = w_j mean_D (mu - mu_ref)^2 / (2 std_j^2)
(GRPO's ``kl_form: flow_grpo``, :983-984) with mu_ref the reference's transition mean:

    loss_bj = max(-A_b r, -A_b clip(r, 1 - c, 1 + c)) + beta f_b kl_bj,      f_b = (N_kept / G) g_b kept_b
    L       = 1/(N K) sum_b sum_{j in T_b} loss_bj                            (GRPO's average over the kept samples)

N_kept and G count the kept and the gated kept samples of the whole batch (every process), so the KL part of an
update is beta times the mean of kl over the gated samples (:983-986 average kl over the gated rows): exactly on one
process, and in the average over processes when each keeps as many samples.

The reference (:462, :636-640, :787-798, :1039-1042): a second adapter, a copy of the trained one at the start,
copied again before the update of iteration e when e - e_last > ``reset_every`` (15, grpo_gardo.py:22), or, e > 0,
when the previous iteration's KL exceeded ``kl_threshold`` (3e-4, grpo_gardo.py:29); e_last is the iteration of the
last copy, and nothing is copied without the KL term (:787). lean keeps it as the algorithm's ``Snapshot``
(``lean.models.snapshot``, copied by :meth:`GARDO.snapshot_decay` before the rollout, under the weights the rollout
and the update start from, as the script's copy after its rollout), read by the KL's reference forward
(``Policy.reference_weights``).

The script's policy term carries std_bj / mean_b std_bj over its micro-batch (:979). Every row of a micro-batch sits
at the same step j (:944-955) and std is a function of sigma_j, so the factor is 1 (to the rounding of a mean of equal
numbers): lean leaves it out.

Differences from the source:
* the KL's mean. The script averages kl over the gated rows of each micro-batch, a micro-batch with none adding 0
  (:980-990), so a gated sample's weight depends on how the micro-batches fall; lean weighs each gated kept sample by
  N_kept / G of the batch (f_b above), the same under every schedule, which is what keeps them exact. With several
  updates per rollout, each update's KL part is its own gated terms over its own N, times N_kept / G.
* when the reference is reset: the script compares, at every optimizer step, the mean of its micro-steps' gated KL
  means (a micro-step with no gated row counts 0; averaged over processes, :1019-1020, :1039-1041) with the threshold;
  lean compares the update's mean of kl over the gated kept terms of every process (``kl_weighted``, from its sums
  over processes) once per iteration.
* the diversity's features: DINOv3 ViT-L/16 (:624-631, :713) in the script; lean's ``diversity`` reward has its own
  feature spaces (``reward.diversity.features``: ``pixels``; lean/rewards/diversity.py).
* ranks break ties by sample order (a stable sort; the script's ``torch.sort`` is not stable, :827), and lean's batch
  is in group order, the script's in its sampler's.
* a group whose rewards are all equal gets A = 0 exactly (GRPO's rule, ``lean.algorithms.groups``), where the
  script's mean may leave a rounding residue; a group whose diversities are all 0 (or a group of one, where the
  script's ``np.min`` of nothing raises) takes w = 1, where the script divides by 0.
* zero-advantage samples leave the update (:876-897, ``algorithm.skip_zero_advantage``) without the script's padding
  to a multiple of the micro-batch count (:879-888), as in flowgrpo-sd3.

Why all three schedules are exact: on-policy the ratio is 1 and the policy term -A r is linear in A (GRPO's facts);
f_b is known once the rewards are, for the whole batch at once, and is a constant in theta, so the KL part is a
fixed weighted sum of each sample's kl. Recompute and Retain weigh each step's KL term by f_b after the rewards
(``IterationContext.total``); Reweight backpropagates it during the rollout into a buffer per trajectory (Q_b) and
folds it with f_b (``lean.schedules.reweight``). The reference moves between iterations only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lean.algorithms.groups import _constant, _groups
from lean.algorithms.grpo import GRPO
from lean.config.checks import ConfigError, check_positive
from lean.config.sections import register_options
from lean.parallel.sharding import shards
from lean.sampling.transition import Transition

# the update's KL over its gated terms, factor-weighted, and the factors' sum (lean.algorithms.loss_stats): their
# ratio, each averaged over processes, is the mean over the whole batch's gated terms
KL_STATISTICS = ("kl_weighted_sum", "kl_factor_sum")


def descending_ranks(values: Tensor) -> Tensor:
    """Each entry's rank [N] (float64), 1 for the largest; ties in index order."""
    order = torch.sort(values, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, len(values) + 1, device=values.device)
    return ranks.to(torch.float64)


def uncertainty(main: Tensor, others: Tensor) -> Tensor:
    """u [N] = rank(main) - the mean of the ranks by each column of ``others`` [N, K] (:825-833)."""
    return descending_ranks(main) - torch.stack([descending_ranks(c) for c in others.T]).mean(dim=0)


def percentile(values: Tensor, fraction: float) -> Tensor:
    """``np.percentile(values, 100 - 100 fraction)`` (linear interpolation between the order statistics)."""
    return torch.quantile(values, (100 - fraction * 100) / 100, interpolation="linear")


def diversity_weights(centred: Tensor, diversity: Tensor, inverse: Tensor, count: Tensor) -> Tensor:
    """w [N]: 1 where the reward is below its group's mean, else d / the group's mean d (1 where that mean is 0)."""
    mean = torch.zeros_like(count).index_add_(0, inverse, diversity.to(torch.float64)) / count
    spread = mean[inverse]
    scaled = torch.where(spread > 0, diversity / torch.where(spread > 0, spread, 1.0), 1.0)
    return torch.where(centred < 0, 1.0, scaled)


@dataclass
class GateController:
    """The gated fraction c and the last means it compares with (the script's RiskCompensator, :218-237)."""

    fraction: float | None = None  # c; None before the first iteration
    means: list[float] = field(default_factory=list)  # the last ``window`` means of the non-negative u

    def update(self, mean: float, o: GARDOConfig) -> float:
        """c after an iteration whose non-negative u average ``mean``."""
        if not self.means:
            c = o.gate_fraction
        elif mean > max(self.means):
            c = self.fraction * (1 + o.gate_step)
        elif mean < min(self.means):
            c = self.fraction * (1 - o.gate_step)
        else:
            c = self.fraction
        self.fraction = min(max(c, o.gate_min), o.gate_max)
        self.means = [*self.means, mean][-o.gate_window :]
        return self.fraction


class GARDO(GRPO):
    """GRPO with the diversity-aware targets, the gated KL and the reset reference of the module docstring."""

    uses_snapshot = True  # the reference adapter
    references_snapshot = True
    feedback = KL_STATISTICS

    def __init__(self, cfg, sigmas):
        super().__init__(cfg, sigmas)
        self.columns = list(cfg.reward.weights)  # components' columns
        self.steps_per_iteration = cfg.train.optimizer_steps_per_iteration * cfg.train.num_inner_epochs
        self.controller = GateController()
        self.last_reset, self.kl_exceeded = 0, False  # e_last, and the last update's KL above the threshold

    @property
    def options(self) -> GARDOConfig:
        return self.cfg.gardo

    @classmethod
    def working_overrides(cls, cfg) -> list[str] | None:
        """GARDO on the run's first reward: it is the main reward, a second one scored at weight 0 is the gate's
        (jpeg_compressibility, or the run's second), and the diversity reward is scored at weight 0 (the
        workbench's GARDO run, params.yaml)."""
        weights = dict(cfg.reward.weights)
        main = next(iter(weights))
        gate = next((name for name in weights if name != main), "jpeg_compressibility")
        weights.setdefault(gate, 0.0)
        diversity = cfg.algorithm.gardo.diversity_reward
        if diversity is not None:
            weights.setdefault(diversity, 0.0)
        rewards = ", ".join(f"{name}: {w}" for name, w in weights.items())
        return [
            f"algorithm.gardo.main_reward={main}",
            f"algorithm.gardo.gate_rewards=[{gate}]",
            f"reward.weights={{{rewards}}}",
        ]

    @classmethod
    def problem(cls, cfg, world_size: int | None = None) -> tuple[str, object, str] | None:
        o, weights = cfg.algorithm.gardo, cfg.reward.weights
        named = [("main_reward", o.main_reward), *(("gate_rewards", r) for r in o.gate_rewards)]
        if o.diversity_reward is not None:
            named.append(("diversity_reward", o.diversity_reward))
        for key, name in named:
            if name not in weights:
                return f"algorithm.gardo.{key}", name, f"must be a reward of reward.weights ({', '.join(weights)})"
        if shards(cfg.parallel.shard):
            return (
                "parallel.shard",
                cfg.parallel.shard,
                "gardo's reference weights are swapped into the modules: unsharded only",
            )
        return None

    @property
    def reads_reward_components(self) -> bool:
        return True

    def column(self, components: Tensor, name: str) -> Tensor:
        return components[:, self.columns.index(name)].to(torch.float64)

    def targets(self, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None) -> Tensor:
        """A [N] of the module docstring, from the main reward and the diversity columns of ``components``."""
        if components is None:
            raise ValueError("gardo's targets read each reward's values (components), not only their weighted sum")
        main = self.column(components, self.options.main_reward)
        r, inverse, count, mean = _groups(main, group_ids)
        centred = r - mean[inverse]
        if self.options.diversity_reward is not None:
            diversity = self.column(components, self.options.diversity_reward)
            centred = centred * diversity_weights(centred, diversity, inverse, count)
        advantages = torch.where(_constant(r, inverse, count)[inverse], 0.0, centred)
        return advantages.clamp(-self.cfg.adv_clip_max, self.cfg.adv_clip_max)

    def gate(self, components: Tensor) -> Tensor:
        """g [N] (bool): u above the percentile the controller sets (module docstring); one controller step."""
        main = self.column(components, self.options.main_reward)
        others = torch.stack([self.column(components, name) for name in self.options.gate_rewards], dim=1)
        u = uncertainty(main, others)
        nonnegative = u[u >= 0]  # never empty: the u sum to 0
        fraction = self.controller.update(float(nonnegative.mean()), self.options)
        return u > percentile(nonnegative, fraction)

    @property
    def weighs_regulariser(self) -> bool:
        return self.kl_weight > 0

    def regulariser_factors(
        self, targets: Tensor, rewards: Tensor, group_ids: Tensor, components: Tensor | None = None
    ) -> Tensor | None:
        """f [N] = (N_kept / G) g kept: each gated kept sample's KL weighed so that the KL part is their mean."""
        if not self.weighs_regulariser:
            return None
        kept, _ = self.kept_samples(targets)
        gated = self.gate(components)  # one controller step per iteration
        if kept is not None:
            gated = gated & kept
        n_kept = targets.numel() if kept is None else int(kept.sum())
        return gated.to(torch.float64) * (n_kept / max(int(gated.sum()), 1))

    def snapshot_decay(self, optimizer_steps: int) -> float | None:
        """0 (copy the trained weights into the reference) when the reset is due before iteration e, else None."""
        e = optimizer_steps // self.steps_per_iteration
        if not self.kl_weight or not ((e != 0 and self.kl_exceeded) or e - self.last_reset > self.options.reset_every):
            return None
        self.last_reset, self.kl_exceeded = e, False
        return 0.0

    def end_iteration(self, iteration: int, stats: dict[str, float]) -> None:
        """Whether the update's mean KL over the gated terms of every process exceeded ``kl_threshold``."""
        weighted, factors = (stats[k] for k in KL_STATISTICS)
        self.kl_exceeded = self.kl_exceeded or (factors > 0 and weighted / factors > self.options.kl_threshold)

    def state_dict(self) -> dict:
        return {
            "controller": dataclasses.asdict(self.controller),
            "last_reset": self.last_reset,
            "kl_exceeded": self.kl_exceeded,
        }

    def load_state_dict(self, state: dict) -> None:
        self.controller = GateController(**state["controller"])
        self.last_reset, self.kl_exceeded = state["last_reset"], state["kl_exceeded"]

    def reference_loss(self, policy, step: Transition, emb, targets: Tensor, kl_factor: Tensor | None = None) -> Tensor:
        """The certificate's anchor: GRPO's float64 recompute of the step (the reference: the policy's
        ``reference_weights``, the run's snapshot upcast), each row's KL times its factor ``kl_factor`` [B]."""
        loss = self.step_loss(self.recomputed(policy, step, emb), targets.double())
        return loss.total(self.kl_weight, kl_factor)


@register_options("algorithm.gardo")
@dataclass
class GARDOConfig:
    """GARDO's keys (``lean/algorithms/gardo.py``); defaults: config/grpo_gardo.py and the script at 94e23ee."""

    main_reward: str = "ocr"
    """The reward the advantage reads and the gate ranks first (config.main_reward, grpo_gardo.py:79)."""
    gate_rewards: list[str] = field(default_factory=lambda: ["aesthetic", "imagereward"])
    """The rewards whose mean rank the gate compares with the main reward's (train_sd3_gardo.py:826)."""
    diversity_reward: str | None = "diversity"
    """The reward whose value is each sample's diversity d (``lean.rewards.diversity``); None: w = 1 (no
    diversity amplification)."""
    kl_threshold: float = 3e-4
    """The reference is reset after an iteration whose mean KL over its gated terms exceeded it (kl_thres,
    grpo_gardo.py:29; at 0 the rounding of an on-policy KL, ~1e-30 where CFG's halves batch differently, resets)."""
    reset_every: int = 15
    """... and when more than this many iterations passed since the last reset (reset_freq, grpo_gardo.py:22)."""
    gate_fraction: float = 0.1
    """c_0: the gated fraction at the first iteration (RiskCompensator base, train_sd3_gardo.py:219, :229)."""
    gate_step: float = 0.1
    """a: c grows by 1 + a or shrinks by 1 - a (alpha, train_sd3_gardo.py:222)."""
    gate_min: float = 0.02
    """c is clipped to [gate_min, gate_max] (train_sd3_gardo.py:224, :234)."""
    gate_max: float = 0.2
    """(train_sd3_gardo.py:225)."""
    gate_window: int = 20
    """W: how many past means the controller compares with (train_sd3_gardo.py:236-237)."""

    def validate(self, prefix: str) -> None:
        if not self.gate_rewards:
            raise ConfigError(f"{prefix}.gate_rewards", self.gate_rewards, "name at least one reward the gate ranks")
        check_positive(f"{prefix}.kl_threshold", self.kl_threshold, strict=False)
        check_positive(f"{prefix}.reset_every", self.reset_every, strict=False)
        check_positive(f"{prefix}.gate_window", self.gate_window)
        for key in ("gate_fraction", "gate_step", "gate_min", "gate_max"):
            check_positive(f"{prefix}.{key}", getattr(self, key), strict=False)
        if not 0 <= self.gate_min <= self.gate_max <= 1:
            raise ConfigError(f"{prefix}.gate_max", self.gate_max, f"must be in [gate_min={self.gate_min}, 1]")

    @property
    def batch_wide(self) -> bool:
        """The gate ranks every reward of the batch: no group finishes before the last is scored."""
        return True
