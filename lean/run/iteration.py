"""One GRPO iteration, written once: the phases every caller runs, each with explicit inputs and outputs.

    local batch   which (group, prompt, sample) this process owns, their random streams, the trained-step selection
    embed         cached prompt embeddings of the local samples
    for each finishing unit (whole groups in the group layout, the whole local batch in the slice layout):
      rollout     the one sampling loop (``lean.sampling.rollout``) over the unit's rows, with the schedule's hooks
                  track_grad(i), on_step(step), on_finished(rows, x_T)
      score       each finished micro-batch decoded and scored (``lean.run.async_scoring``: beside the next's rollout)
      finish it   group layout: the unit's advantages from its own rewards, ``Schedule.finish_rows``
    advantages    rewards gathered over processes; the units' advantages, or the algorithm's targets of the whole
                  batch (GRPO: group advantages) -> this process's share
    finish        the schedule turns advantages into gradients; ``optimizer_step`` is the one place they are
                  synchronised, clipped and applied (``lean.run.optimizer``)

:meth:`IterationPipeline.run` composes them for ``lean train``, ``lean equivalence`` and ``lean bench schedules``;
the DVC stages (rollout / advantage / update) and ``lean plan``'s probe call the same phases one by one. A change to
the order of an iteration is made in :meth:`IterationPipeline.run` (and :meth:`~IterationPipeline.roll_out`, its
first half) alone.

Layout: the global batch of an iteration is prompts_per_iteration x group_size samples, in group order (the shared
layout: rank-major, ``lean.parallel.layout.shared_order``); process r owns the contiguous slice r of it
(``lean.parallel.layout.local_slice``). Random streams are keyed by (seed, iteration,
group, prompt, sample), so a trajectory never depends on the batching or on the number of processes, and two groups
of the same prompt differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import Tensor

from lean.algorithms import ALGORITHMS, Algorithm, build_algorithm
from lean.config import ConfigError
from lean.config.prompts import prompt_metadata
from lean.configure import validate
from lean.models.build import build_policy
from lean.models.footprint import tracked_step_floor
from lean.models.precision import set_matmul_precision
from lean.models.registry import family_spec
from lean.models.scheduler import terminal_stretch, time_shift
from lean.models.sequence_parallel import enable, sequence_problem
from lean.models.snapshot import Snapshot
from lean.observe.memory_trace import MemoryTrace
from lean.observe.metrics import FlopTally, PeakMemory, PhaseTimer, device_memory_mb, synchronize
from lean.parallel.distributed import CPU_TIMEOUT_S, World
from lean.parallel.layout import (
    SHARED,
    finish_unit,
    finishing_units,
    local_slice,
    resolve_layout,
    shared_order,
    wave_gathered,
)
from lean.parallel.overlap.p2p import Overlap
from lean.parallel.sharding import HSDP, replica_count, shard_policy, shards
from lean.rewards import RewardServerError, Scorer
from lean.rewards.scorer import ScoreStream
from lean.run.async_scoring import RolloutScoring, ScoredBatch, merge_shares, score_worker
from lean.sampling.rollout import (
    RolloutHooks,
    RolloutPlan,
    group_init_generator,
    iteration_generator,
    local_rows,
    rollout,
    sample_generator,
)
from lean.sampling.sde import StepRule, StepSelection, select_steps, sigma_schedule
from lean.sampling.transition import Transition
from lean.sampling.tree import edge_cells, tree_rollout, tree_shape
from lean.schedules import IterationContext, Schedule, schedule_class
from lean.schedules.base import OptimizerStep
from lean.schedules.recompute import rolled_out_in_update_order, shuffled

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.models.policy import Policy
    from lean.models.text import PromptEmbeds

SampleKey = tuple[int, int, int]  # (group, prompt index, sample index)
WINDOW_STREAM = 99  # iteration_generator purpose of the SDE window draw


class NonFiniteError(FloatingPointError):
    """A non-finite reward, log-prob, loss or gradient; the message names the tensor and the iteration."""


def global_samples(cfg: RunConfig, iteration: int) -> list[SampleKey]:
    """(group, prompt index, sample index) of every sample of the iteration, in global order: the prompts of the
    iteration are drawn from a stream every process shares, without replacement; with more groups than prompts, in
    passes over a fresh permutation each, so that every prompt is drawn as often as the count allows."""
    t = cfg.train
    gen = iteration_generator(t.seed, iteration)
    n = len(t.prompts)
    passes = -(-t.prompts_per_iteration // n)
    chosen = torch.cat([torch.randperm(n, generator=gen) for _ in range(passes)])[: t.prompts_per_iteration].tolist()
    return [(g, p, k) for g, p in enumerate(chosen) for k in range(t.group_size)]


@dataclass(frozen=True)
class LocalBatch:
    """One process's samples of one iteration."""

    iteration: int
    samples: list[SampleKey]  # the whole iteration, in global order
    local: slice  # this process's contiguous share of ``samples``
    prompts: list[str]  # of the local samples
    generators: list[torch.Generator]  # one random stream per local sample
    init_generators: list[torch.Generator] | None  # the initial noise's streams when not the samples' own
    steps: StepSelection  # which steps are stochastic, and which each local sample trains

    @property
    def mine(self) -> list[SampleKey]:
        return self.samples[self.local]

    def group_ids(self) -> Tensor:
        """Group of every sample of the iteration (global order) [N]."""
        return torch.tensor([g for g, _, _ in self.samples])

    def local_group_ids(self) -> Tensor:
        """Group of every local sample [B_local]."""
        return self.group_ids()[self.local]


