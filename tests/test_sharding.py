"""FSDP2 sharding (``lean.parallel.sharding``, ``parallel.shard=fsdp``) on real gloo processes: the update is the
unsharded one."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import lean_here, lean_ranks, python
from safetensors.torch import load_file

from lean.config import ConfigError
from lean.configure import load_config, validate
from lean.run.iteration import local_batch

SMALL = ["train.prompts_per_iteration=2", "train.group_size=2", "sample.num_steps=4", "train.dist_timeout_s=60"]
SMALL += ["model.dtype=float64", "algorithm.beta=0.04"]
RANDOM_STEPS = ["sample.timestep_selection=random", "sample.timestep_fraction=0.5"]  # DanceGRPO: per-sample steps


def _sets(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def _lean(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    proc = subprocess.run([python(), "-m", "lean.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)).item() for k in a)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "processes,family,extra",
    [
        (2, "sd3", ["model.gradient_checkpointing=true"]),
        (2, "wan", ["parallel.layout=group", "train.prompts_per_iteration=4", "train.rollout_batch_size=2"]),
        # every process tracks the union of the steps any process trains (per-sample steps), checkpointed
        (4, "flux", [*RANDOM_STEPS, "train.prompts_per_iteration=4", "model.gradient_checkpointing=true"]),
        (2, "flux", ["model.full_finetune=true"]),  # everything sharded: Retain certified, Reweight refused
    ],
)
def test_sharded_processes_give_the_same_gradients(tmp_path, processes, family, extra):
    """The frozen base sharded, the adapter whole (or, under full fine-tuning, every weight sharded): Retain's and
    Reweight's gradients are Recompute's and the float64 on-policy gradient's (the certificate), under per-sample
    step selection, checkpointing and the group layout."""
    cfg = [*SMALL, f"model.family={family}", "parallel.shard=fsdp", *extra]
    lean_ranks(processes, "equivalence", *_sets(cfg), "--out", str(tmp_path))
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["world_size"] == processes and report["passes"], report
    full_finetune = "model.full_finetune=true" in extra
    assert ("reweight" in report.get("not_run", {})) == full_finetune
    for schedule in ("retain",) if full_finetune else ("retain", "reweight"):
        assert report[schedule]["max_rel_grad_diff"] < 1e-10, report[schedule]


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("schedule", ["retain"])  # Recompute's sharded gradients: the equivalence test above
def test_a_sharded_full_fine_tune_on_two_processes_equals_one_process(tmp_path, schedule):
    """Weights, gradients and AdamW state sharded over 2 processes: the same trained weights and EMA as 1 unsharded
    process (float64, 1e-10), with an evaluation whose shares are uneven (3 samples on 2 processes), checkpoints
    of whole tensors and a resume from one of them."""
    cfg = [*SMALL, "model.full_finetune=true", f"train.schedule={schedule}", "optimizer.lr=1e-3"]
    cfg += ["ema.enabled=true", "ema.every=1", "eval.every=2", "eval.num_steps=2", "eval.samples_per_prompt=1"]
    cfg += ["eval.prompts=[a red circle, a green square, a blue circle]", "checkpoint.every=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    lean_here("train", *_sets([*cfg, "train.iterations=3"]), "--out", str(one))
    sharded = [*cfg, "parallel.shard=fsdp"]
    lean_ranks(2, "train", *_sets([*sharded, "train.iterations=2"]), "--out", str(two))
    lean_ranks(2, "train", *_sets([*sharded, "train.iterations=3"]), "--out", str(two), "--resume")
    for name in ("lora.safetensors", "lora_ema.safetensors"):
        a, b = load_file(one / name), load_file(two / name)
        assert len(a) > 50  # every weight of the transformer is trained
        assert _max_rel_diff(a, b) < 1e-10, name
    assert (one / "base.json").read_text() == (two / "base.json").read_text()  # the sharded reference, gathered
    rewards = [json.loads((run / "metrics.json").read_text())["eval_reward_mean"] for run in (one, two)]
    assert rewards[1] == pytest.approx(rewards[0], abs=1e-9)


# a full fine-tune in the shared layout: the one process's gradients the sharded runs below are compared with
SHARED_FULL = [*SMALL, "model.full_finetune=true", "parallel.layout=shared", "train.group_size=4"]


@pytest.fixture(scope="module")
def one_process_gradients(tmp_path_factory) -> Path:
    """``lean equivalence --save-gradients`` of :data:`SHARED_FULL` on one process, once per worker (run in its own
    folder, as every test is: no params.yaml there, the code's defaults)."""
    one = tmp_path_factory.mktemp("one_process")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(one)
        lean_here("equivalence", *_sets(SHARED_FULL), "--save-gradients", "--out", str(one))
    return one / "gradients.safetensors"


@pytest.mark.slow
@pytest.mark.timeout(300)
# 4 processes: the same code path; 4 sharded processes with Reweight run in make test: the HSDP test below
@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=pytest.mark.matrix)])
def test_reweight_and_retain_on_a_sharded_full_fine_tune_give_one_process_gradients(
    tmp_path, processes, one_process_gradients
):
    """LeanGRPO's headline run, shrunk: FSDP2 full fine-tuning in the shared layout with the sync once per update.
    Reweight's provisional gradients are whole per trajectory (FSDP2's accumulation taken as each backward ends),
    corrected by A, then reduce-scattered (Sec. 4.3.2, Eq. 18): every schedule's gradient is one process's."""
    many = tmp_path / "many"
    sharded = _sets([*SHARED_FULL, "parallel.shard=fsdp", "parallel.grad_sync=per_update"])
    lean_ranks(processes, "equivalence", *sharded, "--against", str(one_process_gradients), "--out", str(many))
    report = json.loads((many / "equivalence.json").read_text())
    assert report["passes"] and not report.get("not_run") and report["world_size"] == processes, report
    assert set(report["against"]["max_rel_grad_diff"]) == {"recompute", "retain", "reweight"}
    assert max(report["against"]["max_rel_grad_diff"].values()) < 1e-10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sharded_update_reduce_scatters_once_per_unit_or_after_every_backward(tmp_path):
    """``parallel.grad_sync`` under FSDP2 full fine-tuning: per_backward reduce-scatters every unit after every
    backward (FSDP2's own), per_update once per unit per optimizer step; the same weights. Retain backpropagates its
    kept graphs in one backward: its per_backward count is the number of units (Retain under per_update: the
    equivalence tests above)."""
    cfg = [*SMALL, "model.full_finetune=true", "parallel.shard=fsdp", "train.group_size=4"]
    runs = {}
    for schedule, sync in (("recompute", "per_backward"), ("recompute", "per_update"), ("retain", "per_backward")):
        out = tmp_path / f"{schedule}_{sync}"
        sets = [*cfg, f"train.schedule={schedule}", f"parallel.grad_sync={sync}"]
        lean_ranks(2, "train", *_sets(sets), "--out", str(out))
        with open(out / "metrics.csv") as f:
            row = next(csv.DictReader(f))
        runs[schedule, sync] = {k: float(v) for k, v in row.items() if k.startswith("comm_")}
        runs[schedule, sync]["weights"] = load_file(out / "lora.safetensors")
    units = runs["retain", "per_backward"]["comm_reduce_scatter_count"]
    assert units >= 3  # the blocks and the root
    assert runs["recompute", "per_update"]["comm_reduce_scatter_count"] == units
    backwards = runs["recompute", "per_backward"]["comm_reduce_scatter_count"] / units
    assert backwards == int(backwards) and backwards > 1  # one per update micro-batch's backward
    a, b = (runs["recompute", sync]["weights"] for sync in ("per_backward", "per_update"))
    assert _max_rel_diff(a, b) < 1e-10


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sequence_parallel", [pytest.param(1, marks=pytest.mark.matrix), 2])  # 2: HSDP and SP
def test_hsdp_as_two_nodes_of_two_gives_one_process_gradients(tmp_path, sequence_parallel, one_process_gradients):
    """``parallel.shard=hsdp``: 4 gloo processes as 2 replicas (nodes) x 2, a full fine-tune sharded within each and
    replicated across them (FSDP2's 2-D mesh: reduce-scatter in a node, all-reduce across), once with each node one
    sequence-parallel group of 2; one sync per update, so Reweight runs: every schedule's gradient is one process's."""
    many = tmp_path / "many"
    hsdp = [*SHARED_FULL, "parallel.shard=hsdp", "parallel.replicas=2", "parallel.grad_sync=per_update"]
    hsdp.append(f"parallel.sequence_parallel={sequence_parallel}")
    lean_ranks(4, "equivalence", *_sets(hsdp), "--against", str(one_process_gradients), "--out", str(many))
    report = json.loads((many / "equivalence.json").read_text())
    assert report["passes"] and not report.get("not_run"), report
    assert set(report["against"]["max_rel_grad_diff"]) == {"recompute", "retain", "reweight"}
    assert max(report["against"]["max_rel_grad_diff"].values()) < 1e-10


