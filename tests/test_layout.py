"""The data-parallel layout (``lean.parallel.layout``, ``parallel.layout``): the group layout finishes each prompt group
as soon as it is scored (Retain frees its graphs, Reweight folds its buffers) and gives the slice layout's update."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import documented_plan_rows, tiny

from lean.config import ConfigError
from lean.configure import load_config, validate
from lean.models import family_spec
from lean.parallel.layout import SharedShape, finish_unit, resolve_layout, shared_order
from lean.schedules import SCHEDULES
from lean.tools.equivalence import one_update
from lean.train import Trainer

# 3 groups of 2 in rollout micro-batches of one group: the group layout finishes 3 times during the rollout
GROUPS = ["model.dtype=float64", "train.prompts_per_iteration=3", "train.group_size=2", "train.rollout_batch_size=2"]
CASES = {
    "cfg": [],
    "kl": ["algorithm.beta=0.04"],
    "half-group-micro-batches": ["train.group_size=4", "train.rollout_batch_size=2", "sample.cfg=false"],
    "two-groups-per-micro-batch": ["train.prompts_per_iteration=4", "train.rollout_batch_size=4"],
    "per-sample-steps": [  # DanceGRPO's selection: a step tracks only the rows of a micro-batch that train it
        "sample.timestep_selection=random",
        "sample.timestep_fraction=0.5",
        "sample.sde_kind=dance",
        "sample.cfg=false",
    ],
    "per-reward": [  # MixGRPO's combination is a group's own: its groups still finish early
        "algorithm.reward_combination=per_reward",
        "reward.weights={color_match: 0.7, jpeg_compressibility: 0.3}",
    ],
    "skip-zero-advantage": [  # the colourless prompt's group scores 0: its samples leave the update, KL terms too
        "algorithm.skip_zero_advantage=true",
        "algorithm.beta=0.04",
        "train.prompts=[a red circle on a white background, plain, a blue square on a green background]",
    ],
}


def in_layout(trainer: Trainer, layout: str) -> Trainer:
    """``trainer`` set to ``layout`` (the pipeline reads it at every iteration: no rebuild)."""
    cfg = trainer.pipeline.cfg
    trainer.pipeline.cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, layout=layout))
    return trainer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_group_layout_gives_the_slice_layouts_gradients(case):
    cfg = tiny(*GROUPS, "train.train_batch_size=8", *CASES[case])
    assert (
        finish_unit(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, layout="group")), 1) is not None
    )  # groups finish early
    trainer = Trainer(cfg)
    trainer.policy.perturb_lora_(0.02, torch.Generator().manual_seed(0))
    start = trainer.state.state_dict()
    grads = {}
    for layout in ("slice", "group"):
        for schedule in ("recompute", "retain", "reweight"):
            trainer.state.load_state_dict(start)
            grads[layout, schedule] = one_update(in_layout(trainer, layout), schedule).grads
    reference = grads["slice", "recompute"]
    for key, got in grads.items():
        diff = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, reference))
        assert diff <= 1e-10, (key, diff)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro_batch", [2, 4])  # 4: units of 2 groups, and a last unit of one, finished at the end
def test_units_are_finished_with_the_whole_batchs_advantages(micro_batch):
    """A unit's advantages are computed once, from its own rewards, when it is finished; the update's are assembled
    from the units' (a last, shorter unit's after the rollout) and equal the whole batch's targets to the bit."""
    trainer = Trainer(tiny(*GROUPS, f"train.rollout_batch_size={micro_batch}", "parallel.layout=group"))
    pipeline, handed = trainer.pipeline, []

    def retain(ctx):
        schedule = SCHEDULES["retain"](ctx)
        finish_rows = schedule.finish_rows
        schedule.finish_rows = lambda rows, a: (handed.append((rows, a.clone())), finish_rows(rows, a))[-1]
        return schedule

    rolled = pipeline.roll_out(0, retain)
    rewards, advantages = pipeline.advantages(rolled)
    whole = pipeline.algorithm.targets(rewards, rolled.batch.group_ids())[rolled.batch.local]
    assert torch.equal(advantages.cpu(), whole) and whole.abs().sum() > 0
    assert [rows for rows, _ in handed] == (
        [slice(0, 2), slice(2, 4), slice(4, 6)] if micro_batch == 2 else [slice(0, 4)]
    )
    assert all(torch.equal(a[rows].cpu(), whole[rows]) for rows, a in handed)
    pipeline.finish(rolled, advantages, trainer.state.step)


