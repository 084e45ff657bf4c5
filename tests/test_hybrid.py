"""Hybrid schedules (``lean.schedules.hybrid``): with several optimizer steps per rollout, Retain and Reweight take the
first update from the rollout's graphs and recompute the later ones, and end every iteration with Recompute's
weights (float64, 1e-10 relative), on the published recipes shrunk to a CPU, in both layouts, on 1 and 2 processes
(FlowGRPO's Wan recipe runs the same code as its SD3 one: video changes nothing here). The runs sample 4 steps
(STEPS): how a hybrid splits the updates and which rows it tracks do not depend on the recipes' 6 to 20."""

from __future__ import annotations

import pytest
import torch
from helpers import lean_ranks, tiny_preset, tiny_preset_sets
from safetensors.torch import load_file

from lean.schedules import LEAN_SCHEDULES as LEAN
from lean.schedules import IterationCosts, Recompute, Retain, Reweight
from lean.schedules.recompute import first_update_rows

TOLERANCE = 1e-10
FLOAT64 = ["model.dtype=float64"]
STEPS = ["sample.num_steps=4"]  # the SDE, grid, window and step selection of each recipe, on fewer steps
# The colourless prompt's group scores 0 throughout (color_match): its advantages are 0, and FlowGRPO's filter drops it
ZERO_GROUP = ["train.prompts=[a red circle on a white background, plain]"]
# 4 groups, one of them all zero: an update keeps 3 of its 4 samples, whose 1/N (4 / 3) float32 would round
FOUR_GROUPS = ["train.prompts=[a red circle on a white background, plain, a green square, blue]"]
# what the hybrids run under the filter (auto): Recompute with the same order is the reference
SPLIT_FIRST = ["algorithm.zero_advantage_order=split_then_filter"]

