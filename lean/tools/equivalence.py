"""Objective equivalence: Retain and Reweight must produce Recompute's update.

From identical trainable weights and optimizer state, one iteration of each schedule (same seed, so the same
trajectories, rewards and advantages). We compare, on every trainable tensor, the synchronised gradient just before
the optimizer step, and the weights just after it:

    max_abs_grad_diff            max_t ||g_t - g_t^rc||_inf
    max_rel_grad_diff            max_t ||g_t - g_t^rc||_inf / ||g_t^rc||_inf   (tensors with g^rc = 0 must match)
    cosine                       <g, g^rc> / (||g|| ||g^rc||) over all tensors flattened together
    max_rel_param_diff_after_step  max_t ||w_t - w_t^rc||_inf / ||w_t^rc - w_t^0||_inf  (relative to the update size)

The adapter starts from a random perturbation (peft initialises LoRA's B to zero, which would make the gradients of
A, and the KL term, vanish and the check weaker than it looks).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import load_file, save_file

from lean.algorithms import CLEAN_SAMPLES, build_algorithm
from lean.algorithms.base import step_targets
from lean.config import ConfigError, RunConfig
from lean.config.dtypes import HALF, dtype_name
from lean.models.build import build_policy
from lean.models.snapshot import Snapshot, swapped_in
from lean.observe.outputs import write_json
from lean.parallel.layout import resolve_layout
from lean.parallel.sharding import full, full_state_dict
from lean.run.optimizer import capture_synced_grads
from lean.sampling.rollout import velocity
from lean.sampling.transition import Transition
from lean.schedules import (
    BASELINE,
    LEAN_SCHEDULES,
    RETAIN,
    algorithm_schedules,
    compared_config,
    run_problem,
    schedule_class,
    schedule_problem,
    with_schedule,
)
from lean.schedules.base import flat_grad
from lean.schedules.edge_updates import edges_per_update, first_edges
from lean.schedules.recompute import _chunks, first_update_rows, rows_mask, update_order
from lean.schedules.renoised import ConditionalVelocities, UnitDraws
from lean.tools.alignment import alignment, deterministic_kernels, format_alignment
from lean.train import Trainer

CLIP_RANGES = (1e-4, 1e-3, 1e-2)  # FlowGRPO's and DanceGRPO's 1e-4, and larger ones: how the drift compares


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    d, r = diff.abs().max().item(), ref.abs().max().item()
    if r == 0:
        return 0.0 if d == 0 else float("inf")
    return d / r


def compare(
    grads: list[torch.Tensor],
    ref_grads: list[torch.Tensor],
    params: list[torch.Tensor],
    ref_params: list[torch.Tensor],
    start: list[torch.Tensor],
    names: list[str],
) -> dict:
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    cosine = torch.nn.functional.cosine_similarity(flat.double(), ref_flat.double(), dim=0).item()
    per_tensor = {n: _rel(g - r, r) for n, g, r in zip(names, grads, ref_grads)}
    return {
        "max_abs_grad_diff": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)),
        "max_rel_grad_diff": max(per_tensor.values()),
        "cosine": cosine,
        "max_rel_param_diff_after_step": max(_rel(p - q, q - s) for p, q, s in zip(params, ref_params, start)),
        "rel_grad_diff_per_tensor": per_tensor,
    }


class StepRecorder:
    """An ``on_step`` hook keeping x_i and x_{i+1} of every SDE step (a transition without its graph): the
    trajectories a float64 reference gradient is computed on (:meth:`Float64Reference.gradient` skips the steps no
    sample trains)."""

    def __init__(self):
        self.steps: list[Transition] = []

    def __call__(self, step: Transition) -> None:
        self.steps.append(
            Transition(index=step.index, rows=step.rows, sample=step.sample, next_sample=step.next_sample)
        )


class Float64Reference:
    """The on-policy gradient of the objective, in float64, for given trajectories and advantages.

    A twin of the policy in float64 takes the run's current weights, upcast (so it is the same policy without the
    rounding), and for every recorded trained step (x_i, x_{i+1}) the algorithm's float64 anchor
    (``Algorithm.reference_loss``; GRPO's in lean/algorithms/grpo.py) computes the loss with the ratio 1 by
    construction (log p - stopgrad(log p)). For GRPO:

        g_ref = 1/(N K) sum_b sum_{j in T_b} [ -A_b dlog p(x_{j+1} | x_j) + beta dKL_bj ]

    which is what every schedule optimises on-policy, with no rounding in the forward or the backward.
    """

    def __init__(self, trainer: Trainer):
        cfg = trainer.cfg
        self.cfg = cfg
        self.twin = build_policy(
            replace(cfg.model, dtype=dtype_name(torch.float64)), cfg.train.prompts, device=trainer.world.device
        )
        self.twin.negative_prompt = cfg.sample.negative_prompt
        # the frozen weights, upcast, once (whole: a sharded policy's are gathered; the twin itself is not sharded)
        self.twin.load_state_dict(full_state_dict(trainer.policy))
        self.policy, self.world = trainer.policy, trainer.world
        self.params = [p for _, p in self.twin.trainable_parameters()]
        self.sigmas = trainer.pipeline.sigmas.double()
        self.algorithm = build_algorithm(cfg, self.sigmas)  # its loss, over the float64 grid
        # the KL's reference where it is the algorithm's snapshot (GARDO): the run's, upcast at every load
        self.snapshot = trainer.pipeline.snapshot if self.algorithm.references_snapshot else None
        if self.snapshot is not None:
            self.twin.reference_weights = Snapshot(self.params)

    def load(self, trainable: list[torch.Tensor]) -> None:
        """The trainable weights the run had (upcast)."""
        with torch.no_grad():
            for p, value in zip(self.params, trainable):
                p.copy_(full(value))
        if self.snapshot is not None:
            upcast = [full(v).to(p.dtype) for v, p in zip(self.snapshot.values, self.params)]
            self.twin.reference_weights.values = upcast

    def gradient(
        self,
        trainable: list[torch.Tensor],
        batch,
        recorded: list[Transition],
        advantages: torch.Tensor,
        mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        kl_factors: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """g_ref at the weights ``trainable``, over the recorded steps (only the (sample, step) terms where ``mask``
        [B, num_steps] is True), of the samples ``rows`` (host ids: the first of several updates per rollout, its N
        their count; None: every sample); ``kl_factors`` [B]: each sample's regulariser factor, where the algorithm
        weighs it after the rewards (``IterationContext.kl_factors``)."""
        self.load(trainable)
        kept = batch.steps.trained
        if mask is not None:
            kept = kept & mask
        nonzero, n = self.algorithm.kept_terms(advantages.cpu(), batch.steps.trained, batch.iteration)
        if nonzero is not None:  # the samples (or a tree's edges) the algorithm drops leave the objective
            kept, n = kept & (nonzero if nonzero.dim() == 2 else nonzero[:, None]), float(n)
        if rows is not None:  # the first update's samples (with skip_zero_advantage: split, then filtered)
            in_first = rows_mask(kept.shape[0], rows)
            kept = kept & in_first[:, None]
            n = len(rows) if nonzero is None else max(int((nonzero & in_first).sum()), 1)
        trained = kept.double()
        scale = 1.0 / (n * int(batch.steps.trained[0].sum()))
        emb = self.twin.encode_prompts(batch.prompts)
        for p in self.params:
            p.grad = None
        for step in recorded:
            if not trained[step.rows, step.index].any():  # host-side: no term of this step is in the objective
                continue
            weights = (trained[step.rows, step.index] * scale).to(self.sigmas.device)
            targets = step_targets(advantages, step)
            factor = {} if kl_factors is None else {"kl_factor": kl_factors[step.rows].double()}
            loss = self.algorithm.reference_loss(self.twin, step, emb.index(step.rows), targets, **factor)
            (weights * loss).sum().backward()
        grads = flat_grad(self.params, [p.grad for p in self.params])
        self.world.average_replicated_(grads)  # averaged over ranks, as the optimizer step averages the schedules'
        return [g.view_as(p) for g, p in zip(grads.split([p.numel() for p in self.params]), self.params)]

    def clean_sample_gradient(self, trainable: list[torch.Tensor], rolled, targets: torch.Tensor) -> list[torch.Tensor]:
        """g_ref of an algorithm that trains on re-noised clean samples (NFT, DPO), at the weights ``trainable``: the
        first update's units (drawn as ``lean.schedules.renoised`` draws them) through the algorithm's float64 anchor
        ``reference_unit_loss``, the published formula in another arrangement, on the twin, with the rollout's clean
        samples, the same draws, and the snapshot's weights upcast for its velocity."""
        self.load(trainable)
        ctx, t = rolled.ctx, self.cfg.train
        snapshot = None if ctx.snapshot is None else [full(v).double() for v in ctx.snapshot.values]
        velocities = TwinVelocities(self.twin, self.twin.encode_prompts(rolled.batch.prompts), self.cfg, snapshot)
        groups = torch.tensor([g for g, _, _ in ctx.samples])
        units = self.algorithm.units(targets.cpu(), groups)
        draws = UnitDraws(ctx, units)
        first = _chunks(update_order(t, ctx.iteration, torch.arange(len(units)), 0), t.optimizer_steps_per_iteration)[0]
        k, clean = self.algorithm.draws_per_unit, rolled.final.double()
        for p in self.params:
            p.grad = None
        for u in first.sort().values:  # one unit at a time; its draws in order
            rows = units[u]
            for j in range(k):
                noise = draws.noise(u.view(1), tuple(clean.shape[1:]), clean.device)
                loss = self.algorithm.reference_unit_loss(
                    velocities,
                    clean[rows.to(clean.device)],
                    rows,
                    targets[rows.to(targets.device)],
                    draws.levels[u, j].view(1),
                    noise,
                )
                (loss.sum() / (len(first) * k)).backward()
        grads = flat_grad(self.params, [p.grad for p in self.params])
        self.world.average_replicated_(grads)
        return [g.view_as(p) for g, p in zip(grads.split([p.numel() for p in self.params]), self.params)]

    def forward_error(self, trainable: list[torch.Tensor], batch, recorded: list[Transition]) -> float:
        """How far the run's own precision moves the model: max |v - v_64| / max |v_64| of the velocity at the first
        recorded step (the scale of the rounding every gradient computed in this precision inherits)."""
        step, policy = recorded[0], self.policy
        self.load(trainable)
        with torch.no_grad():
            v = velocity(
                policy,
                step.sample,
                self.sigmas[step.index],
                policy.encode_prompts(batch.prompts).index(step.rows),
                self.cfg.sample,
            )
            v64 = velocity(
                self.twin,
                step.sample.double(),
                self.sigmas[step.index],
                self.twin.encode_prompts(batch.prompts).index(step.rows),
                self.cfg.sample,
            )
        return ((v.double() - v64).abs().max() / v64.abs().max()).item()


class TwinVelocities(ConditionalVelocities):
    """The update's velocities (``lean.schedules.renoised.ConditionalVelocities``) of the float64 twin, its snapshot
    the run's ``snapshot`` values, upcast."""

    def __init__(self, twin, emb, cfg: RunConfig, snapshot: list[torch.Tensor] | None):
        params = [p for _, p in twin.trainable_parameters()]
        super().__init__(twin, emb, cfg.sample, lambda: swapped_in(params, snapshot), torch.float64)


@dataclass
class Update:
    grads: list[torch.Tensor]  # the synchronised gradient of the update
    params: list[torch.Tensor]  # the weights after it
    metrics: dict
    reference: list[torch.Tensor] | None = None  # the float64 on-policy gradient of the same trajectories
    rounding: dict = field(default_factory=dict)  # the baseline's ratio drift (with a reference)
    moments: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # AdamW's after the step


def one_update(
    trainer: Trainer, schedule: str, reference: Float64Reference | None = None, iteration: int = 0
) -> Update:
    """One iteration with ``schedule`` through the pipeline's phases; with ``reference``, also the float64 gradient
    of the trajectories it rolled out and the advantages it used (computed before the update moves the weights)."""
    pipeline, state = trainer.pipeline, trainer.state
    state.iteration = iteration
    with capture_synced_grads(state) as grads:
        recorder = StepRecorder()
        make_schedule = schedule_class(schedule, pipeline.algorithm)
        rolled = pipeline.roll_out(iteration, make_schedule, on_step=recorder if reference else None)
        rewards, advantages = pipeline.advantages(rolled)
        start = [p.detach().clone() for p in trainer.params]  # the weights the update starts from
        first = first_update_rows(trainer.cfg, iteration, rolled.ctx.batch)  # the on-policy update's samples
        cells = first_cells(trainer.cfg, rolled, advantages)  # or a tree's edges (train.edges_per_update)
        ref = error = None
        if reference is not None and pipeline.algorithm.trains_on == CLEAN_SAMPLES:
            ref = reference.clean_sample_gradient(start, rolled, advantages)
        elif reference is not None:
            factors = rolled.ctx.kl_factors
            ref = reference.gradient(start, rolled.batch, recorder.steps, advantages, cells, first, factors)
            error = reference.forward_error(start, rolled.batch, recorder.steps)  # (policy at start)
        stats = pipeline.finish(rolled, advantages, state.step)
    update = Update(
        list(grads), [p.detach().clone() for p in trainer.params], {"reward_mean": rewards.mean().item(), **stats}, ref
    )
    if reference is not None and hasattr(rolled.schedule, "ratios"):
        update.rounding = rounding_report(trainer, reference, rolled, recorder.steps, advantages, ref, start, first)
        update.rounding["forward_error"] = error
    return update


def adam_moments(trainer: Trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """AdamW's first and second moments of every trainable tensor (this process's part), copied."""
    state = trainer.state.optimizer.state
    return [(state[p]["exp_avg"].detach().clone(), state[p]["exp_avg_sq"].detach().clone()) for p in trainer.params]


def first_cells(cfg: RunConfig, rolled, advantages: torch.Tensor) -> torch.Tensor | None:
    """The cells [B, num_steps] of a tree's first update under ``train.edges_per_update`` (the on-policy one the
    schedules compare, ``lean.schedules.hybrid.EdgeUpdates``), or None."""
    if edges_per_update(cfg) is None:
        return None
    return first_edges(rolled.ctx, rolled.ctx.kept_samples(advantages)[0])


def rounding_report(
    trainer: Trainer, reference: Float64Reference, rolled, recorded, advantages, ref, start, first=None
) -> dict:
    """What rounding did to the baseline's clipped surrogate in its on-policy update (the samples ``first``, or all):
    how far its recomputed ratios moved from 1, the share of (sample, step) terms whose clip bound by rounding alone
    (A > 0 and r > 1 + c, or A < 0 and r < 1 - c: their policy-gradient term is dropped), that share at other clip
    ranges, and the norm of the reference gradient those terms carry (what the update lost)."""
    trained, c = rolled.batch.steps.trained, trainer.cfg.algorithm.clip_range
    if first is not None:  # the later updates' ratios are off-policy: not rounding
        trained = trained & rows_mask(trained.shape[0], first)[:, None]
    if (cells := first_cells(trainer.cfg, rolled, advantages)) is not None:  # a tree's first update's edges
        trained = trained & cells
    ratio, adv = rolled.schedule.ratios.cpu(), advantages.cpu()[:, None]

    def binding(clip: float) -> torch.Tensor:
        return trained & (((adv > 0) & (ratio > 1 + clip)) | ((adv < 0) & (ratio < 1 - clip)))

    clipped = binding(c)
    removed = (
        reference.gradient(start, rolled.batch, recorded, advantages, clipped, first, rolled.ctx.kl_factors)
        if clipped.any()
        else None
    )
    norm = torch.cat([g.flatten() for g in ref]).norm().item()
    return {
        "ratio_max_dev": (ratio[trained] - 1).abs().max().item(),
        "rounding_clipped_fraction": (clipped.sum() / trained.sum()).item(),
        "rounding_clipped_fraction_by_step": (clipped.sum(0) / trained.sum(0).clamp_min(1)).tolist(),
        "rounding_clipped_fraction_by_clip_range": {
            f"{r:g}": (binding(r).sum() / trained.sum()).item() for r in CLIP_RANGES
        },
        "clipped_gradient_norm_fraction": 0.0
        if removed is None
        else torch.cat([g.flatten() for g in removed]).norm().item() / norm,
    }


def run_equivalence(
    cfg: RunConfig,
    trainer: Trainer | None = None,
    perturb_std: float = 0.02,
    reference: bool = True,
    gradients: dict[str, torch.Tensor] | None = None,
    aligned: bool = False,
) -> dict:
    """One iteration per schedule from the same state; returns the certificate (identical on every rank).

    Every Lean schedule's gradient is compared with the baseline's and, with ``reference``, every schedule's with the
    float64 on-policy gradient of its own trajectories (:class:`Float64Reference`); the baseline's rounding drift is
    reported beside it. ``gradients``, when given, receives every schedule's synchronised gradient as
    ``<schedule>/<tensor name>``; with ``aligned``, App. E's metrics of gradient, update and AdamW moments
    (``lean.tools.alignment``)."""
    cfg = compared_config(cfg)
    trainer = trainer or Trainer(cfg)
    trainer.policy.perturb_lora_(perturb_std, torch.Generator().manual_seed(cfg.train.seed))
    twin = Float64Reference(trainer) if reference else None
    start_state = trainer.state.state_dict()
    start = start_state["params"]
    updates, not_run = {}, {}
    for name in algorithm_schedules(cfg):
        if why := run_problem(cfg, name, trainer.world.size):  # the run would refuse it: nothing to certify
            not_run[name] = why
            continue
        trainer.state.load_state_dict(start_state)
        updates[name] = one_update(trainer, name, twin)
        if aligned:  # AdamW's moments after the step (the alignment compares them)
            updates[name].moments = adam_moments(trainer)
    trainer.state.load_state_dict(start_state)

    base, names = updates[BASELINE], trainer.state.names
    if gradients is not None:
        gradients.update({f"{s}/{n}": g.cpu() for s, u in updates.items() for n, g in zip(names, u.grads)})
    report = {
        "dtype": cfg.model.dtype,
        "world_size": trainer.world.size,
        "family": cfg.model.family,
        "reward_mean": base.metrics["reward_mean"],
        "algorithm": cfg.algorithm.name,
        "trains_on": trainer.pipeline.algorithm.trains_on,
        "retain_kept": {"steps": cfg.train.retain.steps, "offload": cfg.train.retain.offload},  # Retain's graphs
    }
    for name in LEAN_SCHEDULES:
        if name in updates:
            report[name] = compare(updates[name].grads, base.grads, updates[name].params, base.params, start, names)
    if not_run:
        report["not_run"] = not_run
    if aligned:
        report["alignment"] = alignment(updates, BASELINE, start)
    if reference:
        report["reference"] = {name: against_reference(u.grads, u.reference, names) for name, u in updates.items()}
        report["rounding"] = base.rounding
    return report


def against_reference(grads: list[torch.Tensor], reference: list[torch.Tensor], names: list[str]) -> dict:
    """A gradient against the float64 reference: the largest relative difference over tensors and the cosine."""
    flat, ref = torch.cat([g.double().flatten() for g in grads]), torch.cat([r.flatten() for r in reference])
    per_tensor = {n: _rel(g.double() - r, r) for n, g, r in zip(names, grads, reference)}
    return {
        "max_rel_grad_diff": max(per_tensor.values()),
        "cosine": torch.nn.functional.cosine_similarity(flat, ref, dim=0).item(),
        "rel_norm_diff": ((flat - ref).norm() / ref.norm()).item(),
    }


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(max_rel_grad_diff, 1 - cosine) targets against the baseline: 1e-10 in float64, 1e-5 / 1e-6 in float32."""
    return (1e-10, 1e-10) if dtype == torch.float64 else (1e-5, 1e-6)


ROUNDING_FACTOR = 10.0


def half_tolerance(forward_error: float) -> tuple[float, float]:
    """(relative L2 error, 1 - cosine) targets against the float64 reference in half precision.

    A half-precision gradient cannot be closer to the exact one than the model itself is in that precision. Its
    scale is ``forward_error``, eps = max |v - v_64| / max |v_64| of the velocity at the first SDE step
    (measured: 2-3% in bfloat16 for the tiny FLUX, SD3 and Wan). A gradient is a forward and a backward through the
    same network, each rounded, and the log-prob's gradient divides the mean's error by std^2; measured, the Lean
    schedules' error is 0.7 to 5 eps on those models. The target is ROUNDING_FACTOR = 10 eps on
    ||g - g_ref|| / ||g_ref||, and 1 - cosine <= (10 eps)^2 / 2, what that error allows when it is orthogonal to g.
    """
    rel = ROUNDING_FACTOR * forward_error
    return rel, rel**2 / 2


CLEAN_SAMPLE_HALF_TOLERANCE = 0.1  # rel L2 of a half-precision clean-sample update against its float64 formula


def passes(report: dict, dtype: torch.dtype) -> bool:
    """float32 / float64: each Lean schedule equals the baseline to :func:`tolerance`. Half precision: each Lean
    schedule equals the float64 reference of its own trajectories to :func:`half_tolerance` (the baseline is not the
    yardstick there: rounding moves its ratio out of the clip range, see ``report["rounding"]``). An algorithm that
    trains on re-noised clean samples runs the baseline alone: its gradient equals the float64 formula's, to
    :func:`tolerance` (half precision: ``CLEAN_SAMPLE_HALF_TOLERANCE`` in relative L2)."""
    if report.get("trains_on") == CLEAN_SAMPLES:
        own = report["reference"][BASELINE]
        if dtype in HALF:
            return own["rel_norm_diff"] <= CLEAN_SAMPLE_HALF_TOLERANCE
        rel_tol, cos_tol = tolerance(dtype)
        return own["max_rel_grad_diff"] <= rel_tol and own["cosine"] >= 1 - cos_tol
    if dtype in HALF:
        rel_tol, cos_tol = half_tolerance(report["rounding"]["forward_error"])
        return all(
            report["reference"][s]["rel_norm_diff"] <= rel_tol and report["reference"][s]["cosine"] >= 1 - cos_tol
            for s in LEAN_SCHEDULES
            if s in report["reference"]
        )
    rel_tol, cos_tol = tolerance(dtype)
    return all(
        report[s]["max_rel_grad_diff"] <= rel_tol and report[s]["cosine"] >= 1 - cos_tol
        for s in LEAN_SCHEDULES
        if s in report
    )


def certificate_overrides(overrides: list[str]) -> list[str]:
    """The certificate runs every schedule from one config, and ``train.retain``'s keys configure Retain's run (the
    others keep no graph and ignore them): a command line that sets them and names no schedule is read as Retain's
    run, so that ``lean equivalence --set train.retain.offload=host`` certifies the offloaded Retain."""
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    if any(k.startswith("train.retain.") for k in keys) and "train.schedule" not in keys:
        return [*overrides, "train.schedule=retain"]
    return list(overrides)


def against_other_run(gradients: dict[str, torch.Tensor], path: str) -> dict:
    """Each schedule's gradient against the same schedule's in ``path`` (a ``gradients.safetensors`` written by
    ``--save-gradients``, from another world size or layout: App. A says the layout changes no term of the gradient):
    the largest relative difference over tensors (:func:`compare`'s definition), per schedule."""
    other = load_file(path)
    ran, before = ({key.split("/", 1)[0] for key in g} for g in (gradients, other))
    if {k for k in gradients if k.split("/", 1)[0] in before} != {k for k in other if k.split("/", 1)[0] in ran}:
        raise ConfigError("--against", path, "its trainable tensors are not this run's (another model or adapter)")
    diffs: dict[str, float] = {}
    for key, grad in ((k, g) for k, g in gradients.items() if k.split("/", 1)[0] in before):  # schedules both ran
        schedule, ref = key.split("/", 1)[0], other[key].double()
        diffs[schedule] = max(diffs.get(schedule, 0.0), _rel(grad.double() - ref, ref))
    return diffs


def main(
    cfg: RunConfig,
    out: str | None = None,
    save_gradients: bool = False,
    against: str | None = None,
    deterministic: bool = False,
) -> dict:
    """``lean equivalence``: write DIR/equivalence.json (with ``save_gradients`` DIR/gradients.safetensors; with
    ``against`` each schedule's difference from that file's, which must pass the same tolerance) and print a summary
    (rank 0). ``deterministic``: LeanGRPO's alignment protocol (``lean.tools.alignment``; the config carries its
    overrides, :func:`~lean.tools.alignment.deterministic_overrides`): Retain must then equal Recompute bit for bit."""
    cfg = compared_config(cfg)
    with deterministic_kernels() if deterministic else contextlib.nullcontext():
        trainer = Trainer(cfg)
        gradients = {} if save_gradients or against else None
        report = run_equivalence(cfg, trainer, gradients=gradients, aligned=deterministic)
    report["layout"] = resolve_layout(cfg, trainer.world.data_size)
    report["passes"] = passes(report, cfg.model.torch_dtype)
    if deterministic and RETAIN in report["alignment"]:  # the protocol's claim: Retain's update is Recompute's
        report["passes"] &= all(m["bitwise_equal"] for m in report["alignment"][RETAIN].values())
    if against:
        report["against"] = {"path": against, "max_rel_grad_diff": against_other_run(gradients, against)}
        rel_tol, _ = tolerance(cfg.model.torch_dtype)
        report["passes"] &= all(d <= rel_tol for d in report["against"]["max_rel_grad_diff"].values())
    folder = out or "outputs/equivalence"
    if trainer.world.is_main:
        write_json(f"{folder}/equivalence.json", report)
        if save_gradients:
            save_file({k: g.contiguous() for k, g in gradients.items()}, f"{folder}/gradients.safetensors")
        print_report(cfg, report, trainer.world.size)
        if deterministic:
            print(format_alignment(report["alignment"], BASELINE))
    trainer.world.wait_for_everyone()
    return report


def problem_of(cfg: RunConfig, schedule: str) -> str:
    """Why the certificate did not run ``schedule`` (the run would refuse it)."""
    problem = schedule_problem(with_schedule(cfg, schedule), schedule)
    return problem[2] if problem else "not run"


def print_report(cfg: RunConfig, report: dict, world_size: int) -> None:
    dtype = cfg.model.torch_dtype
    rel_tol, cos_tol = tolerance(dtype)
    print(
        f"objective equivalence vs {BASELINE} ({cfg.model.family}, {cfg.model.dtype}, world_size={world_size}, "
        f"layout={report.get('layout', '?')}"
        + ("" if dtype in HALF else f"; targets: rel <= {rel_tol:g}, 1-cos <= {cos_tol:g}")
        + ")"
    )
    if other := report.get("against"):
        diffs = ", ".join(f"{s} {d:.3e}" for s, d in other["max_rel_grad_diff"].items())
        print(f"against {other['path']} (max rel grad diff): {diffs}")
    if kept := report.get("retain_kept"):
        print(f"retain keeps steps={kept['steps']} of its graphs, offload={kept['offload']}")
    print(
        f"{'schedule':10} {'max_abs_grad_diff':>18} {'max_rel_grad_diff':>18} {'1-cosine':>10} {'rel_param_diff':>15}"
    )
    for s in LEAN_SCHEDULES:
        if s not in report:
            print(f"{s:10} not run: {report.get('not_run', {}).get(s, problem_of(cfg, s))}")
            continue
        r = report[s]
        print(
            f"{s:10} {r['max_abs_grad_diff']:18.3e} {r['max_rel_grad_diff']:18.3e} {1 - r['cosine']:10.2e} "
            f"{r['max_rel_param_diff_after_step']:15.3e}"
        )
    if "reference" in report:
        rounding = report["rounding"]
        line = "against the float64 on-policy gradient of each schedule's own trajectories"
        if dtype in HALF:
            rel_tol, cos_tol = half_tolerance(rounding["forward_error"])
            line += (
                f" (targets: rel L2 <= {ROUNDING_FACTOR:g} x forward error {rounding['forward_error']:.3g} = "
                f"{rel_tol:.3g}, 1-cos <= {cos_tol:.3g})"
            )
        print(line)
        print(f"{'schedule':10} {'rel L2 diff':>12} {'max rel diff':>13} {'1-cosine':>10}")
        for s, r in report["reference"].items():
            print(f"{s:10} {r['rel_norm_diff']:12.3e} {r['max_rel_grad_diff']:13.3e} {1 - r['cosine']:10.2e}")
        if not rounding:  # an algorithm of re-noised clean samples: no ratio, no clip
            print("PASS" if report["passes"] else "FAIL")
            return
        print(
            f"{BASELINE}: ratio max |r - 1| {rounding['ratio_max_dev']:.2e}; the clip (range "
            f"{cfg.algorithm.clip_range:g}) bound by rounding alone on {rounding['rounding_clipped_fraction']:.1%} of "
            f"the terms, which carry {rounding['clipped_gradient_norm_fraction']:.1%} of the reference gradient's "
            f"norm"
        )
    print("PASS" if report["passes"] else "FAIL")