def test_hsdp_replicas_default_to_the_nodes_and_divide_the_processes(monkeypatch):
    from lean.parallel.sharding import replica_count

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's, as `lean launch -n 4 --nnodes 2` starts each node
    assert replica_count(None) == 2 and replica_count(4) == 4
    with pytest.raises(ConfigError, match="parallel.replicas"):
        validate(load_config(None, ["parallel.shard=hsdp", "parallel.replicas=3"]), world_size=4)
    with pytest.raises(ConfigError, match="parallel.replicas"):  # a node of 2 cannot hold an SP group of 4
        sets = ["parallel.shard=hsdp", "parallel.replicas=2", "parallel.sequence_parallel=4"]
        validate(load_config(None, sets), world_size=4)


def test_processes_track_the_union_of_the_trained_steps():
    """Under fsdp every process's selection carries the steps any process trains; the samples' own stay theirs."""
    sets = [*SMALL, *RANDOM_STEPS, "train.prompts_per_iteration=4", "sample.num_steps=8"]
    cfg, sharded = load_config(None, sets), load_config(None, [*sets, "parallel.shard=fsdp"])
    own = [local_batch(cfg, 0, r, 4).steps for r in range(4)]
    shared = [local_batch(sharded, 0, r, 4).steps for r in range(4)]
    union = torch.stack([s.grad_steps for s in own]).any(dim=0)
    assert any(not torch.equal(s.grad_steps, union) for s in own)  # the case matters: the processes differ
    for mine, theirs in zip(own, shared):
        assert torch.equal(theirs.grad_steps, union) and torch.equal(theirs.trained, mine.trained)


