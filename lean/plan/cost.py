"""``lean plan``: predict each schedule's peak memory and time per iteration from one probed step, and choose for
``auto``.

The probe runs the first trained step of a real local batch and measures:
  * ``activation_mb``: bytes autograd saves for the backward of one tracked step at the rollout batch (counted with
    ``saved_tensors_hooks``, each storage once), and ``activation_one_mb`` at one trajectory;
  * ``backward_transient_mb``: the peak of one tracked step and its backward beyond its saved activations (the
    activation gradients in flight); ``decode_mb``: the VAE decoder's working set for one micro-batch; both
    from a trimmed heap (CPU) or the caching allocator's statistics (CUDA);
  * ``t_forward``: one untracked step; ``t_forward_backward``: one tracked step plus its backward, at both sizes;
    ``t_decode`` and ``t_reward``: decoding the probe batch and scoring it (every schedule pays them once per sample;
    on video they are the largest phase).
A schedule peaks either inside a backward or inside the decode, with whatever activations are alive then. Each
schedule's file states its own formula (``Schedule.predict`` over :class:`lean.schedules.IterationCosts`). A tree
rollout (``sample.tree``) is counted in rows (:func:`tree_rows`: node forwards, trained nodes, trained edges, leaves;
docs/design/tree-rollouts.md, section 4), and the probe runs at one rollout micro-batch of whole trees
(:func:`rollout_rows`).

Under several processes the probe runs as the run would (``parallel.shard=fsdp``: sharded, its passes gathering), and
the other shard setting is modelled from it (:func:`shard_variant`: what sharding moves,
``lean.parallel.sharding.ShardSizes``, and the all-gather speed timed on the processes, :func:`link_speed`).
:func:`combinations` tabulates every schedule x layout x shard x checkpointing.

``auto`` takes the schedule predicted fastest among those whose predicted peak fits ``train.memory_budget_mb``
(default: the device's memory); Recompute is among them, so it never takes a Lean schedule predicted slower than
Recompute. When none fits, it takes the one predicted smallest; it chooses among the schedules that run the config
exactly (``lean.schedules.runnable``). It logs the figures. With several optimizer steps per rollout, Retain and
Reweight are predicted as the hybrids they run (``lean.schedules.hybrid``). Retain is predicted at the run's
``train.retain`` (m of K steps kept, on the device or offloaded to host memory: ``Retain.predict``); the table adds its
rows of other (m, offload) (:func:`retain_variants`), and where a ``train.retain`` key is ``auto``, ``auto`` weighs
every (m, offload) it allows and sets the keys (:func:`exact_predictions`, :func:`retain_choice`; a row or choice
fits only if its pinned host memory fits the host budget too). The published sizes
are not built on a CPU: ``lean plan`` then reports the transformer's parameters and the memory its weights,
trainable parameters and AdamW moments take, counted on the meta device (:func:`published_size`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lean.algorithms import ALGORITHMS, CLEAN_SAMPLES, ROLLOUT_STEPS, build_algorithm
from lean.config.dtypes import DTYPES, master_dtype
from lean.configure import shared_layout_problem
from lean.models.build import lora_config
from lean.models.footprint import meta_transformer
from lean.models.registry import family_spec
from lean.models.spec import is_published
from lean.observe.metrics import PeakMemory, SavedBytes, device_memory_mb, live_bytes_heap, median
from lean.observe.outputs import write_json
from lean.parallel.distributed import World, init_world
from lean.parallel.grad_sync import PER_BACKWARD, PER_UPDATE, resolve_grad_sync
from lean.parallel.layout import (
    GROUP,
    LAYOUTS,
    SHARED,
    finish_unit,
    group_layout_problem,
    resolve_layout,
)
from lean.parallel.sharding import FSDP, HSDP, SHARDS, ShardSizes, planned_shard, shard_sizes
from lean.run.iteration import IterationPipeline, LocalBatch, build_pipeline
from lean.sampling.rollout import Sampler, policy_step
from lean.sampling.sde import StepSelection, rollout_sigmas
from lean.sampling.transition import Transition
from lean.sampling.tree import tree_shape
from lean.schedules import (
    AUTO,
    LEAN_SCHEDULES,
    RETAIN,
    SCHEDULES,
    IterationCosts,
    Prediction,
    RowCounts,
    algorithm_problem,
    algorithm_schedules,
    fsdp_problem,
    runnable,
    schedule_problem,
    whole_gradient_buffers,
    with_schedule,
)
from lean.schedules.edge_updates import edges_per_update
from lean.schedules.per_sample import linear_owners
from lean.schedules.recompute import first_update_rows
from lean.schedules.retain import ALL_STEPS, DEVICE, HOST, OFFLOADS, Retain
from lean.schedules.retain import host_budget_mb as retain_host_budget_mb

if TYPE_CHECKING:
    from lean.config import RunConfig
    from lean.models.policy import Policy


@dataclass(frozen=True)
class PlanInput:
    """What the prediction needs of a run: the policy and its trainable parameters, the run config, the sigma grid,
    and one process's local batch (of iteration 0)."""

    policy: Policy
    trainable: list[torch.nn.Parameter]
    cfg: RunConfig
    sigmas: torch.Tensor
    batch: LocalBatch
    reward: Callable[[torch.Tensor, list[str]], object]  # decoded images, prompts -> scores (the run's rewards)
    world_size: int = 1  # data-parallel ranks (processes / parallel.sequence_parallel)
    decode_share: int = 1  # processes that split each micro-batch's decode and rewards (parallel.split_decode)
    processes: int = 1  # all of them: what parallel.shard=fsdp shards over (lean.parallel.sharding)

    def decoded_rows(self, rows: int) -> int:
        """Of a micro-batch of ``rows``, the most one process decodes and scores."""
        return -(-rows // self.decode_share)


def plan_input(pipeline: IterationPipeline) -> PlanInput:
    """A run's :class:`PlanInput`: its policy and trainable parameters, config, sigma grid, rewards, and a fresh
    local batch of iteration 0."""
    trainable = [p for _, p in pipeline.policy.trainable_parameters()]
    return PlanInput(
        pipeline.policy,
        trainable,
        pipeline.cfg,
        pipeline.sigmas,
        pipeline.local_batch(0),
        pipeline.reward,
        pipeline.world.data_size,
        pipeline.world.sequence_parallel if pipeline.cfg.parallel.split_decode else 1,
        pipeline.world.size,
    )


def _timed(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` discarded ones (first calls at a new shape pay
    one-time set-up: kernel selection, allocator growth)."""
    times = []
    for _ in range(warmup):
        fn()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times)


TERMS = {ROLLOUT_STEPS: "trained", CLEAN_SAMPLES: "re-noised draws"}  # per sample, by what the algorithm trains on


def probe(inp: PlanInput) -> dict:
    """Measure one step of the policy at the local rollout batch and at one trajectory."""
    policy, cfg = inp.policy, inp.cfg
    batch = rollout_rows(cfg, len(inp.batch.prompts))
    emb = policy.encode_prompts(inp.batch.prompts[:batch])
    gens = inp.batch.generators[:batch]
    x = policy.init_latents(gens)
    index = torch.zeros(batch, dtype=torch.long)

    def step(rows: slice, grad: bool = False, backward: bool = False):
        def run():
            with torch.set_grad_enabled(grad or backward):
                at = Transition(index=index[rows], rows=rows, sample=x[rows])
                out = policy_step(policy, Sampler(cfg.sample, inp.sigmas), at, emb.index(rows), generators=gens[rows])
            if backward:
                out.log_prob.sum().backward()

        return run

    full, one = slice(0, batch), slice(0, 1)
    with live_bytes_heap():
        with PeakMemory(policy.device) as tracked:  # one tracked step and its backward, from a trimmed heap
            step(full, backward=True)()
        with PeakMemory(policy.device) as decoding:
            images = policy.decode(x[: inp.decoded_rows(batch)])
    saved = SavedBytes()
    with saved.watching():
        step(full, grad=True)()
        activation, moved = saved.take_split()
        step(one, grad=True)()
        activation_one = saved.take()
    result = {
        "batch": batch,
        "activation_mb": activation / 2**20,
        "activation_moved_mb": moved / 2**20,  # what an offload of the kept graphs moves (parameters, leaves stay)
        "activation_one_mb": activation_one / 2**20,
        "t_forward": _timed(step(full)),
        "t_forward_backward": _timed(step(full, backward=True)),
        "t_forward_backward_one": _timed(step(one, backward=True)),
        # after a discarded decode: the memory pass's blocks went back to the kernel on free (live_bytes_heap), so
        # its pages are not warm; a split decode: this process's share of the micro-batch
        "t_decode": _timed(lambda: policy.decode(x[: len(images)]), repeats=1, warmup=1),
        "t_reward": _timed(lambda: inp.reward(images, inp.batch.prompts[: len(images)]), repeats=1),
        "param_mb": sum(p.numel() * p.element_size() for p in inp.trainable) / 2**20,
        "base_mb": tracked.start_mb,
    }
    # the gradient, its flat copy and AdamW's two moments (allocated at the first optimizer step, after the probe)
    result["optimizer_stage_mb"] = 4 * result["param_mb"]
    # What the backward needs beyond the saved activations (gradients of the activations in flight).
    result["backward_transient_mb"] = max(tracked.delta_mb - result["activation_mb"], 0.0)
    result["decode_mb"] = max(decoding.delta_mb, 0.0)  # the VAE's working set at the probe batch
    for p in inp.trainable:
        p.grad = None
    return result


def rollout_rows(cfg: RunConfig, local: int) -> int:
    """Rows of one rollout micro-batch of a process's ``local`` samples, which the probe measures: at most
    ``train.rollout_batch_size``, on a tree whole trees (``TreeShape.trees_per_micro_batch``: ``tree_rollout``'s,
    up to L nodes a step each, and decodes their leaves together)."""
    m, shape = cfg.train.rollout_batch_size, tree_shape(cfg.sample)
    if shape is not None:
        m = shape.trees_per_micro_batch(m) * shape.leaves
    return min(local, m)


def iteration_costs(
    inp: PlanInput,
    measured: dict,
    layout: str | None = None,
    link_mb_s: float = float("inf"),
    host_budget_mb: float = float("inf"),
) -> IterationCosts:
    """The probe's figures scaled to one process's whole iteration (see :class:`IterationCosts`), in the run's
    layout or in ``layout`` (``lean.parallel.layout``). Retain's kept share and offload are the run's
    (``train.retain``; ``auto`` counts as all steps, on the device: :func:`retain_variants` tries the others); the
    host link and host budget are ``train.retain``'s where set, else ``link_mb_s`` and ``host_budget_mb``."""
    cfg, laid_out = inp.cfg, inp.cfg if layout is None else with_layout(inp.cfg, layout)
    local, probed = len(inp.batch.prompts), measured["batch"]
    rounds = -(-local // probed)  # rollout micro-batches per step
    f = measured["t_forward"] * rounds
    algorithm = build_algorithm(cfg, None)  # its terms: GRPO's trained steps, NFT's and DPO's re-noised draws
    k = algorithm.terms_per_sample or int(inp.batch.steps.trained[0].sum())
    rows = tree_rows(cfg, inp.batch.steps, local)  # None: flat, B n forwards and B K terms
    terms = k if rows is None else rows.trained_edges / local  # per sample; on a tree each trained edge is a term
    share = algorithm.trained_share
    fb = measured["t_forward_backward"] * rounds
    # the re-noised terms are conditional only: the probed step's CFG half (the unconditional forward) is not theirs
    f_cfg = f / 2 if cfg.sample.cfg and algorithm.trains_on == CLEAN_SAMPLES else 0.0
    unit = finish_unit(laid_out, inp.world_size) or local  # trajectories held at once (group layout: one unit)
    # Each rollout micro-batch is decoded and scored on its own (the decoder holds one at a time); with
    # reward.async_scoring while the next rolls out (lean.run.async_scoring), so a unit waits for its last one's only.
    # The group layout waits at the end of every unit (its graphs are freed before the next group rolls out).
    concurrent = cfg.reward.async_scoring and rounds > 1
    waited_for = -(-local // unit) * (min(probed, unit) if concurrent else unit)
    return IterationCosts(
        n=len(rollout_sigmas(inp.sigmas, inp.batch.steps.stochastic.tolist(), cfg.sample)) - 1,  # Flash: fewer
        k=k,
        local=local,
        f=f,
        fb=(fb - f_cfg) * share,
        fb_one=measured["t_forward_backward_one"],
        ref=terms * (f - f_cfg) * share * algorithm.untracked_forwards_per_term,
        score=(measured["t_decode"] + measured["t_reward"]) * waited_for / probed,
        score_at_end=(measured["t_decode"] + measured["t_reward"])
        * (min(probed, local) if concurrent else local)
        / probed,
        **memory_terms(measured, rounds),
        train_rows_fraction=min(cfg.train.train_batch_size, local) / max(probed * rounds, 1),
        kl=bool(algorithm.kl_weight),
        per_row_grads=linear_owners(inp.policy, inp.trainable) is not None,
        held_fraction=unit / local,
        # N, and the KL terms' weights, known before the rewards (else Reweight keeps a KL buffer per trajectory)
        n_known=not cfg.algorithm.skip_zero_advantage and not algorithm.weighs_regulariser,
        first_share=first_share(cfg, inp.batch.steps, local),
        epochs=cfg.train.num_inner_epochs,
        **retain_terms(cfg, measured, k, min(probed, unit) / probed, link_mb_s, host_budget_mb),
        rows=rows,
    )


def memory_terms(measured: dict, rounds: int) -> dict:
    """:class:`IterationCosts`'s memory terms (MiB) from the probe's, a tracked step's at ``rounds`` rollout
    micro-batches."""
    return {
        "base_mb": measured["base_mb"],
        "act_mb": measured["activation_mb"] * rounds,
        "act_one_mb": measured["activation_one_mb"],
        "act_micro_mb": measured["activation_mb"],
        "act_moved_mb": measured.get("activation_moved_mb", measured["activation_mb"]) * rounds,
        "transient_mb": measured["backward_transient_mb"],
        "decode_mb": measured["decode_mb"],
        "trainable_mb": measured["param_mb"],
        "optimizer_stage_mb": measured.get("optimizer_stage_mb", 0.0),
    }


def first_share(cfg: RunConfig, steps: StepSelection, local: int) -> float:
    """s, the first update's share of what the iteration trains: |C_1| / B of the local samples, or on a tree with
    ``train.edges_per_update`` = G, min(G, E) / E of its E trained edges (``lean.schedules.edge_updates``)."""
    if (size := edges_per_update(cfg)) is not None:
        edges = max(int(steps.trained.sum()), 1)
        return min(size, edges) / edges
    first = first_update_rows(cfg, 0, local)
    return 1.0 if first is None else len(first) / local


def tree_rows(cfg: RunConfig, steps: StepSelection, local: int) -> RowCounts | None:
    """A tree rollout's :class:`RowCounts` over ``local`` leaves, counted as the code runs them (None: a flat rollout):
    ``tree_rollout`` runs every node of a step tracked where the step trains (one kept graph per node under Retain),
    and each trained edge sits on one trained cell of ``steps.trained`` (``lean.run.iteration.on_tree``), which
    Recompute's update recomputes on its own (``recompute_terms``: every local row of a trained step in lockstep)."""
    shape = tree_shape(cfg.sample)
    if shape is None:
        return None
    tracked = steps.grad_steps.cpu()
    edges = int(steps.trained.sum()) if steps.shared_grad_steps is None else local * int(tracked.sum())
    trees = local // shape.leaves
    return RowCounts(
        forwards=trees * shape.forwards,
        trained_forwards=trees * sum(shape.live(i) for i in range(shape.num_steps) if tracked[i]),
        trained_edges=edges,
        leaves=local,
    )


def retain_terms(cfg: RunConfig, measured: dict, k: int, group_share: float, link_mb_s: float, host_mb: float) -> dict:
    """:class:`IterationCosts`'s Retain terms: the run's kept share q = m / K and offload, one offload group (a
    tracked step's moved bytes at one rollout micro-batch, ``group_share`` of it held), the link and host budget
    (``train.retain``'s where set, else ``link_mb_s`` and ``host_mb``)."""
    r = cfg.train.retain
    return {
        "retained": min(r.steps, k) / k if isinstance(r.steps, int) else 1.0,
        "offload": r.offload == HOST,
        "act_group_mb": measured.get("activation_moved_mb", measured["activation_mb"]) * group_share,
        "link_mb_s": r.host_link_gb_s * 1e9 / 2**20 if r.host_link_gb_s else link_mb_s,
        "host_budget_mb": r.host_memory_budget_mb or host_mb,
    }


def applicable_layouts(inp: PlanInput) -> list[str]:
    """The layouts this run can take (``lean.parallel.layout``): slice always; group where it holds the run; shared on
    more than one data-parallel rank where it can split the prompts (on one it is the group layout, finishing prompt
    by prompt)."""
    problems = {
        AUTO: "not a layout",
        GROUP: group_layout_problem(inp.cfg.train, inp.world_size),
        SHARED: "one rank" if inp.world_size == 1 else shared_layout_problem(inp.cfg),
    }
    return [name for name in LAYOUTS if problems.get(name) is None]


def probe_checkpointing(inp: PlanInput, measure: Callable[[PlanInput], dict] = probe) -> dict[bool, dict]:
    """``measure`` (:func:`probe`, or ``lean.plan.meta``'s count) with activation checkpointing
    (``model.gradient_checkpointing``) off and on; the run's own setting is probed first and restored."""
    own = inp.cfg.model.gradient_checkpointing
    measured = {}
    for on in (own, not own):
        inp.policy.set_gradient_checkpointing(on)
        measured[on] = measure(inp)
    inp.policy.set_gradient_checkpointing(own)
    measured[not own]["base_mb"] = measured[own]["base_mb"]  # resident weights: the second probe's start has more
    return measured


def link_speed(world, mb: float) -> float:
    """MiB/s at which an all-gather of ``mb`` MiB (the whole tensor, 1/W from each process) completes, as
    ``mb (W - 1) / W / seconds``: the median of 3 timed all-gathers on the run's processes (a collective)."""
    if world.size < 2:
        return float("inf")
    size = max(int(mb * 2**20) // 4 // world.size, 1)
    shard = torch.zeros(size, device=world.device)
    gathered = torch.empty(size * world.size, device=world.device)
    seconds = _timed(lambda: torch.distributed.all_gather_into_tensor(gathered, shard), repeats=3)
    return size * 4 * (world.size - 1) / 2**20 / max(seconds, 1e-9)


def shard_variant(
    measured: dict, sizes: ShardSizes, world_size: int, shard: str, probed: str, link_mb_s: float, overlap: bool
) -> dict:
    """The probe's figures under ``parallel.shard=shard`` from figures measured (or counted) under ``probed``.

    Memory: a process holds ``sizes.resident_saved(W)`` MiB less under fsdp (1 - 1/W of the sharded weights and
    state, plus the gathered units). Time: every pass gathers the net's sharded weights once (a forward; a backward
    gathers them again, and under full fine-tuning reduce-scatters their gradients), c = MiB (W - 1) / W / link
    each. Measured on gloo, where the collectives share the CPU with the compute, the pass takes t + c; with
    ``overlap`` (NCCL: FSDP prefetches the next unit while one computes) max(t, c).

    Under ``parallel.grad_sync=per_update`` a sharded full fine-tune's backwards do not reduce-scatter: the figures
    also carry the backwards without it (``coalesced_`` + key) and the one reduce-scatter of the accumulated gradient
    per update, after the last backward (``t_reduce_scatter_update``, exposed): :func:`coalesced`."""
    if shard == probed or world_size < 2:
        return measured
    sign = 1 if shard == FSDP else -1
    spread = (1 - 1 / world_size) / link_mb_s
    gather, reduce = sizes.net * spread, sizes.state / 3 * spread

    def passed(t: float, comm: float) -> float:
        if sign < 0:
            return max(t - comm, 0.0)
        return max(t, comm) if overlap else t + comm

    backward_comm = 2 * gather + reduce
    variant = {
        **measured,
        "base_mb": measured["base_mb"] - sign * sizes.resident_saved(world_size),
        "backward_transient_mb": max(measured["backward_transient_mb"] - sign * sizes.gradient_saved(world_size), 0.0),
        # the optimizer stage's gradient and temporaries: 1/W of them a process under fsdp, which holds no gathered
        # unit while the optimizer steps (each is resharded after its backward)
        "optimizer_stage_mb": measured.get("optimizer_stage_mb", 0.0) * world_size ** (-sign) - sign * sizes.gathered,
        "t_forward": passed(measured["t_forward"], gather),
        **{k: passed(measured[k], backward_comm) for k in BACKWARD_TIMES},
    }
    if sign > 0 and reduce > 0:
        variant.update({COALESCED + k: passed(measured[k], 2 * gather) for k in BACKWARD_TIMES})
        variant["t_reduce_scatter_update"] = reduce
    return variant


SYNCS = (PER_BACKWARD, PER_UPDATE)  # what a row's parallel.grad_sync resolves to
BACKWARD_TIMES = ("t_forward_backward", "t_forward_backward_one")  # the probe's times that include a backward
COALESCED = "coalesced_"  # their prefix without a reduce-scatter per backward (shard_variant)


def coalesced(measured: dict) -> dict:
    """A sharded full fine-tune's figures under ``parallel.grad_sync=per_update`` (:func:`shard_variant`'s
    ``coalesced_`` times in place of the per-backward ones); ``measured`` itself where they were not modelled."""
    if "t_reduce_scatter_update" not in measured:
        return measured
    return {**measured, **{k: measured[COALESCED + k] for k in BACKWARD_TIMES}}


def with_layout(cfg: RunConfig, layout: str) -> RunConfig:
    """``cfg`` with ``parallel.layout=layout``."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, layout=layout))


def as_row(cfg: RunConfig, schedule: str, shard: str, grad_sync: str | None = None) -> RunConfig:
    """``cfg`` with ``train.schedule=schedule``, ``parallel.shard=shard`` and (where given) ``parallel.grad_sync``:
    a plan row's run."""
    parallel = dataclasses.replace(cfg.parallel, shard=shard, grad_sync=grad_sync or cfg.parallel.grad_sync)
    return dataclasses.replace(with_schedule(cfg, schedule), parallel=parallel)


def row_grad_sync(cfg: RunConfig, schedule: str, shard: str) -> str:
    """The ``parallel.grad_sync`` a row runs: the config's, resolved (``auto``: per_backward under a sharded full
    fine-tune, FSDP2's reduce-scatter per backward); where ``auto`` would refuse the schedule's whole provisional
    gradients (Reweight under a sharded full fine-tune), per_update, the setting its refusal names."""
    row = as_row(cfg, schedule, shard)
    if cfg.parallel.grad_sync == AUTO and whole_gradient_buffers(row, schedule):
        return PER_UPDATE
    return resolve_grad_sync(row)


def shard_settings(inp: PlanInput) -> list[str]:
    """The ``parallel.shard`` settings a run of ``inp.processes`` processes can take (fsdp from two)."""
    return [name for name in SHARDS if name != HSDP and (name != FSDP or inp.processes > 1)]


def shard_probes(
    inp: PlanInput,
    by_checkpointing: dict[bool, dict],
    link_mb_s: float,
    overlap: bool = False,
    probed: str | None = None,
) -> dict[tuple[str, bool], dict]:
    """Probe figures for every (``parallel.shard``, checkpointing): those of ``probed`` (default: the run's own
    shard, as its processes ran the probe) as given, the other modelled (:func:`shard_variant`)."""
    sizes = shard_sizes(inp.policy)
    if probed is None:
        probed = planned_shard(inp.cfg.parallel.shard, inp.processes)
    return {
        (shard, on): shard_variant(measured, sizes, inp.processes, shard, probed, link_mb_s, overlap)
        for shard in shard_settings(inp)
        for on, measured in by_checkpointing.items()
    }


# the probe's memory terms a row carries beside its peak: resident weights and trainable state, one tracked step's
# activations at the micro-batch, a backward's working set beyond them, the decoder's working set
MEMORY_TERMS = ("base_mb", "activation_mb", "backward_transient_mb", "decode_mb")


def combinations(
    inp: PlanInput,
    probes: dict[tuple[str, bool], dict],
    budget_mb: float = float("inf"),
    link_mb_s: float = float("inf"),
    host_budget_mb: float = float("inf"),
) -> list[dict]:
    """Every schedule's predicted peak memory and time in every applicable layout, for every (shard,
    checkpointing) of ``probes`` (:func:`shard_probes`), each with the ``parallel.grad_sync`` it runs
    (:func:`row_grad_sync`); a schedule fsdp cannot run even so (``lean.schedules.fsdp_problem``) is left out of the
    fsdp rows. Retain has a row per :func:`retain_variants` (kept steps m x offload, against
    ``budget_mb`` and the host budget), each row with its ``retain_steps`` and ``offload`` (the other schedules: the
    defaults, which they require)."""
    rows, exact = [], algorithm_schedules(inp.cfg)  # the schedules that compute the algorithm's gradient
    links = {"link_mb_s": link_mb_s, "host_budget_mb": host_budget_mb}
    for layout in applicable_layouts(inp):
        for (shard, checkpointing), measured in sorted(
            probes.items(), key=lambda kv: (SHARDS.names.index(kv[0][0]), kv[0][1])
        ):
            by_sync = {sync: predicted_at_sync(inp, measured, layout, sync, **links) for sync in SYNCS}
            for schedule in SCHEDULES:
                sync = row_grad_sync(inp.cfg, schedule, shard)
                if schedule not in exact or (shard == FSDP and fsdp_problem(as_row(inp.cfg, schedule, shard, sync))):
                    continue
                costs, predictions, adjusted = by_sync[sync]
                p = adjusted(schedule, predictions[schedule])
                variants = [(ALL_STEPS, DEVICE, p)]  # the defaults, which the other schedules require
                if schedule == RETAIN:  # the run's own train.retain, then the others
                    variants = [(*own_retain(inp.cfg, costs.k), p)]
                    variants += [
                        (m, offload, adjusted(schedule, prediction))
                        for m, offload, prediction in retain_variants(costs, budget_mb)
                        if (m, offload) != variants[0][:2]
                    ]
                for steps, offload, prediction in variants:
                    rows.append(
                        {
                            "schedule": schedule,
                            "layout": layout,
                            "shard": shard,
                            "gradient_checkpointing": checkpointing,
                            "grad_sync": sync,
                            "steps_trained": costs.k,
                            "retain_steps": steps,
                            "offload": offload,
                            **vars(prediction),
                            "host_fits": prediction.host_mb <= costs.host_budget_mb,
                            **{term: measured[term] for term in MEMORY_TERMS},
                        }
                    )
    return rows


def predicted_at_sync(
    inp: PlanInput, measured: dict, layout: str, sync: str, link_mb_s: float, host_budget_mb: float
) -> tuple[IterationCosts, dict[str, Prediction], Callable[[str, Prediction], Prediction]]:
    """The costs of ``measured`` under ``parallel.grad_sync=sync``, every schedule's prediction from them, and how a
    schedule's prediction is adjusted for the sync. Under a sharded full fine-tune with per_update (:func:`coalesced`
    figures): one reduce-scatter per optimizer step added to the time, and for a schedule whose backwards accumulate
    in FSDP2 (not Reweight's, which takes each one's whole gradient into its buffers) the whole unsharded gradient
    FSDP2 holds between them."""
    if sync != PER_UPDATE or "t_reduce_scatter_update" not in measured:
        costs = iteration_costs(inp, measured, layout, link_mb_s, host_budget_mb)
        return costs, predict(costs), lambda name, p: p
    costs = iteration_costs(inp, coalesced(measured), layout, link_mb_s, host_budget_mb)
    t = inp.cfg.train
    seconds = t.optimizer_steps_per_iteration * t.num_inner_epochs * measured["t_reduce_scatter_update"]

    def adjusted(name: str, p: Prediction) -> Prediction:
        return at_sync(p, seconds, 0.0 if SCHEDULES[name].backward_in_rollout else costs.trainable_mb)

    return costs, predict(costs), adjusted


def at_sync(p: Prediction, seconds: float, held_mb: float) -> Prediction:
    """``p`` with ``seconds`` of exposed sync and ``held_mb`` more held through the iteration."""
    return dataclasses.replace(
        p,
        time_iteration_s=p.time_iteration_s + seconds,
        peak_memory_mb=p.peak_memory_mb + held_mb,
        held_mb=p.held_mb + held_mb,
    )


def own_retain(cfg: RunConfig, k: int) -> tuple[int | str, str]:
    """The run's ``train.retain`` as a row's (``retain_steps``, ``offload``) with K = ``k``: m >= K is ``all``, and
    an ``auto`` key counts as its default (as :func:`iteration_costs` predicts it)."""
    r = cfg.train.retain
    steps = r.steps if isinstance(r.steps, int) and r.steps < k else ALL_STEPS
    return steps, DEVICE if r.offload == AUTO else r.offload


def is_own_retain(row: dict, cfg: RunConfig) -> bool:
    """Whether a :func:`combinations` row is the run's own ``train.retain`` (every row of another schedule is)."""
    return row["schedule"] != RETAIN or (row["retain_steps"], row["offload"]) == own_retain(cfg, row["steps_trained"])


def retain_variants(c: IterationCosts, budget_mb: float) -> list[tuple[int | str, str, Prediction]]:
    """Retain's (m, offload, prediction) rows: for each offload (off, host), every trained step kept (m = K, shown as
    ``all``), and where that does not fit ``budget_mb`` and the host budget, the largest m < K that does (if any):
    four rows at most."""
    rows = []
    for offload in OFFLOADS:
        at = {
            m: Retain.predict(dataclasses.replace(c, retained=m / c.k, offload=offload == HOST))
            for m in range(1, c.k + 1)
        }
        rows.append((ALL_STEPS, offload, at[c.k]))
        if not fits(at[c.k], c, budget_mb):
            smaller = [m for m in range(c.k - 1, 0, -1) if fits(at[m], c, budget_mb)]
            if smaller:
                rows.append((smaller[0], offload, at[smaller[0]]))
    return rows


def fits(p: Prediction, c: IterationCosts, budget_mb: float) -> bool:
    """Whether ``p`` fits the device budget and (what it offloads) the host budget of ``c``."""
    return p.peak_memory_mb <= budget_mb and p.host_mb <= c.host_budget_mb


def offload_bytes(cfg: RunConfig, measured: dict | None = None) -> dict:
    """The plan's bytes that Retain's offload moves each way in one iteration of one process, for ``cfg`` at its
    ``train.retain`` (steps, offload forced to host) on this machine: ``{"d2h_bytes", "h2d_bytes", "host_bytes"}``
    (host: held at once), from :func:`probe` (or ``measured``, its figures). What ``tests`` compare with the
    offload hooks' ``stats.moved_bytes`` and ``fetched_bytes``."""
    pipeline = build_pipeline(cfg, World())
    inp = plan_input(pipeline)
    costs = dataclasses.replace(iteration_costs(inp, measured or probe(inp)), offload=True)
    p = Retain.predict(costs)
    return {"d2h_bytes": p.d2h_mb * 2**20, "h2d_bytes": p.h2d_mb * 2**20, "host_bytes": p.host_mb * 2**20}


def predict(costs: IterationCosts) -> dict[str, Prediction]:
    """Every registered schedule's prediction."""
    return {name: schedule.predict(costs) for name, schedule in SCHEDULES.items()}


def prediction_table(costs: IterationCosts) -> dict:
    """:func:`predict` as plain numbers (plan.json, bench, notebooks)."""
    return {"steps_trained": costs.k, **{name: vars(p) for name, p in predict(costs).items()}}


def choose(predictions: dict[str, Prediction], budget_mb: float, host_budget_mb: float = float("inf")) -> dict:
    """``auto``: the schedule predicted fastest among those predicted to fit ``budget_mb`` and (what they offload)
    ``host_budget_mb`` (the baseline is one of them: a Lean schedule predicted slower than it is never taken), else
    the one predicted smallest."""
    fitting = [s for s, p in predictions.items() if p.peak_memory_mb <= budget_mb and p.host_mb <= host_budget_mb]
    if fitting:
        choice = min(fitting, key=lambda s: predictions[s].time_iteration_s)
    else:
        choice = min(predictions, key=lambda s: predictions[s].peak_memory_mb)
    return {
        "choice": choice,
        "budget_mb": budget_mb,
        **{f"{s}_predicted_peak_mb": p.peak_memory_mb for s, p in predictions.items()},
        **{f"{s}_predicted_time_s": p.time_iteration_s for s, p in predictions.items()},
    }


def budget_mb(cfg: RunConfig, device: torch.device) -> float:
    return cfg.train.memory_budget_mb or device_memory_mb(device)


def host_budget_mb(cfg: RunConfig) -> float:
    """Pinned host memory one process may take for offloaded graphs: ``train.retain.host_memory_budget_mb``, else the
    available RAM x :data:`MEMORY_MARGIN` shared by the node's processes (``LOCAL_WORLD_SIZE``, torchrun's)."""
    budget = retain_host_budget_mb(cfg.train.retain)  # the rule the offload's arena enforces
    return float("inf") if budget is None else budget


def host_link_speeds(device: torch.device, mb: float = 256.0) -> dict[str, float]:
    """MiB/s of a pinned host copy of ``mb`` MiB each way on a CUDA ``device``, ``{"h2d", "d2h"}`` (the median of 3
    after one unmeasured copy); on a CPU the "host" is the same memory: no link (inf)."""
    if device.type != "cuda":
        return {"h2d": float("inf"), "d2h": float("inf")}
    host = torch.empty(int(mb * 2**20), dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty_like(host, device=device)
    return {
        "h2d": mb / max(_timed(lambda: on_device.copy_(host, non_blocking=True)), 1e-9),
        "d2h": mb / max(_timed(lambda: host.copy_(on_device, non_blocking=True)), 1e-9),
    }


def host_link_mb_s(device: torch.device, mb: float = 256.0) -> float:
    """The plan's link: the slower direction of :func:`host_link_speeds`."""
    return min(host_link_speeds(device, mb).values())


def decide(inp: PlanInput) -> dict:
    """Probe, predict and choose among the schedules that run the config exactly (``train.schedule: auto``, the budget
    check of an explicit Lean schedule, and ``train.retain``'s ``auto`` keys): ``choice`` is a schedule; for Retain
    (or ``auto`` keys) also ``retain_steps`` and ``retain_offload``, the keys' resolved values. With
    ``parallel.layout: auto`` every applicable layout is weighed too (:func:`choose_layout`): ``layout`` names the
    one taken."""
    cfg, device = inp.cfg, inp.policy.device
    link = host_link_mb_s(device) if cfg.train.retain.offload != DEVICE else float("inf")  # timed only where it matters
    measured, budget, host = probe(inp), budget_mb(cfg, device), host_budget_mb(cfg)
    layouts = applicable_layouts(inp) if cfg.parallel.layout == AUTO else [resolve_layout(cfg, inp.world_size)]
    by_layout = {}
    for layout in layouts:
        costs = iteration_costs(inp, measured, layout, link_mb_s=link, host_budget_mb=host)
        predictions = exact_predictions(with_layout(cfg, layout), costs)
        by_layout[layout] = (choose(predictions, budget, costs.host_budget_mb), predictions, costs.host_budget_mb)
    r = cfg.train.retain
    explicit = cfg.train.schedule if cfg.train.schedule != AUTO and AUTO not in (r.steps, r.offload) else None
    layout = choose_layout(by_layout, budget, explicit)
    decision = by_layout[layout][0]
    return {**decision, **retain_choice(decision["choice"], cfg), "layout": layout}


def choose_layout(
    by_layout: dict[str, tuple[dict, dict[str, Prediction], float]], budget_mb: float, schedule: str | None = None
) -> str:
    """``parallel.layout: auto``: of each layout's (:func:`choose` decision, predictions, host budget), the layout
    whose chosen schedule (or the run's explicit ``schedule``) is predicted fastest among those that fit (of equally
    fast ones, the smaller peak: the shared layout holds Q samples where the group layout holds G), else the one
    predicted smallest."""

    def taken(layout: str) -> Prediction:
        decision, predictions, _ = by_layout[layout]
        return predictions[schedule or decision["choice"]]

    def fits(layout: str) -> bool:
        p, host = taken(layout), by_layout[layout][2]
        return p.peak_memory_mb <= budget_mb and p.host_mb <= host

    fitting = [name for name in by_layout if fits(name)]
    if fitting:
        return min(fitting, key=lambda name: (round(taken(name).time_iteration_s, 6), taken(name).peak_memory_mb))
    return min(by_layout, key=lambda name: taken(name).peak_memory_mb)


def exact_predictions(cfg: RunConfig, costs: IterationCosts) -> dict[str, Prediction]:
    """:func:`predict` of the schedules that run ``cfg`` exactly (and of its own schedule): what ``auto`` weighs.
    Where ``train.retain.steps`` or ``offload`` is ``auto``, Retain's entry is one per (m, offload) they allow
    (:func:`retain_label`); with ``train.schedule=retain`` explicit, only those."""
    exact = {name: p for name, p in predict(costs).items() if name in runnable(cfg) or name == cfg.train.schedule}
    r = cfg.train.retain
    if RETAIN not in exact or AUTO not in (r.steps, r.offload):
        return exact
    del exact[RETAIN]
    if cfg.train.schedule == RETAIN:
        exact = {}
    k = costs.k
    for m in range(1, k + 1) if r.steps == AUTO else [k if r.steps == ALL_STEPS else min(r.steps, k)]:
        for offload in OFFLOADS if r.offload == AUTO else [r.offload]:
            variant = dataclasses.replace(costs, retained=m / k, offload=offload == HOST)
            exact[retain_label(ALL_STEPS if m == k else m, offload)] = Retain.predict(variant)
    return exact


RETAIN_LABEL = RETAIN + ":steps={steps}:offload={offload}"  # one Retain variant among auto's candidates


def retain_label(steps: int | str, offload: str) -> str:
    return RETAIN_LABEL.format(steps=steps, offload=offload)


def retain_choice(choice: str, cfg: RunConfig) -> dict:
    """``choice`` (a schedule, or a :func:`retain_label`) as ``{"choice": schedule}`` with, where ``train.retain``
    has an ``auto`` key, the keys' resolved values (the defaults when the choice is not Retain)."""
    r = cfg.train.retain
    if not choice.startswith(f"{RETAIN}:"):
        if AUTO in (r.steps, r.offload):
            return {"choice": choice, "retain_steps": ALL_STEPS, "retain_offload": DEVICE}
        return {"choice": choice}
    _, steps, offload = (part.split("=")[-1] for part in choice.split(":"))
    return {"choice": RETAIN, "retain_steps": steps if steps == ALL_STEPS else int(steps), "retain_offload": offload}


def described_choice(decision: dict) -> str:
    """``auto``'s choice as printed: the schedule, with ``train.retain``'s resolved keys where it is Retain."""
    if decision["choice"] != RETAIN or "retain_steps" not in decision:
        return decision["choice"]
    return f"{RETAIN} (train.retain.steps={decision['retain_steps']}, offload={decision['retain_offload']})"


def with_retain(cfg: RunConfig, steps: int | str, offload: str) -> RunConfig:
    """``cfg`` with ``train.retain.steps=steps`` and ``train.retain.offload=offload``."""
    retain = dataclasses.replace(cfg.train.retain, steps=steps, offload=offload)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, retain=retain))


def published_size(cfg: RunConfig, model: torch.nn.Module | None = None) -> dict:
    """The configured transformer with its adapter, built on the meta device (no memory, no initialisation) unless
    ``model`` is that already: its parameters, the MiB its weights take at ``model.dtype``, the trainable parameters
    P (LoRA factors, or all under full fine-tuning) and the MiB of their state: values, gradients and AdamW's two
    moments (torch keeps them in the parameter's dtype: float32 masters in half precision,
    :func:`lean.config.dtypes.master_dtype`), 4 P. Reweight adds (B + 1) P of buffers."""
    m = cfg.model
    if model is None:
        model = meta_transformer(family_spec(m.family), m.size)
        if not m.full_finetune:
            from accelerate import init_empty_weights  # local: accelerate's import takes seconds
            from peft import get_peft_model  # local: peft imports transformers (seconds)

            model.requires_grad_(False)
            # the adapter on the meta device too, and not initialised: only its shapes are counted (420M factors of
            # Qwen-Image's were drawn on the CPU)
            with init_empty_weights():
                model = get_peft_model(model, dataclasses.replace(lora_config(m), init_lora_weights=False))
    total = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)  # the base's weights
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtype = DTYPES[m.dtype]
    return {
        "transformer_parameters": total,
        "weight_mb": total * dtype.itemsize / 2**20,
        "trainable_parameters": trainable,
        "trainable_state_mb": 4 * trainable * master_dtype(dtype).itemsize / 2**20,
    }


def main(cfg: RunConfig, out: str | None = None) -> dict:
    """``lean plan``: print the predicted peak memory and time per iteration of each schedule (on a CPU, for a
    published size: the meta-device counts of :func:`published_size` instead)."""
    if is_published(cfg.model.size) and not torch.cuda.is_available():
        report = {"published_size": published_size(cfg)}
        print_published_size(cfg, report["published_size"])
        if out:
            write_json(f"{out}/plan.json", report)
        return report
    pipeline = build_pipeline(cfg, init_world(cfg.train.dist_timeout_s, cfg.parallel.sequence_parallel))
    inp = plan_input(pipeline)
    by_checkpointing = probe_checkpointing(inp)
    measured = by_checkpointing[cfg.model.gradient_checkpointing]
    link = link_speed(pipeline.world, shard_sizes(inp.policy).unit)
    device = pipeline.world.device
    host = {"link_mb_s": host_link_mb_s(device), "host_budget_mb": host_budget_mb(cfg)}
    costs = iteration_costs(inp, measured, **host)
    decision = choose(exact_predictions(cfg, costs), budget_mb(cfg, device), costs.host_budget_mb)
    decision = {**decision, **retain_choice(decision["choice"], cfg)}
    report = {
        "probe": measured,
        "layout": resolve_layout(cfg, inp.world_size),
        "prediction": prediction_table(costs),
        **({"rows": vars(costs.rows)} if costs.rows is not None else {}),
        "link_mb_per_s": link,
        "host_link_mb_per_s": costs.link_mb_s,
        "host_budget_mb": costs.host_budget_mb,
        "combinations": combinations(inp, shard_probes(inp, by_checkpointing, link), decision["budget_mb"], **host),
        "budget_mb": decision["budget_mb"],
        "auto_choice": decision["choice"],
        **{k: decision[k] for k in ("retain_steps", "retain_offload") if k in decision},
    }
    if pipeline.world.is_main:
        print_plan(cfg, measured, costs, decision)
        own = (report["layout"], planned_shard(cfg.parallel.shard, inp.processes), cfg.model.gradient_checkpointing)
        print_combinations(report["combinations"], own)
        if out:
            write_json(f"{out}/plan.json", report)
    return report


def print_published_size(cfg: RunConfig, r: dict) -> None:
    experts = len(family_spec(cfg.model.family).denoiser_folders)
    per = f" (per expert: {experts} of them, each its own LoRA)" if experts > 1 else ""
    published = is_published(cfg.model.size)
    where = "is not built on a CPU; on the meta device" if published else "counted on the meta device:"
    print(
        f"lean plan: {cfg.model.family}/{cfg.model.size} {where} its transformer{per} has "
        f"{r['transformer_parameters'] / 1e9:.2f}B parameters ({r['weight_mb'] / 1024:.1f} GiB in "
        f"{cfg.model.dtype}), {r['trainable_parameters'] / 1e6:.1f}M trainable "
        f"({r['trainable_state_mb']:.0f} MiB with their gradients and AdamW moments)"
    )


def print_combinations(rows: list[dict], own: tuple[str, str, bool]) -> None:
    """The :func:`combinations` table; * marks this run's (layout, shard, checkpointing), whose figures are measured
    (the other shard's are modelled from them). m: Retain's kept steps per sample; host: its offloaded graphs."""
    head = f"{'schedule':10} {'layout':7} {'shard':5} {'checkpointing':>13} {'m':>3} {'offload':7}"
    print(f"{head} {'peak memory MiB':>16} {'host MiB':>9} {'exposed s':>9} {'time/iteration s':>17}")
    for r in rows:
        mark = "*" if (r["layout"], r["shard"], r["gradient_checkpointing"]) == own else " "
        m, offload = retain_columns(r)
        print(
            f"{r['schedule']:10} {r['layout']:7} {r['shard']:5} {'on' if r['gradient_checkpointing'] else 'off':>13} "
            f"{m:>3} {offload:7} {r['peak_memory_mb']:16.1f} {r['host_mb']:9.1f} {r['exposed_transfer_s']:9.3f} "
            f"{r['time_iteration_s']:17.3f} {mark}"
        )


def retain_columns(row: dict) -> tuple[str, str]:
    """A row's (m, offload) as printed: ``all`` / m and off / host for Retain, ``-`` for the others."""
    if row["schedule"] != RETAIN:
        return "-", "-"
    return str(row["retain_steps"]), row["offload"]


def tree_line(cfg: RunConfig, costs: IterationCosts) -> str:
    """A tree rollout's counts as printed: its nodes' forwards, Retain's kept graphs and Recompute's recomputed
    edges, against the flat rollout of as many leaves (B n forwards, B K trained)."""
    r, t = costs.rows, cfg.sample.tree
    flat = r.leaves * costs.n, r.leaves * costs.k
    return (
        f"tree: {r.leaves} leaves (branching {t.branching} at steps {t.branch_points}), {r.forwards} node forwards, "
        f"{r.trained_forwards} trained nodes (retain's kept graphs), {r.trained_edges} trained edges (recompute's "
        f"update forwards); the flat rollout of {r.leaves} samples: {flat[0]} forwards, {flat[1]} trained"
    )


def print_plan(cfg: RunConfig, measured: dict, costs: IterationCosts, decision: dict) -> None:
    print(
        f"lean plan: {cfg.model.family}/{cfg.model.size} {cfg.model.dtype}, {cfg.algorithm.name}, "
        f"{cfg.sample.num_steps} steps, {costs.k} {TERMS[ALGORITHMS[cfg.algorithm.name].trains_on]}, one step "
        f"saves {measured['activation_mb']:.1f} MiB of activations at batch "
        f"{measured['batch']}"
    )
    print(
        f"decode + reward the iteration waits for: {costs.score:.3f} s "
        f"(decode {measured['t_decode']:.3f} s + reward {measured['t_reward']:.3f} s at batch {measured['batch']})"
    )
    if costs.rows is not None:
        print(tree_line(cfg, costs))
    print(f"{'schedule':10} {'peak memory MiB':>16} {'time/iteration s':>17}")
    predictions, exact = predict(costs), runnable(cfg)
    for name, p in predictions.items():
        if problem := algorithm_problem(SCHEDULES[name], ALGORITHMS[cfg.algorithm.name]):
            print(f"{name:10} {'':>16} {'':>17}  (never {cfg.algorithm.name}'s gradient: {problem.split(',')[0]})")
            continue
        why = "" if name in exact else f"  (not exact here: {schedule_problem(cfg, name)[0]})"
        print(f"{name:10} {p.peak_memory_mb:16.1f} {p.time_iteration_s:17.3f}{why}")
    print(f"budget {decision['budget_mb']:.0f} MiB -> auto takes {described_choice(decision)}")
    t = cfg.train
    if (steps := t.optimizer_steps_per_iteration * t.num_inner_epochs) > 1:
        hybrids = [s for s in LEAN_SCHEDULES if s in exact]
        who = f"{' and '.join(hybrids)} run" if hybrids else "no Lean schedule runs"
        print(
            f"{steps} optimizer steps per rollout: {who} it as a hybrid (the first update from the rollout's "
            f"graphs, the other {steps - 1} recomputed: lean.schedules.hybrid); train.on_policy=true is the recipe's "
            "one-step form"
        )