@pytest.mark.timeout(120)
def test_gdpo_finishes_after_the_rollout_with_the_batchs_advantages():
    """gdpo renormalises over the whole batch: the group layout finishes nothing early (as under global_std), the
    advantages are the targets of every reward's gathered values, and every schedule gives Recompute's gradient."""
    two = ["reward.weights={color_match: 0.7, jpeg_compressibility: 0.3}", "algorithm.reward_combination=gdpo"]
    cfg = tiny(*GROUPS, "train.train_batch_size=8", "parallel.layout=group", *two)
    assert resolve_layout(cfg, 1) == "group" and finish_unit(cfg, 1) is None
    trainer = Trainer(cfg)
    trainer.policy.perturb_lora_(0.02, torch.Generator().manual_seed(0))
    start, pipeline = trainer.state.state_dict(), trainer.pipeline
    rolled = pipeline.roll_out(0, SCHEDULES["recompute"])
    rewards, advantages = pipeline.advantages(rolled)
    parts = torch.stack([rolled.parts[name] for name in cfg.reward.weights], dim=1)
    whole = pipeline.algorithm.targets(rewards, rolled.batch.group_ids(), parts)[rolled.batch.local]
    assert torch.equal(advantages.cpu(), whole) and whole.abs().sum() > 0
    grads = {}
    for schedule in ("recompute", "retain", "reweight"):
        trainer.state.load_state_dict(start)
        grads[schedule] = one_update(trainer, schedule).grads
    for schedule, got in grads.items():
        diff = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, grads["recompute"]))
        assert diff <= 1e-10, (schedule, diff)


def most_groups_retain_holds(trainer: Trainer) -> int:
    """The most rollout micro-batches (here: groups) whose graphs Retain holds at once during one iteration."""
    schedules, most = [], [0]

    def retain(ctx):
        schedules.append(SCHEDULES["retain"](ctx))
        return schedules[-1]

    def count(step):  # runs before the schedule sees the step
        most[0] = max(most[0], len({kept.rows.start for kept in schedules[0].kept}))

    rolled = trainer.pipeline.roll_out(0, retain, on_step=count)
    trainer.pipeline.finish(rolled, trainer.pipeline.advantages(rolled)[1], trainer.state.step)
    return most[0]


@pytest.mark.timeout(120)
def test_retain_holds_one_groups_graphs_and_reweight_one_groups_buffers():
    trainer = Trainer(tiny(*GROUPS))
    held = {layout: most_groups_retain_holds(in_layout(trainer, layout)) for layout in ("slice", "group")}
    assert held == {"slice": 3, "group": 1}
    buffer_mb = {
        layout: one_update(in_layout(trainer, layout), "reweight").metrics["reweight_buffer_mb"]
        for layout in ("slice", "group")
    }
    # Reweight: one buffer per local trajectory (6) against one group's (2) and the folded sum (1)
    assert buffer_mb["group"] == pytest.approx(buffer_mb["slice"] * 3 / 6)


def test_layout_resolution_and_refusals():
    assert resolve_layout(tiny(*GROUPS), 1) == "group"
    assert resolve_layout(tiny(*GROUPS), 2) == "slice"  # 3 groups do not divide over 2 processes
    assert finish_unit(tiny(*GROUPS, "algorithm.global_std=true"), 1) is None  # every advantage needs all groups
    assert finish_unit(tiny(*GROUPS, "train.rollout_batch_size=6"), 1) is None  # one unit: the whole batch
    with pytest.raises(ConfigError, match="divisible by the 2 processes"):
        validate(tiny(*GROUPS, "parallel.layout=group"), world_size=2)
    with pytest.raises(ConfigError, match="must divide group_size=2 or be a multiple of it"):
        validate(tiny(*GROUPS, "parallel.layout=group", "train.rollout_batch_size=3"))
    validate(tiny(*GROUPS, "parallel.layout=slice", "train.rollout_batch_size=3"))