# One process's iteration in the cost models' terms (lean.schedules.IterationCosts): on-policy, and its hybrid at S = 2
ON_POLICY_COSTS = IterationCosts(
    n=10, k=9, local=8, f=1.0, fb=3.0, fb_one=0.5, ref=0.0, score=2.0, base_mb=100, act_mb=50, act_one_mb=7,
    transient_mb=10, decode_mb=20, trainable_mb=1, train_rows_fraction=1.0, kl=False, per_row_grads=True,
)  # fmt: skip
HYBRID_COSTS = IterationCosts(**{**vars(ON_POLICY_COSTS), "first_share": 0.5})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _trained(cfg, schedule: str, iterations: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the trainable weights before, after ``iterations`` iterations of ``schedule``)."""
    from lean.train import Trainer

    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.params]
    for it in range(iterations):
        trainer.iteration(it, schedule)
    assert trainer.state.steps == iterations * cfg.train.optimizer_steps_per_iteration * cfg.train.num_inner_epochs
    return start, [p.detach().clone() for p in trainer.params]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name,extra",
    [
        ("flowgrpo-sd3", ZERO_GROUP),  # CFG with its gradient path, KL, shuffled order, zero-advantage filter
        ("flowgrpo-wan", [*FOUR_GROUPS, "train.prompts_per_iteration=4"]),  # video, exact KL, all_zero keep
        ("dancegrpo-flux", []),  # per-sample step selection, rollout order, shared initial noise
        ("flowgrpo-flux", ["train.num_inner_epochs=2"]),  # two passes over the rollout: 4 steps per rollout
        ("flowgrpo-flux", ["parallel.layout=group", "train.rollout_batch_size=2"]),  # groups finished at the end
        ("flowgrpo-flux", ["model.full_finetune=true"]),  # norms trained too: Reweight one trajectory per forward
        ("grpo-guard-sd3", ZERO_GROUP),  # RatioNorm: the later update reads the rollout's transition means
    ],
)
def test_hybrids_end_every_iteration_with_recomputes_weights(name, extra):
    """Two iterations of Retain and of Reweight (their first update from the rollout's graphs, the later ones
    recomputed) end each case's run with Recompute's weights, to 1e-10 in float64."""
    start, reference = _trained(tiny_preset(name, *FLOAT64, *STEPS, *extra, *SPLIT_FIRST), "recompute")
    assert any(not torch.equal(a, b) for a, b in zip(start, reference))
    for schedule in ("retain", "reweight"):
        _, weights = _trained(tiny_preset(name, *FLOAT64, *STEPS, *extra, f"train.schedule={schedule}"), schedule)
        assert max(_rel(w, r) for w, r in zip(weights, reference)) < TOLERANCE, schedule


@pytest.mark.parametrize("micro_batch", [4, 8])
def test_the_rollout_tracks_only_the_first_updates_samples(micro_batch):
    """Retain keeps the graphs of the first update's samples only; Reweight backpropagates those alone. FlowGRPO's
    shuffled update order is drawn before the rollout, and the local batch laid out in it: the first update's samples
    are the first rows, whole rollout micro-batches when they align (4), else one is split (8)."""
    from lean.run.iteration import global_samples, local_batch
    from lean.train import Trainer

    cfg = tiny_preset(
        "flowgrpo-flux", *FLOAT64, "train.prompts_per_iteration=4", f"train.rollout_batch_size={micro_batch}"
    )
    assert local_batch(cfg, 0).samples != global_samples(cfg, 0)  # shuffled: rows of both halves first
    assert sorted(local_batch(cfg, 0).samples) == sorted(global_samples(cfg, 0))
    trainer = Trainer(cfg)
    first = first_update_rows(cfg, 0, 8)
    assert first.tolist() == [0, 1, 2, 3]
    tracked: list[torch.Tensor] = []

    def record(step):
        if step.log_prob.requires_grad:
            tracked.append(step.rows)

    rolled = trainer.pipeline.roll_out(0, Retain, on_step=record)
    assert tracked and all(
        torch.as_tensor(range(8)[r] if isinstance(r, slice) else r).tolist() == first.tolist() for r in tracked
    )
    assert all(isinstance(r, slice) for r in tracked) == (micro_batch == 4)  # whole micro-batches: no split forward
    assert rolled.schedule.later is not None and not rolled.schedule.finishes_early
    assert trainer.pipeline.roll_out(0, Reweight).schedule.policy_buffers.trajectories == len(first)  # not B


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name,extra",
    [
        ("dancegrpo-flux", []),  # sharded base (fsdp): every process tracks the same local rows, passes in lockstep
        ("flowgrpo-sd3", FOUR_GROUPS),
    ],
)
def test_hybrids_on_two_processes_end_with_recomputes_weights(tmp_path, name, extra):
    """Two processes, each with half of every update: DanceGRPO's sharded recipe, and FlowGRPO's SD3 one with a group
    of zero advantages (each process filters its own share of every update). Retain also with one kept step per
    sample, offloaded (``train.retain``, tests/test_retain_offload.py): in DanceGRPO's lockstep the last of the steps
    any process trains is kept and the others are recomputed for every row."""
    sets = [*tiny_preset_sets(name), *FLOAT64, *extra, "train.prompts_per_iteration=4", "train.iterations=2"]
    sets += [*STEPS, "train.dist_timeout_s=60"]
    variants = {
        "recompute": ["train.schedule=recompute", *SPLIT_FIRST],
        "retain": ["train.schedule=retain"],
        "reweight": ["train.schedule=reweight"],
        "retain-1-host": ["train.schedule=retain", "train.retain.steps=1", "train.retain.offload=host"],
    }
    runs = {}
    for run, values in variants.items():
        args = [f"--set={value}" for value in [*sets, *values]]
        lean_ranks(2, "train", "--preset", name, *args, "--out", str(tmp_path / run))
        runs[run] = load_file(tmp_path / run / "lora.safetensors")
    for run in ("retain", "reweight", "retain-1-host"):
        assert max(_rel(runs[run][k], runs["recompute"][k]) for k in runs["recompute"]) < TOLERANCE, run


@pytest.mark.timeout(120)
def test_the_certificate_compares_the_first_update():
    """``lean equivalence`` with two updates per rollout: the first update's synchronised gradient (on-policy) of each
    schedule against Recompute's and against the float64 gradient of that update's samples."""
    from lean.tools.equivalence import passes, run_equivalence

    # zero_advantage_order auto: the hybrids' order; 4 groups, one of zero advantages, so the first update keeps some
    cfg = tiny_preset("flowgrpo-sd3", *FLOAT64, *STEPS, *FOUR_GROUPS, "train.prompts_per_iteration=4")
    report = run_equivalence(cfg, reference=True)
    assert passes(report, cfg.model.torch_dtype)
    for schedule in ("recompute", "retain", "reweight"):
        assert report["reference"][schedule]["max_rel_grad_diff"] < TOLERANCE, schedule
    assert report["rounding"]["ratio_max_dev"] < 1e-12  # the first update is on-policy


def test_a_hybrid_is_predicted_between_its_on_policy_form_and_recompute():
    """s = 1 and E = 1 is the on-policy schedule; at s = 1/2 the tracked work halves and Recompute's later update
    comes on top."""
    on_policy, hybrid = ON_POLICY_COSTS, HYBRID_COSTS
    for schedule in (Retain, Reweight):
        full, half, baseline = schedule.predict(on_policy), schedule.predict(hybrid), Recompute.predict(hybrid)
        assert full.time_iteration_s < half.time_iteration_s < baseline.time_iteration_s
    assert Recompute.predict(hybrid) == Recompute.predict(on_policy)  # every update recomputed either way
    # Retain: 10 f - 4.5 f + 4.5 fb + score + Recompute's 0.5 K fb; half the graphs
    assert Retain.predict(hybrid).time_iteration_s == pytest.approx(5.5 + 13.5 + 2.0 + 13.5)
    assert Retain.predict(hybrid).peak_memory_mb == pytest.approx(100 + max(9 * 50 * 0.5 + 20, 60))


def test_auto_weighs_only_the_schedules_that_run_the_recipe_exactly():
    from dataclasses import replace

    from lean.configure import load_config
    from lean.plan.cost import choose, exact_predictions

    costs = HYBRID_COSTS
    recipe = load_config(None, [], preset="flowgrpo-sd3")
    assert choose(exact_predictions(recipe, costs), budget_mb=1e6)["choice"] in ("retain", "reweight")
    # FlowGRPO's own filter order decides the first update after the rewards: only Recompute is exact
    filtered = replace(recipe, algorithm=replace(recipe.algorithm, zero_advantage_order="filter_then_split"))
    assert set(exact_predictions(filtered, costs)) == {"recompute"}
    assert choose(exact_predictions(filtered, costs), budget_mb=1e6)["choice"] == "recompute"


@pytest.mark.timeout(120)
def test_the_zero_advantage_order_changes_the_updates():
    """With a group of zero advantages the two orders train different updates (the cases above drop samples), and
    each hybrid update averages over the kept samples it holds."""
    sets = ["flowgrpo-sd3", *FLOAT64, *STEPS, *ZERO_GROUP]
    _, filtered = _trained(tiny_preset(*sets, "algorithm.zero_advantage_order=filter_then_split"), "recompute", 1)
    _, split = _trained(tiny_preset(*sets, *SPLIT_FIRST), "recompute", 1)
    assert max(_rel(a, b) for a, b in zip(filtered, split)) > 1e-6


@pytest.mark.timeout(180)
def test_bench_recipe_measures_both_forms_and_marks_what_auto_takes(tmp_path):
    """``lean bench schedules --preset P`` on a recipe: six rows (two forms x three schedules), each form's Lean
    schedules against their bound, exactly one row per form marked as ``auto``'s choice, and flat metrics for DVC."""
    from lean.tools.bench.schedules import FORMS, BenchOptions, bench_recipe, recipe_metrics

    cfg = tiny_preset("flowgrpo-flux", *STEPS)
    report = bench_recipe(cfg, str(tmp_path), BenchOptions(repeats=1, warmup=0, cores=0, flops=False))
    rows = report["table"]
    assert [(r["form"], r["schedule"]) for r in rows] == [(f, s) for f in FORMS for s in ("recompute", *LEAN)]
    for form in FORMS:
        assert sum(r["taken_by_auto"] for r in rows if r["form"] == form) == 1
        assert all(r["speedup_bound"] > 1 for r in rows if r["form"] == form and r["schedule"] in LEAN)
    assert (tmp_path / "recipe.json").exists() and (tmp_path / "on_policy" / "schedules.json").exists()
    metrics = recipe_metrics(report)
    assert {"speedup_recipe_auto", "speedup_on_policy_auto", "speedup_vs_bound_recipe_retain"} <= set(metrics)