def local_batch(cfg: RunConfig, iteration: int, rank: int = 0, world_size: int = 1) -> LocalBatch:
    """This process's samples of ``iteration``: prompts, random streams and trained-step selection. Under
    ``parallel.shard=fsdp`` the selection also holds the steps any process trains (``shared_grad_steps``)."""
    samples = global_samples(cfg, iteration)
    if resolve_layout(cfg, world_size) == SHARED:  # rank-major: each rank's Q samples of every prompt of its group
        samples = [samples[i] for i in shared_order(cfg.train.prompts_per_iteration, cfg.train.group_size, world_size)]
    if rolled_out_in_update_order(cfg.train):  # each share in its first update order: every share permuted alike
        share = len(samples) // world_size
        order = shuffled(cfg.train, iteration, share, epoch=0).tolist()
        samples = [samples[start + i] for start in range(0, len(samples), share) for i in order]
    local = local_slice(len(samples), rank, world_size)
    generators = [sample_generator(cfg.train.seed, iteration, g, p, k) for g, p, k in samples[local]]
    steps = select_local_steps(cfg, iteration, samples[local], generators)
    if shards(cfg.parallel.shard) and world_size > 1:  # every process tracks the same steps (lean.parallel.sharding)
        everyone = [
            select_local_steps(cfg, iteration, samples[other], None).grad_steps
            for other in (local_slice(len(samples), r, world_size) for r in range(world_size))
        ]
        steps = dataclasses.replace(steps, shared_grad_steps=torch.stack(everyone).any(dim=0))
    prompts = [cfg.train.prompts[p] for _, p, _ in samples[local]]
    init_generators = None
    if cfg.sample.init_same_noise:  # one stream per group; every sample of the group draws the same x_0 from it
        init_generators = [group_init_generator(cfg.train.seed, iteration, g, p) for g, p, _ in samples[local]]
    return LocalBatch(iteration, samples, local, prompts, generators, init_generators, steps)


def select_local_steps(
    cfg: RunConfig, iteration: int, samples: list[SampleKey], generators: list[torch.Generator] | None
) -> StepSelection:
    """The trained-step selection of ``samples``, drawn from their streams (``generators``, or fresh ones). The
    selection draws from the sample streams first, the rollout's noise comes after: a fixed order."""
    own = ALGORITHMS[cfg.algorithm.name].steps(cfg, iteration, len(samples))
    if own is not None:  # the algorithm places the SDE steps itself (MixGRPO's sliding window)
        return on_tree(cfg, own, iteration)
    if generators is None:
        generators = [sample_generator(cfg.train.seed, iteration, g, p, k) for g, p, k in samples]
    selection = select_steps(
        StepRule.of(cfg.sample),
        len(generators),
        window_generator=iteration_generator(cfg.train.seed, iteration, purpose=WINDOW_STREAM),
        sample_generators=generators,
    )
    return on_tree(cfg, selection, iteration)


def on_tree(cfg: RunConfig, selection: StepSelection, iteration: int) -> StepSelection:
    """On a tree rollout a trained step trains its edges, each at its first leaf's row (``lean.sampling.tree``),
    but for the depths ``sample.tree.depth_pruning`` prunes at ``iteration`` while the algorithm prunes (BranchGRPO's
    ``pruning_until``): known before the rollout, so no pruned edge's node is tracked for them."""
    shape = tree_shape(cfg.sample)
    if shape is None:
        return selection
    cells = edge_cells(shape, selection.trained.shape[0])
    if ALGORITHMS[cfg.algorithm.name].prunes(cfg, iteration):
        cells = cells & ~cfg.sample.tree.pruned_steps(shape.num_steps, iteration)[None]
    return dataclasses.replace(selection, trained=selection.trained & cells)