@pytest.mark.parametrize(
    "prompts,group,ranks,wave,q",
    [(2, 4, 2, 1, 2), (2, 4, 4, 1, 1), (4, 2, 4, 2, 1), (16, 12, 8, 2, 3), (3, 2, 1, 1, 2)],
)
def test_the_shared_layout_deals_each_waves_samples_over_the_ranks(prompts, group, ranks, wave, q):
    """App. A: in a wave of c prompts every rank holds Q of its samples, rank d the wave's samples d, d + W, ...;
    every sample of the iteration once, each rank's share in wave order."""
    shape = SharedShape.of(group, ranks)
    assert (shape.prompts_per_wave, shape.per_rank) == (wave, q)
    order = shared_order(prompts, group, ranks)
    assert sorted(order) == list(range(prompts * group))
    share = len(order) // ranks
    for d in range(ranks):
        mine = order[d * share : (d + 1) * share]
        for w in range(prompts // wave):  # the wave's prompts, its samples d, d + W, ... of the wave
            wave_samples = mine[w * q : (w + 1) * q]
            assert wave_samples == [w * wave * group + d + i * ranks for i in range(q)]
    cfg = tiny(f"train.prompts_per_iteration={prompts}", f"train.group_size={group}", "parallel.layout=shared")
    assert finish_unit(cfg, ranks) == (q if q < len(order) // ranks else None)


def test_the_shared_layout_refuses_what_it_cannot_split():
    shared = ["parallel.layout=shared"]
    with pytest.raises(ConfigError, match="tree's leaves share their trunk"):
        tree = ["algorithm.name=branch_grpo", "sample.num_steps=6", "sample.tree.branch_points=[0, 2]"]
        validate(tiny(*shared, *tree, "train.group_size=4", "sample.timestep_selection=first"))
    with pytest.raises(ConfigError, match="group-wise reward win_rate"):
        validate(tiny(*shared, "reward.weights={win_rate: 1.0}", "reward.win_rate.judge_reward=color_match"))
    validate(tiny(*shared, "train.prompts_per_iteration=16", "train.group_size=12"), world_size=8)


@pytest.mark.timeout(180)
def test_plan_and_bench_memory_cover_every_schedule_layout_and_checkpointing(tmp_path):
    from lean.plan.cost import main as plan
    from lean.tools.bench.memory import bench_memory
    from lean.tools.bench.schedules import BenchOptions

    # 2 groups of 4 in micro-batches of one group, as the README's bench memory table
    cfg = tiny("train.prompts_per_iteration=2", "train.group_size=4", "train.rollout_batch_size=4")
    rows = [
        r for r in plan(cfg)["combinations"] if (r["retain_steps"], r["offload"]) == ("all", "device")
    ]  # as published
    assert {(r["layout"], r["shard"], r["gradient_checkpointing"]) for r in rows} == {
        (layout, "none", ck) for layout in ("group", "slice") for ck in (False, True)
    }  # one process: nothing to shard over
    predicted = {(r["schedule"], r["layout"], r["gradient_checkpointing"]): r["peak_memory_mb"] for r in rows}
    assert predicted["retain", "group", False] < predicted["retain", "slice", False]  # half the graphs held
    assert predicted["retain", "slice", True] < predicted["retain", "slice", False]  # block inputs only

    # the measured figures are the benchmark's (README); at this size the heap's noise is as large as the graphs
    result = bench_memory(cfg, out=str(tmp_path), options=BenchOptions(repeats=1, warmup=0))
    assert len(result["variants"]) == 12 and (tmp_path / "memory.json").exists()
    assert all(e["time_iteration_s"] > 0 and e["peak_memory_mb"] > 0 for e in result["variants"])
    assert {(e["schedule"], e["layout"], e["gradient_checkpointing"]) for e in result["variants"]} == set(predicted)


META_COUNTED = ["model.size=small", "model.resolution=256"]


def _measured_probe(rank: int, world: int, port: int, out: str) -> None:
    """The CPU probe of :data:`META_COUNTED` in a process of its own: the heap it measures holds nothing a test
    before it left behind in this worker (in a busy worker the decode's working set read 230 MiB instead of 203)."""
    from lean.parallel.distributed import World
    from lean.plan.cost import plan_input, probe
    from lean.run.iteration import build_pipeline

    measured = probe(plan_input(build_pipeline(load_config(None, META_COUNTED), World())))
    Path(out).write_text(json.dumps({k: v for k, v in measured.items() if isinstance(v, float)}))


@pytest.mark.timeout(180)
def test_meta_device_counts_agree_with_the_cpu_measurement(tmp_path):
    """The published-size plan counts memory on the meta device; at the small size, where both can run, its counts
    of the activations one tracked step keeps and of the decode's working set are the CPU's to 15%."""
    from helpers import spawn

    from lean.plan.meta import meta_input, meta_probe

    counted = meta_probe(meta_input(load_config(None, META_COUNTED), 1), flops_per_s=1e12)
    spawn(_measured_probe, 1, str(tmp_path / "measured.json"), deadline_s=150)
    measured = json.loads((tmp_path / "measured.json").read_text())
    for key in ("activation_mb", "decode_mb"):
        assert counted[key] == pytest.approx(measured[key], rel=0.15), key


@pytest.mark.parametrize("family", ["flux", "wan"])  # SD3's small stack has no run of 3 (checked by hand at full)
def test_the_plan_extrapolated_from_shallow_stacks_is_the_whole_count(family):
    """``lean plan`` at published sizes probes the block stacks cut to 2 and 3 blocks of each kind and extrapolates:
    every figure equals the count of the whole depth (the small sizes: 2 + 4 FLUX blocks, 4 Wan blocks)."""
    from lean.plan.meta import block_runs, depth_extrapolated, meta_input, meta_probe

    inp = meta_input(load_config(None, [f"model.family={family}", "model.size=small", "model.resolution=32"]), 1)
    net = inp.policy.denoisers[0].get_base_model()
    assert max(n for _, _, n in block_runs(net, family_spec(family).block_lists)) == 4  # a run is extrapolated
    whole = meta_probe(inp, flops_per_s=1e12)
    extrapolated = depth_extrapolated(inp, lambda i: meta_probe(i, flops_per_s=1e12))
    assert whole["activation_mb"] > 0 and whole.keys() == extrapolated.keys()
    for key, value in whole.items():
        assert extrapolated[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.timeout(240)
@pytest.mark.xdist_group("flux_lora_plan")
def test_plan_of_a_published_recipe_on_gpus(capsys, tmp_path):
    from lean.cli import main

    assert main(["plan", "--preset", "dancegrpo-flux", "--gpu-mem-gb", "80", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "counted on the meta device for 8 GPUs of 80 GB (24 samples per data-parallel rank" in out
    # the table docs/parallelism.md shows (and README quotes, tests/test_docs.py) is what the command prints now
    printed = [line.split() for line in out.splitlines()]
    assert all(list(row.values()) in printed for row in documented_plan_rows())
    report = json.loads((tmp_path / "plan.json").read_text())
    # 3 schedules x 3 layouts x 2 shards x checkpointing off/on, Retain's with its kept steps x offload
    settings = {(r["schedule"], r["layout"], r["shard"], r["gradient_checkpointing"]) for r in report["combinations"]}
    assert len(settings) == 36 and report["published_size"]["transformer_parameters"] > 11e9
    fits = {
        (r["schedule"], r["layout"], r["shard"], r["gradient_checkpointing"], r["retain_steps"], r["offload"])
        for r in report["combinations"]
        if r["fits"]
    }
    assert ("recompute", "group", "none", True, "all", "device") in fits  # DanceGRPO's own set-up fits 80 GB
    # 144 trajectory-steps of a 12B model's activations on the device do not; offloaded (or fewer kept) they do,
    # each row with its host memory, bytes moved and exposed copy time, and its time beside Recompute's and Reweight's
    assert ("retain", "slice", "none", False, "all", "device") not in fits
    assert ("retain", "group", "fsdp", True, "all", "host") in fits
    offloaded = [
        r for r in report["combinations"] if r["schedule"] == "retain" and r["fits"] and r["offload"] == "host"
    ]
    assert all(
        0 < r["host_mb"] <= report["assumed"]["host_budget_mb"] and r["d2h_mb"] == r["h2d_mb"] for r in offloaded
    )
    assert any(line.startswith("retain") and " host " in line and line.endswith("yes") for line in out.splitlines())
    assert report["fastest_fitting"]["time_iteration_s"] <= min(
        r["time_iteration_s"] for r in report["combinations"] if r["fits"]
    )
    by_shard = {
        (r["schedule"], r["layout"], r["shard"], r["gradient_checkpointing"]): r for r in report["combinations"]
    }
    for key, row in by_shard.items():  # the frozen base sharded over 8 GPUs: less memory, the same compute
        if key[2] == "fsdp":
            whole = by_shard[(*key[:2], "none", key[3])]
            assert row["peak_memory_mb"] < whole["peak_memory_mb"] - 15 * 1024


PAPER_RUN = ["--set", "sample.timestep_fraction=1.0", "--set", "train.on_policy=true"]  # LeanGRPO's Table 1


def paper_plan(main, tmp_path, *sets: str) -> dict:
    """``lean plan`` of DanceGRPO's FLUX run as LeanGRPO's Table 1 ran it: 8 RTX A6000 (48 GB), every step trained,
    one update per rollout; its shared-layout rows by (schedule, fits)."""
    args = ["plan", "--preset", "dancegrpo-flux", "--gpus", "8", "--gpu", "rtx-a6000", *PAPER_RUN, *sets]
    assert main([*args, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    shared = [r for r in report["combinations"] if r["layout"] == "shared" and r["shard"] == "fsdp"]
    return {**report, "fits": {(r["schedule"], r["fits"]) for r in shared}, "shared": shared}


@pytest.mark.xdist_group("flux_lora_plan")  # one worker: the recipe's test counts the LoRA transformer, this reuses it
def test_the_papers_lora_run_plans_a_lean_schedule_fastest(capsys, tmp_path):
    """On the paper's 8 x 48 GB, LoRA: Retain and Reweight rows fit in the shared layout and a Lean schedule is the
    fastest row (Reweight: one trajectory-step's activations at a time beside Q + 1 adapter buffers)."""
    from lean.cli import main

    report = paper_plan(main, tmp_path)
    assert report["gpu_mem_gb"] == 48 and report["assumed"]["gpu"] == "NVIDIA RTX A6000"
    assert report["assumed"]["peak_tflops"] == 154.8 and report["assumed"]["host_link"] == "pcie4"
    assert {("retain", True), ("reweight", True)} <= report["fits"]
    fastest = report["fastest_fitting"]
    assert fastest["schedule"] == "reweight" and fastest["grad_sync"] == "per_update"
    recompute = min(r["time_iteration_s"] for r in report["combinations"] if r["fits"] and r["schedule"] == "recompute")
    assert 1.3 < recompute / fastest["time_iteration_s"] < 1.6  # the paper: 1.45x
    reweight = next(r for r in report["shared"] if r["schedule"] == "reweight")
    adapter = report["published_size"]["trainable_parameters"] * 4 / 2**20  # float32 masters
    assert reweight["held_mb"] == pytest.approx(4 * adapter)  # Q + 1: 3 samples of a wave and the folded sum
    assert "parallel.grad_sync=per_update" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_plan_of_a_published_full_fine_tune_on_gpus(capsys, tmp_path):
    """A full fine-tune of the 12B transformer fits 80 GB only sharded (weights, gradients and AdamW moments / 8):
    unsharded (the preset shards, as DanceGRPO does) it is refused in one line that names the nearest row that fits."""
    from lean.cli import main

    sets = ["--set", "model.full_finetune=true", "--set", "parallel.shard=none"]
    assert main(["plan", "--preset", "dancegrpo-flux", *sets, "--gpu-mem-gb", "80", "--out", str(tmp_path)]) == 2
    rows = json.loads((tmp_path / "plan.json").read_text())["combinations"]
    assert {r["shard"] for r in rows if r["fits"]} == {"fsdp"}
    # Reweight under a sharded full fine-tune runs with parallel.grad_sync=per_update (what its refusal under auto
    # names), and its row says why it does not fit: a whole gradient per trajectory of the first update (a hybrid)
    reweight = [r for r in rows if r["shard"] == "fsdp" and r["schedule"] == "reweight"]
    assert reweight and all(r["grad_sync"] == "per_update" and not r["fits"] for r in reweight)
    whole = json.loads((tmp_path / "plan.json").read_text())["published_size"]["trainable_parameters"] * 4 / 2**20
    assert all(r["held_mb"] == pytest.approx(12 * whole) for r in reweight)  # the first update's 12 trajectories
    assert {r["grad_sync"] for r in rows if r["shard"] == "fsdp" and r["schedule"] != "reweight"} == {"per_backward"}
    # Retain's graphs on the device do not fit beside the sharded state; offloaded (or fewer of them) they do, faster
    # than Recompute
    fitting = {
        (r["schedule"], r["gradient_checkpointing"], r["retain_steps"], r["offload"]): r for r in rows if r["fits"]
    }
    assert ("retain", True, "all", "device") not in fitting and ("retain", True, "all", "host") in fitting
    assert (
        fitting["retain", True, "all", "host"]["time_iteration_s"]
        < fitting["recompute", True, "all", "device"]["time_iteration_s"]
    )
    captured = capsys.readouterr()
    assert "fastest that fits in 72 GiB: retain" in captured.out and "offload=host" in captured.out
    refusal = captured.err.strip().splitlines()[-1]
    assert "over the 72 GiB budget" in refusal and "the nearest row that fits" in refusal
    assert "--set parallel.shard=fsdp" in refusal and "train.schedule" not in refusal.split("nearest")[1]
    assert main(["plan", "--preset", "flowgrpo-wan", "--gpus", "3"]) == 2  # 16 samples do not divide over 3 GPUs
    assert "must divide over 3 processes" in capsys.readouterr().err
    # the paper's full fine-tune on 8 x 48 GB (the count above, reused): Retain fits and is the fastest row; Reweight's
    # row says why it does not: Q + 1 = 4 whole float32 gradients of the transformer per GPU (waves of 2 prompts, 3
    # samples each), over the budget by themselves
    paper = paper_plan(main, tmp_path / "paper", "--set", "model.full_finetune=true")
    assert ("retain", True) in paper["fits"] and paper["fastest_fitting"]["schedule"] == "retain"
    reweight = [r for r in paper["shared"] if r["schedule"] == "reweight"]
    assert reweight and all(
        r["held_mb"] == pytest.approx(4 * whole) and r["held_mb"] > paper["budget_mb"] for r in reweight
    )


@pytest.mark.timeout(240)
def test_the_plan_on_gpus_tabulates_sequence_parallelism_and_refuses_what_does_not_fit(capsys, tmp_path):
    """``lean plan --gpus 4`` counts the family's own Ulysses code at one rank's shapes for every degree that divides
    the heads and tokens (small Wan: 4 heads, 9 frames at 128 px = 192 tokens: SP 1, 2, 4), with each memory term, the
    all-to-alls' exposed time, fitting rows fastest first; a config whose own row does not fit is refused in one
    line naming the nearest row that does."""
    from lean.cli import main
    from lean.plan.meta import meta_plan, own_row, refuse_what_does_not_fit

    sets = [
        "model.family=wan",
        "model.size=small",
        "model.resolution=128",
        "model.num_frames=9",
        "model.text_max_length=16",
    ]
    sets += ["train.prompts_per_iteration=2", "train.group_size=4", "train.rollout_batch_size=1"]
    report = meta_plan(load_config(None, sets), gpus=4, gpu_mem_gb=1.0)
    rows = report["combinations"]
    assert {r["sequence_parallel"] for r in rows} == {1, 2, 4} and not any(report["sequence_degrees"].values())
    assert all({"base_mb", "activation_mb", "backward_transient_mb", "decode_mb"} <= r.keys() for r in rows)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # the fitting rows first ...
    fitting = [r["time_iteration_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)  # ... fastest first
    at = {
        (r["schedule"], r["layout"], r["shard"], r["gradient_checkpointing"], r["sequence_parallel"]): r for r in rows
    }
    one, split = at["recompute", "slice", "none", False, 1], at["recompute", "slice", "none", False, 2]
    # a micro-batch of one trajectory: its step's activations split over the group (the heads' all-to-all buffers
    # and the unsplit text and time embeddings stay); the all-to-alls cost time the single process does not pay
    assert 0.45 < split["activation_mb"] / one["activation_mb"] < 0.75
    assert split["time_iteration_s"] > one["time_iteration_s"] * 0.5
    assert at["recompute", "slice", "fsdp", False, 2]["base_mb"] < split["base_mb"]  # sharded over all 4 GPUs

    cfg = load_config(None, sets)
    nothing = [{**r, "fits": False} for r in rows]
    with pytest.raises(ConfigError, match="no row fits"):
        refuse_what_does_not_fit(cfg, {**report, "combinations": nothing, "own": own_row(cfg, nothing, 4)})
    capsys.readouterr()
    args = ["plan", *[a for s in sets for a in ("--set", s)], "--gpus", "4", "--out", str(tmp_path)]
    # Retain in the slice layout holds every trained step's activations: a budget between its peak and Recompute's
    retain, recompute = (at[s, "slice", "none", False, 1]["peak_memory_mb"] for s in ("retain", "recompute"))
    assert retain > recompute
    gb = (retain + recompute) / 2 / 1024 / 0.9  # lean.observe.metrics.MEMORY_MARGIN
    own = ["--set", "train.schedule=retain", "--set", "parallel.layout=slice", "--gpu-mem-gb", f"{gb:.9f}"]
    assert main([*args, *own]) == 2
    refusal = capsys.readouterr().err.strip().splitlines()[-1]
    assert "train.schedule=retain" in refusal and "the nearest row that fits" in refusal
    assert refusal.split("nearest")[1].count("--set") == 1  # one setting changed