@pytest.mark.parametrize(
    "sets,words",
    [
        (["model.full_finetune=true", "train.schedule=reweight"], "parallel.grad_sync=per_update"),
        (["algorithm.skip_zero_advantage=true"], "lockstep"),
        (["model.family=wan", "model.full_finetune=true", "model.dtype=bfloat16"], "float32 modules"),
        (["parallel.shard=zero3"], "must be one of none, fsdp"),
    ],
)
def test_what_fsdp_cannot_run_is_one_config_line(sets, words):
    with pytest.raises(ConfigError, match="parallel.shard") as err:
        validate(load_config(None, ["parallel.shard=fsdp", *sets]), world_size=2)
    assert words in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_plan_and_bench_memory_on_sharded_processes(tmp_path):
    """``lean plan`` on 2 processes prints both shard settings (its own measured, the other modelled), and ``lean
    bench memory`` under FSDP x sequence parallelism measures every schedule x layout x checkpointing beside the
    plan's figures: each process's peak within 15% of the plan's."""
    cfg = ["train.prompts_per_iteration=4", "train.group_size=4", "train.rollout_batch_size=4", "parallel.shard=fsdp"]
    cfg += ["model.full_finetune=true", "train.dist_timeout_s=60", "sample.num_steps=4"]
    lean_ranks(2, "plan", *_sets(cfg), "--out", str(tmp_path / "plan"))
    rows = json.loads((tmp_path / "plan" / "plan.json").read_text())["combinations"]
    assert {r["shard"] for r in rows} == {"none", "fsdp"}
    by = {(r["schedule"], r["layout"], r["shard"], r["gradient_checkpointing"]): r["peak_memory_mb"] for r in rows}
    assert by["recompute", "group", "fsdp", False] < by["recompute", "group", "none", False]  # sharded state
    # Reweight's sharded rows run parallel.grad_sync=per_update (its provisional gradients whole until corrected)
    assert {r["grad_sync"] for r in rows if r["schedule"] == "reweight" and r["shard"] == "fsdp"} == {"per_update"}

    # FSDP x SP: 4 processes, 2 data-parallel x 2 sequence-parallel, the weights sharded over all 4; the plan is
    # probed on the sequence-parallel processes (its own tokens, its share of the decode)
    out, tiny = tmp_path / "bench", ["model.size=tiny", "model.resolution=32", "parallel.sequence_parallel=2"]
    bench = ["bench", "memory", *_sets([*cfg, *tiny]), "--repeats", "1", "--warmup", "0", "--out", str(out)]
    lean_ranks(4, *bench, "--layouts", "shared")  # LeanGRPO's (the group and slice layouts: tests/test_layout.py)
    result = json.loads((out / "memory.json").read_text())
    assert result["config"]["shard"] == "fsdp" and result["config"]["world_size"] == 4
    assert {e["schedule"] for e in result["variants"]} == {"recompute", "retain"}
    assert {e["layout"] for e in result["variants"]} == {"shared"} and len(result["variants"]) == 4
    for e in result["variants"]:  # a tiny model: the peaks are mostly the process itself, but each is predicted
        assert e["peak_memory_mb"] == pytest.approx(e["plan_peak_memory_mb"], rel=0.15)