@dataclass
class FinishedUnits:
    """The finishing units the schedule finished during the rollout (group layout), with their advantages."""

    advantages: Tensor  # float64 [B_local] (tree: [B_local, num_steps]), host: true at rows [0, rows), 0 after them
    rows: int = 0  # local rows [0, rows) are finished
    stopped: bool = False  # a wave's rewards failed on some rank (shared layout): no later unit finishes early


@dataclass
class Rollout:
    """What the first half of an iteration leaves for the update: the schedule that saw every step, x_T, the
    rewards of the local samples and their components, and what was finished during the rollout."""

    batch: LocalBatch
    ctx: IterationContext
    schedule: Schedule
    final: Tensor  # x_T [B_local, ...]
    rewards: Tensor  # float64 [B_local]
    parts: dict[str, Tensor] = field(default_factory=dict)
    finished: FinishedUnits | None = None  # None: nothing finished before the rollout's end


@dataclass
class IterationResult:
    metrics: dict  # one row of metrics.csv
    final: Tensor  # x_T of the local samples
    rewards: Tensor  # float64 [N]: every sample of the iteration


def build_pipeline(cfg: RunConfig, world: World) -> IterationPipeline:
    """The policy of ``cfg`` on this process's device (``cfg`` validated for ``world.size`` first), and its sigma grid.
    The pipeline's config is ``cfg`` with ``sample.shift`` resolved (``lean.models.scheduler.time_shift``: the user's
    value, the pretrained folder's scheduler config, or the family's published one); ``pipeline.shift_source`` says
    which."""
    validate(cfg, world_size=world.size)
    refuse_what_cannot_fit(cfg, world.device)
    set_matmul_precision(cfg.model.torch_dtype, cfg.model.tf32, world.device)
    policy = build_policy(cfg.model, cfg.train.prompts, device=world.device)
    if shards(cfg.parallel.shard):
        replicas = replica_count(cfg.parallel.replicas) if cfg.parallel.shard == HSDP else 1
        shard_policy(policy, world, cfg.model.torch_dtype, replicas)
    if world.sequence_parallel > 1:
        if problem := sequence_problem(policy, world.sequence_parallel):
            raise ConfigError("parallel.sequence_parallel", world.sequence_parallel, problem)
        ov = Overlap(cfg.parallel.overlap, world.sequence_group, timeout=cfg.train.dist_timeout_s or CPU_TIMEOUT_S)
        policy.sequence_parallel = enable(policy.networks(), policy.runtime, ov)
    policy.negative_prompt = cfg.sample.negative_prompt
    shift, source = time_shift(
        cfg.model.family, cfg.model.pretrained, cfg.sample.shift, policy.runtime.image_seq_len, cfg.sample.num_steps
    )
    terminal = terminal_stretch(cfg.model.family, cfg.model.pretrained, cfg.sample.shift, cfg.sample.shift_terminal)
    cfg = dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, shift=shift, shift_terminal=terminal))
    sigmas = sigma_schedule(cfg.sample.num_steps, shift, cfg.sample.sigma_grid, terminal).to(world.device)
    pipeline = IterationPipeline(policy, cfg, sigmas, world)
    pipeline.shift_source = source
    return pipeline


def refuse_what_cannot_fit(cfg: RunConfig, device: torch.device) -> None:
    """A config error before anything is built when even one trajectory's tracked step cannot fit: its activations
    alone (a lower bound from the configs, ``lean.models.footprint.tracked_step_floor``) exceed
    ``train.memory_budget_mb`` or what the device has (``lean.observe.metrics.device_memory_mb``)."""
    floor, how = tracked_step_floor(cfg.model)
    available_mb = cfg.train.memory_budget_mb or device_memory_mb(device)
    if floor / 2**20 > available_mb:
        frames = ", with model.num_frames" if family_spec(cfg.model.family).video else ""
        raise ConfigError(
            "model.resolution",
            cfg.model.resolution,
            f"one trajectory's tracked step keeps at least {floor / 2**30:,.1f} GiB of activations ({how}{frames}), "
            f"more than the {available_mb / 1024:,.1f} GiB this process may use",
        )


class IterationPipeline:
    """The phases of one GRPO iteration on one process of ``world``, for ``policy`` under ``cfg``."""

    def __init__(self, policy: Policy, cfg: RunConfig, sigmas: Tensor, world: World | None = None):
        self.policy, self.cfg, self.sigmas = policy, cfg, sigmas
        self.algorithm: Algorithm = build_algorithm(cfg, sigmas)  # what is optimised (lean.algorithms)
        # the algorithm's second weights (NFT's old policy, DPO's reference): the trained ones at the start
        self.snapshot = (
            Snapshot([p for _, p in policy.trainable_parameters()]) if self.algorithm.uses_snapshot else None
        )
        if self.algorithm.references_snapshot:  # the KL's reference is the snapshot (GARDO's old adapter)
            policy.reference_weights = self.snapshot
        self.shift_source = "sample.shift"  # where the shift of ``sigmas`` came from (build_pipeline sets it)
        self.world = world or World(device=policy.device)
        self.failed_rollouts: Path | None = None  # where score() keeps a batch no reward server scored (lean train)

    @functools.cached_property
    def scorer(self) -> Scorer:
        """The run's rewards, built at the first score (a model reward loads its model once)."""
        return Scorer(self.cfg.reward, self.world.device)

    @functools.cached_property
    def score_worker(self) -> ThreadPoolExecutor:
        """The thread that scores rollout micro-batches during the rollout (``lean.run.async_scoring``), started
        once."""
        return score_worker()

    # ------------------------------------------------------------ phases

    def local_batch(self, iteration: int) -> LocalBatch:
        return local_batch(self.cfg, iteration, self.world.data_rank, self.world.data_size)

    def embed(self, batch: LocalBatch) -> PromptEmbeds:
        return self.policy.encode_prompts(batch.prompts)

    def context(
        self,
        batch: LocalBatch,
        emb: PromptEmbeds,
        timer: PhaseTimer | None = None,
        tally: FlopTally | None = None,
    ) -> IterationContext:
        return IterationContext(
            policy=self.policy,
            cfg=self.cfg,
            algorithm=self.algorithm,
            sigmas=self.sigmas,
            emb=emb,
            steps=batch.steps,
            iteration=batch.iteration,
            finish_unit=finish_unit(self.cfg, self.world.data_size),
            tally=tally or FlopTally(),
            timer=timer or PhaseTimer(self.world.device),
            samples=batch.mine,
            snapshot=self.snapshot,
        )

    def refresh_snapshot(self, iteration: int) -> None:
        """Move the algorithm's snapshot as it says before the rollout of ``iteration`` (after iteration x S x E
        optimizer steps: every iteration takes the same number, ``lean.schedules.recompute._chunks``)."""
        if self.snapshot is None:
            return
        t = self.cfg.train
        decay = self.algorithm.snapshot_decay(iteration * t.optimizer_steps_per_iteration * t.num_inner_epochs)
        if decay is not None:
            self.snapshot.blend(decay)

    def rollout(
        self,
        batch: LocalBatch,
        ctx: IterationContext,
        schedule: Schedule,
        *,
        rows: slice | None = None,
        on_step: Callable[[Transition], None] | None = None,
        progress: Callable[[int], None] | None = None,
        on_finished: Callable[[slice, Tensor], None] | None = None,
    ) -> Tensor:
        """Sample the local trajectories ``rows`` (a finishing unit; all by default) and return their x_T;
        ``on_step`` (a check or a recorder), then the schedule, see every SDE step; ``on_finished(rows, x_T)`` every
        finished micro-batch (rows of the local batch, as the steps')."""
        rows = rows or slice(0, len(batch.prompts))
        unit = UnitHooks(rows, schedule, on_step, on_finished)
        weights = self.snapshot.swapped_in() if self.algorithm.rolls_out_snapshot else contextlib.nullcontext()
        with ctx.timer("rollout"), ctx.tally.region("rollout_forward"), weights, schedule.saving():
            plan = RolloutPlan(
                sampler=ctx.sampler,
                emb=ctx.emb.index(rows),
                generators=batch.generators[rows],
                steps=batch.steps,
                init_generators=None if batch.init_generators is None else batch.init_generators[rows],
                micro_batch=self.cfg.train.rollout_batch_size,
                grad_micro_batch=schedule.grad_micro_batch,
                decode=self.cfg.reward.decode,
                joint_cfg=schedule.joint_cfg,
            )
            hooks = RolloutHooks(
                track_grad=schedule.track_grad,
                rows_tracked=unit.rows_tracked,
                on_step=unit.on_step,
                on_finished=unit.on_finished,
                progress=progress,
            )
            shape = tree_shape(self.cfg.sample)
            if shape is not None:
                return tree_rollout(self.policy, plan, shape, hooks, self.cfg.sample.tree.branch_noise_scale)
            return rollout(self.policy, plan, hooks)

    def reward(
        self, images: Tensor, prompts: list[str], audio: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The run's rewards of decoded ``images`` in [0, 1] (and ``audio``, for the rewards that read it): (total
        float64 [B], each reward's component)."""
        total, parts = self.scorer(images, prompts, audio=audio)
        return total.to(torch.float64), parts

    def decode_and_score(
        self, final: Tensor, prompts: list[str], tally: FlopTally, stream: ScoreStream | None = None
    ) -> ScoredBatch:
        """Decode x_T [b, ...] and score the images, through ``stream`` when a group-wise reward holds samples for
        their group (``lean.rewards.scorer.ScoreStream``); a reward server's failure is returned with the images.
        Under sequence parallelism with ``parallel.split_decode`` (no group-wise reward), this process's share of the
        rows, the rewards then gathered over its group (``lean.run.async_scoring``)."""
        if self.world.sequence_parallel == 1 or not self.cfg.parallel.split_decode:
            return self._decode_and_score(final, prompts, tally, stream)
        rows = self.world.sequence_share(len(prompts))
        mine = self._decode_and_score(final[rows], prompts[rows], tally)
        every = self.world.gather_over_sequence_group((mine.rewards, mine.parts, mine.error))
        return merge_shares(mine, every)

    def _decode_and_score(
        self, final: Tensor, prompts: list[str], tally: FlopTally, stream: ScoreStream | None = None
    ) -> ScoredBatch:
        if not len(prompts):  # a split decode's empty share (fewer rows than processes)
            return ScoredBatch(final.new_empty(0), torch.zeros(0, dtype=torch.float64))
        start = time.perf_counter()
        with tally.region("decode"):
            images = self.policy.decode(final)
            # the soundtrack only where a reward reads it (and the family makes one: Policy.decode_audio)
            audio = self.policy.decode_audio(final) if self.scorer.reads_audio else None
        synchronize(self.world.device)
        decode_s = time.perf_counter() - start
        try:
            if stream is None:
                rows, (rewards, parts) = None, self.reward(images, prompts, audio)
            else:  # the rows whose every reward is known: a group-wise reward's complete groups
                rows, rewards, parts = stream(images, prompts, audio)
        except RewardServerError as err:
            return ScoredBatch(images, error=err, decode_s=decode_s)
        return ScoredBatch(images, rewards, parts, rows, decode_s=decode_s)

    def scoring(self, ctx: IterationContext, batch: LocalBatch) -> RolloutScoring:
        """How the rollout's micro-batches are scored (``lean.run.async_scoring``): in a worker thread while the next
        rolls out (``reward.async_scoring``, with more than one micro-batch, and while no FLOPs are counted: the counter
        sees only its own thread), else after the rollout, in this thread."""
        micro_batches = -(-len(batch.prompts) // self.cfg.train.rollout_batch_size)
        concurrent = self.cfg.reward.async_scoring and micro_batches > 1 and not ctx.tally.counting
        worker = self.score_worker if concurrent else None  # the rewards are built (a model loads) before it runs
        stream = self.scorer.stream(batch.local_group_ids()) if self.scorer.groupwise else None
        return RolloutScoring(lambda final, prompts: self.decode_and_score(final, prompts, ctx.tally, stream), worker)

    def score(self, ctx: IterationContext, final: Tensor, prompts: list[str], scoring: RolloutScoring) -> tuple:
        """The rewards of the micro-batches ``scoring`` was handed: (total float64 [B_local], each reward's component).
        The ``reward`` phase is the scoring work, ``reward_exposed`` what of it the iteration waited for (all of it
        when scored after the rollout). When a reward server fails, the batch is kept under :attr:`failed_rollouts`
        (:meth:`keep_failed_rollout`) before the error propagates."""
        with ctx.timer("reward_exposed"):
            scored = scoring.collect()
        ctx.timer.seconds["reward"] += scored.busy_s
        ctx.timer.seconds["decode"] += scored.decode_s
        if scored.error is not None:
            self.keep_failed_rollout(ctx.iteration, final, scored.images, prompts, scored.error)
            raise scored.error
        return scored.rewards, scored.parts

    def keep_failed_rollout(
        self, iteration: int, final: Tensor, images: Tensor, prompts: list[str], err: Exception
    ) -> None:
        """``<failed_rollouts>/<iteration>[.rank<r>].safetensors`` (``latents`` x_T, ``images`` in [0, 1]) and a
        ``.json`` beside it (iteration, rank, prompts, their metadata records if any, the error), so the batch can be
        re-scored (docs/rewards.md)."""
        if self.failed_rollouts is None:
            return
        stem = f"{iteration}" + (f".rank{self.world.rank}" if self.world.size > 1 else "")
        self.failed_rollouts.mkdir(parents=True, exist_ok=True)
        save_file(
            {"latents": final.detach().cpu().contiguous(), "images": images.detach().cpu().contiguous()},
            self.failed_rollouts / f"{stem}.safetensors",
        )
        meta = {"iteration": iteration, "rank": self.world.rank, "prompts": list(prompts), "error": str(err)}
        if any(prompt_metadata(p) is not None for p in prompts):  # GenEval's records, for `lean reward score`
            meta["metadata"] = [prompt_metadata(p) for p in prompts]
        (self.failed_rollouts / f"{stem}.json").write_text(json.dumps(meta, indent=1))

    def advantages(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """(every sample's reward [N] on the host, this process's advantages [B_local] on the device), float64.

        Rewards are host values (they come from decoded pixels), so the group statistics are computed on the host
        once all ranks' rewards are gathered (a collective of device tensors); the local share goes back to the
        device for the loss. The units finished during the rollout (group and shared layouts) keep the advantages they
        were finished with, and only the rows after them (a last unit shorter than the others; the shared layout's
        waves after a failed one) take the whole batch's targets here. When nothing finished early, the targets need
        the whole batch: a group may
        straddle processes (slice layout), ``algorithm.global_std`` takes every reward's std. Each reward's values
        are gathered too where the targets read them (``algorithm.reward_combination``). Where the algorithm weighs
        each sample's regulariser after the rewards (GARDO's gate), its local factors go to
        ``rollout.ctx.kl_factors``."""
        batch, finished = rollout.batch, rollout.finished
        with rollout.ctx.timer("advantage"):
            rewards = self.world.gather(rollout.rewards.to(self.world.device)).cpu()
            parts = self.reward_components(rollout.parts)
            if finished is None:
                targets, every = self.batch_targets(batch, rewards, parts)
                factors = self.algorithm.regulariser_factors(targets, rewards, batch.group_ids(), every)
                if factors is not None:  # each sample's KL weight, known now (GARDO's gate)
                    rollout.ctx.kl_factors = factors[batch.local].to(self.world.device)
                advantages = targets[batch.local]
            else:
                if self.algorithm.weighs_regulariser:  # its factors are the whole batch's: batch_wide, never here
                    raise ValueError(f"algorithm {self.cfg.algorithm.name} finishes no unit before the whole batch")
                advantages, rest = finished.advantages.clone(), slice(finished.rows, len(batch.prompts))
                if rest.start < rest.stop:  # the same rows on every rank: a last shorter unit, or after a failure
                    advantages[rest] = self.batch_targets(batch, rewards, parts)[0][batch.local][rest]
        if not torch.isfinite(rewards).all():
            bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
            raise NonFiniteError(f"non-finite reward of samples {bad} at iteration {batch.iteration}")
        return rewards, advantages.to(self.world.device)

    def batch_targets(self, batch: LocalBatch, rewards: Tensor, parts: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The algorithm's targets of the whole batch [N] from every rank's ``rewards`` [N] (host, float64), and the
        components they read, gathered here from this rank's ``parts`` [B_local, C] (None where it reads none)."""
        every = None if parts is None else self.world.gather(parts.to(self.world.device)).cpu()
        return self.algorithm.targets(rewards, batch.group_ids(), every), every

    def reward_components(self, parts: dict[str, Tensor]) -> Tensor | None:
        """Each reward's values [B, R] (float64, columns in ``reward.weights`` order) where the algorithm's targets
        read them, else None."""
        if not self.algorithm.reads_reward_components:
            return None
        return torch.stack([parts[name].to(torch.float64) for name in self.cfg.reward.weights], dim=1)

    def finish(self, rollout: Rollout, advantages: Tensor, optimizer_step: OptimizerStep) -> dict:
        """The schedule's update from this process's advantages; it calls ``optimizer_step`` once per update."""
        with rollout.ctx.timer("update"):
            stats = rollout.schedule.finish(advantages, optimizer_step)
        for key in ("policy_loss", "kl"):
            if key in stats and not math.isfinite(stats[key]):
                raise NonFiniteError(f"non-finite {key} at iteration {rollout.batch.iteration}")
        return stats

    def end_iteration(self, iteration: int, stats: dict) -> None:
        """The algorithm's look at the update it asked for (``Algorithm.feedback``: GARDO's KL, which decides its
        reference's reset), averaged over processes so that every process decides alike."""
        keys = self.algorithm.feedback
        if not keys:
            return
        values = torch.tensor([stats.get(k, math.nan) for k in keys], dtype=torch.float64, device=self.world.device)
        self.world.all_reduce_mean_(values)
        self.algorithm.end_iteration(iteration, dict(zip(keys, values.tolist())))

    # ------------------------------------------------------------ compositions

    def roll_out(
        self,
        iteration: int,
        make_schedule: Callable[[IterationContext], Schedule],
        *,
        timer: PhaseTimer | None = None,
        tally: FlopTally | None = None,
        on_step: Callable[[Transition], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Rollout:
        """The first half of an iteration: local batch -> embed -> for each finishing unit: roll it out, score it
        (each micro-batch as it finishes), finish it (group layout: :meth:`finish_unit`) -> the rewards."""
        self.refresh_snapshot(iteration)
        batch = self.local_batch(iteration)
        ctx = self.context(batch, self.embed(batch), timer, tally)
        schedule = make_schedule(ctx)
        scoring, finite = self.scoring(ctx, batch), FiniteLogProbs(on_step)

        def finished_micro_batch(rows: slice, final: Tensor) -> None:  # scored beside the next micro-batch's rollout
            schedule.on_finished(rows, final)
            scoring.submit(final, batch.prompts[rows])

        # a unit: whole groups in the group layout when the schedule finishes early, else the whole local batch
        units = finishing_units(len(batch.prompts), ctx.finish_unit if schedule.finishes_early else None)
        # the targets' shape: one per sample, or on a tree one per edge on the [B, num_steps] grid (lean.sampling.tree)
        shape = (len(batch.prompts),) if tree_shape(self.cfg.sample) is None else tuple(ctx.steps.trained.shape)
        finished, finals = FinishedUnits(torch.zeros(shape, dtype=torch.float64)), []
        hooks = {"on_step": finite, "progress": progress, "on_finished": finished_micro_batch}
        try:
            for rows, early in units:
                finals.append(self.rollout(batch, ctx, schedule, rows=rows, **hooks))
                if early:
                    self.finish_unit(ctx, batch, schedule, scoring, rows, finished)
            finite.check(iteration)
        except BaseException:
            scoring.cancel()
            raise
        final = torch.cat(finals)
        rewards, parts = self.score(ctx, final, batch.prompts, scoring)
        return Rollout(batch, ctx, schedule, final, rewards, parts, finished if finished.rows else None)

    def finish_unit(
        self,
        ctx: IterationContext,
        batch: LocalBatch,
        schedule: Schedule,
        scoring: RolloutScoring,
        rows: slice,
        finished: FinishedUnits,
    ) -> None:
        """Group layout: the unit ``rows`` (whole groups) is rolled out. What needs no advantage runs beside its
        scoring (``schedule.unit_rolled_out``: Retain's backward with a provisional advantage); then its rewards are
        awaited, its advantages computed, once (a group's depend on its own rewards only: the whole batch's targets
        at these rows), and the schedule finishes its rows before the next unit rolls out. A failed reward finishes
        nothing: the rollout goes on and :meth:`score` keeps it and raises after it."""
        with ctx.timer("update"):
            schedule.unit_rolled_out(rows)
        with ctx.timer("reward_exposed"):
            scored = scoring.rewards()  # rows [0, rows.stop)
        if wave_gathered(resolve_layout(self.cfg, self.world.data_size)):  # a collective: every rank joins it
            with ctx.timer("advantage"):
                targets = self.wave_targets(batch, rows, scored)
            if targets is None or finished.stopped:  # a rank's rewards failed: the rest finishes after the rollout
                finished.stopped = True
                return
            finished.advantages[rows] = targets
        elif scored is None:
            return
        else:
            with ctx.timer("advantage"):
                rewards, parts = scored[0][rows], self.reward_components(scored[1])
                own = None if parts is None else parts[rows]
                finished.advantages[rows] = self.algorithm.targets(rewards, batch.local_group_ids()[rows], own)
        with ctx.timer("update"):
            schedule.finish_rows(rows, finished.advantages.to(self.world.device))
        finished.rows = rows.stop

    def wave_targets(self, batch: LocalBatch, rows: slice, scored: tuple | None) -> Tensor | None:
        """Shared layout: the targets of this rank's wave ``rows`` (Q rows, the same rows on every rank) from
        ``scored`` (its rewards and components so far; None: they failed). The wave's rewards [Q] (and components
        [Q, C]) are all-gathered rank-major [W Q]: rank d's rows of the wave are the global positions d L + rows (L the
        local batch), so every group of the wave is whole. Every rank computes the wave's targets and keeps its own
        Q; None on every rank when any rank's rewards failed or are not finite (then nothing more finishes early)."""
        q = rows.stop - rows.start
        if scored is None:
            rewards, parts = torch.full((q,), torch.nan, dtype=torch.float64), None
        else:
            rewards, parts = scored[0][rows], self.reward_components(scored[1])
        gathered = self.world.gather(rewards.to(self.world.device, torch.float64)).cpu()
        if not torch.isfinite(gathered).all():
            return None
        every = None if parts is None else self.world.gather(parts[rows].to(self.world.device)).cpu()
        local = len(batch.prompts)
        at = torch.cat([torch.arange(rows.start, rows.stop) + d * local for d in range(self.world.data_size)])
        targets = self.algorithm.targets(gathered, batch.group_ids()[at], every)
        mine = self.world.data_rank * q
        return targets[mine : mine + q]

    def run(
        self,
        iteration: int,
        schedule: str,
        optimizer_step: OptimizerStep,
        *,
        tally: FlopTally | None = None,
        progress: Callable[[int], None] | None = None,
        measure_memory: bool = True,
        trace: MemoryTrace | None = None,
    ) -> IterationResult:
        """One whole iteration with the named schedule: local batch -> embed -> for each finishing unit: roll out,
        score, finish it (:meth:`roll_out`) -> advantages -> the rest of finish, which calls ``optimizer_step``.
        Its peak memory is measured if ``measure_memory``, by ``trace`` when given (which records the curve through
        the rollout and the update too: ``lean.observe.memory_trace``)."""
        timer = PhaseTimer(self.world.device)
        cpu = time.process_time()  # every thread's: beside wall time, what the iteration cost the machine
        memory = trace if trace is not None else PeakMemory(self.world.device, enabled=measure_memory)
        with memory, timer("iteration"):
            make_schedule = schedule_class(schedule, self.algorithm)
            on_step = None if trace is None else trace.on_step
            rolled = self.roll_out(
                iteration, make_schedule, timer=timer, tally=tally, on_step=on_step, progress=progress
            )
            if trace is not None:
                trace.end_rollout()
                optimizer_step = trace.optimizer_step(optimizer_step)
            rewards, advantages = self.advantages(rolled)  # every rank's rewards; the finished units' advantages kept
            stats = self.finish(rolled, advantages, optimizer_step)  # the rest of finish -> the optimizer step(s)
            self.end_iteration(iteration, stats)
        metrics = {
            "iteration": iteration,
            "schedule": schedule,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std(unbiased=False).item(),
            **{
                f"reward_{k}": self.world.gather(v.to(self.world.device, torch.float64)).mean().item()
                for k, v in rolled.parts.items()
            },
            **{f"time_{k}_s": v for k, v in timer.seconds.items()},
            "cpu_iteration_s": time.process_time() - cpu,
            "peak_memory_mb": memory.peak_mb,
            "peak_memory_delta_mb": memory.delta_mb,
            **stats,
        }
        return IterationResult(metrics, rolled.final, rewards)


class UnitHooks:
    """The rollout's hooks for one finishing unit, rolled out on its own: ``lean.sampling.rollout`` numbers its rows
    from 0, the schedule and the callers see rows of the local batch (``rows.start`` on)."""

    def __init__(
        self,
        rows: slice,
        schedule: Schedule,
        on_step: Callable[[Transition], None] | None,
        on_finished: Callable[[slice, Tensor], None] | None,
    ):
        self.rows, self.schedule, self.then, self.finished = rows, schedule, on_step, on_finished

    def on_step(self, step: Transition) -> None:
        """``on_step`` (a check or a recorder), then the schedule."""
        step = dataclasses.replace(step, rows=local_rows(self.rows.start, step.rows))
        if self.then is not None:
            self.then(step)
        self.schedule.on_step(step)

    def rows_tracked(self, i: int) -> Tensor | None:
        tracked = self.schedule.rows_tracked(i)
        return None if tracked is None else tracked[self.rows]

    def on_finished(self, rows: slice, final: Tensor) -> None:
        if self.finished is not None:
            self.finished(local_rows(self.rows.start, rows), final)


class FiniteLogProbs:
    """An ``on_step`` hook: whether every step's log-probs are finite, kept on the device and read once after the
    rollout (:meth:`check`); ``then`` (a check or a recorder) sees every step after it."""

    def __init__(self, then: Callable[[Transition], None] | None = None):
        self.then = then
        self.finite: dict[int, Tensor] = {}  # step -> all its log-probs so far are finite (a device bool)

    def __call__(self, step: Transition) -> None:
        ok = torch.isfinite(step.log_prob.detach()).all()
        self.finite[step.index] = self.finite[step.index] & ok if step.index in self.finite else ok
        if self.then is not None:
            self.then(step)

    def check(self, iteration: int) -> None:
        if self.finite and not torch.stack(list(self.finite.values())).all():
            first = next(i for i, ok in self.finite.items() if not ok)
            raise NonFiniteError(f"non-finite log_prob at step {first} of iteration {iteration}")
