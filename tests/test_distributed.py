"""Real gloo ranks, through `lean launch` (one process, two processes, two nodes) or as it starts them
(``helpers.lean_ranks``): world size changes neither the trajectories nor the update."""

import csv
import json
import subprocess

import pytest
import torch
from helpers import free_port, lean_here, lean_ranks, python
from safetensors.torch import load_file

SMALL = [
    "--set",
    "train.prompts_per_iteration=2",
    "--set",
    "train.group_size=2",
    "--set",
    "sample.num_steps=4",
    "--set",
    "train.iterations=1",
    "--set",
    "train.dist_timeout_s=60",
]


def _lean(*args, timeout=280):
    proc = subprocess.run([python(), "-m", "lean.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


EVAL_PROMPTS = ("a red circle on a white background", "a green square on a black background", "a blue circle")
# evaluations 0 and 1 of three prompts: shares of 2 and 1 samples on two processes
EVAL = ["--set", "eval.every=1", "--set", "eval.num_steps=2", "--set", "eval.samples_per_prompt=1"]
EVAL += ["--set", f"eval.prompts=[{', '.join(EVAL_PROMPTS)}]"]


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12)])  # the strict one; float32 runs the same code path
def test_two_processes_or_two_nodes_roll_out_the_same_trajectories(tmp_path, dtype, tol):
    one, two = tmp_path / "one", tmp_path / "two"
    lean_here("train", *SMALL, *EVAL, "--set", f"model.dtype={dtype}", "--out", str(one))
    # two ranks forked from the preloaded server (helpers.lean_ranks); `lean launch -n 2` itself starts the jobs of
    # tests/test_reliability.py, and `--nnodes 2` below
    lean_ranks(2, "train", *SMALL, *EVAL, "--set", f"model.dtype={dtype}", "--out", str(two))
    a, b = load_file(one / "rollout.safetensors"), load_file(two / "rollout.safetensors")
    assert a["latents"].shape == b["latents"].shape
    assert (a["latents"] - b["latents"]).abs().max().item() < tol
    assert torch.allclose(a["rewards"], b["rewards"], rtol=0, atol=tol)
    assert json.loads((two / "metrics.json").read_text())["world_size"] == 2
    for it in (0, 1):  # every sample of the evaluation, written by the process that owns it, scored the same
        rewards = [_column(run / "eval" / str(it) / "samples.csv", "reward") for run in (one, two)]
        assert len(rewards[0]) == 3 and rewards[1] == pytest.approx(rewards[0], rel=0, abs=1e-9)
        written = sorted(p.name for p in (two / "eval" / str(it)).iterdir())
        assert written == ["grid.png", "p000_s00.png", "p001_s00.png", "p002_s00.png", "samples.csv"]

    # `lean launch --nnodes 2`: two "machines" of one process each, rendezvous on 127.0.0.1: the same run
    two_nodes = tmp_path / "two_nodes"
    cmd = [python(), "-m", "lean.cli", "launch", "-n", "1", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port())]
    run = ["--", "train", *SMALL, *EVAL, "--set", f"model.dtype={dtype}", "--out", str(two_nodes)]
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(r), *run], stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    assert "node 1 of 2: 1 process(es) here, 2 in all, gloo" in errors[1]
    assert json.loads((two_nodes / "metrics.json").read_text())["world_size"] == 2
    a, b = load_file(two / "lora.safetensors"), load_file(two_nodes / "lora.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _column(path, name):
    with open(path) as f:
        return [float(row[name]) for row in csv.DictReader(f)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=pytest.mark.matrix)])
def test_equivalence_on_processes_in_the_group_layout(tmp_path, processes):
    """Each process holds two groups and finishes each as soon as it is scored (``lean.parallel.layout``): Retain and
    Reweight still give Recompute's synchronised gradient."""
    groups = ["--set", f"train.prompts_per_iteration={2 * processes}", "--set", "train.rollout_batch_size=2"]
    lean_ranks(
        processes,
        "equivalence",
        *SMALL,
        *groups,
        "--set",
        "model.dtype=float64",
        "--set",
        "algorithm.beta=0.04",
        "--set",
        "parallel.layout=group",
        "--out",
        str(tmp_path),
    )
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["world_size"] == processes and report["passes"], report


# CFG (the tiny FLUX's default) and the KL (beta > 0) in the shared layout
SHARED = ["--set", "model.dtype=float64", "--set", "algorithm.beta=0.04", "--set", "parallel.layout=shared"]
# the zero-advantage filter: the colourless prompt's group scores 0 and leaves the update (its KL terms too)
FILTER = [
    "--set",
    "algorithm.skip_zero_advantage=true",
    "--set",
    "train.prompts=[a red circle on a white background, plain, a blue square on a green background, a green square]",
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "processes,prompts,group,extra,sp",
    [
        (2, 2, 4, FILTER, 1),  # Q = 2 samples of each prompt per rank
        pytest.param(4, 2, 4, FILTER, 1, marks=pytest.mark.matrix),  # Q = 1 (4 processes: the cases below)
        # two worker groups of 2 ranks, one sample each. The filter averages the loss over each process's kept samples
        # (FlowGRPO's per-rank mean): with the colourless prompt on one worker group only, its ranks keep none, so the
        # update is not one process's by the algorithm's own definition; without it, every term is
        (4, 4, 2, [], 1),
        # 2 data-parallel x 2 sequence-parallel: a sequence-parallel group holds the same samples; the float64
        # reference (not split over tokens) is averaged over the data-parallel ranks, not summed over the group's
        (4, 2, 4, [], 2),
    ],
)
def test_the_shared_layout_on_processes_gives_one_process_gradients(tmp_path, processes, prompts, group, extra, sp):
    """LeanGRPO's layout (App. A): the ranks share each prompt's samples and finish it wave by wave; every schedule's
    synchronised gradient equals the one process's (a re-indexing of the same terms), and the certificate passes."""
    shape = ["--set", f"train.prompts_per_iteration={prompts}", "--set", f"train.group_size={group}", *extra]
    one, many = tmp_path / "one", tmp_path / "many"
    lean_here("equivalence", *SMALL, *SHARED, *shape, "--save-gradients", "--out", str(one))
    against = ["--against", str(one / "gradients.safetensors")]
    against += ["--set", f"parallel.sequence_parallel={sp}"]
    lean_ranks(processes, "equivalence", *SMALL, *SHARED, *shape, *against, "--out", str(many))
    report = json.loads((many / "equivalence.json").read_text())
    assert report["world_size"] == processes and report["layout"] == "shared" and report["passes"], report
    assert max(report["against"]["max_rel_grad_diff"].values()) <= 1e-10
    assert set(report["against"]["max_rel_grad_diff"]) == {"recompute", "retain", "reweight"}
    assert max(r["rel_norm_diff"] for r in report["reference"].values()) <= 1e-10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_update_hybrid_in_the_shared_layout_passes_the_certificate(tmp_path):
    """k = 2 updates per rollout: the Lean schedules' first update from the rollout, the second recomputed
    (``lean.schedules.hybrid``); each process's update samples are its own share, so the certificate compares the
    schedules on the same processes."""
    two = ["--set", "train.optimizer_steps_per_iteration=2", "--set", "train.prompts_per_iteration=4"]
    lean_ranks(2, "equivalence", *SMALL, *SHARED, *FILTER, *two, "--out", str(tmp_path))
    report = json.loads((tmp_path / "equivalence.json").read_text())
    assert report["world_size"] == 2 and report["passes"] and {"retain", "reweight"} <= set(report), report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reweight_holds_one_waves_buffers_in_the_shared_layout(tmp_path):
    """Two ranks, each with two groups of 4: the group layout folds a group's 4 per-trajectory buffers at a time
    (4 + the folded sum), the shared layout a wave's Q = 2 (2 + 1)."""
    sets = ["train.prompts_per_iteration=4", "train.group_size=4", "train.rollout_batch_size=4"]
    sets.append("train.schedule=reweight")
    buffers = {}
    for layout in ("group", "shared"):
        out = tmp_path / layout
        lean_ranks(2, "train", *SMALL, *_sets([*sets, f"parallel.layout={layout}"]), "--out", str(out))
        buffers[layout] = _column(out / "metrics.csv", "reweight_buffer_mb")[0]
    assert buffers["shared"] == pytest.approx(buffers["group"] * 3 / 5)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["recompute", "retain"])
def test_syncing_every_backward_or_once_per_update_gives_the_same_weights(tmp_path, schedule):
    """``parallel.grad_sync``: per_backward all-reduces each backward's gradient as it ends (the paper's Native), per
    update once (coalesced): the same weights after the update, and the collectives counted as they ran."""
    sets = ["model.dtype=float64", "algorithm.beta=0.04", "train.group_size=4", f"train.schedule={schedule}"]
    metrics = {}
    for sync in ("per_update", "per_backward"):
        out = tmp_path / sync
        lean_ranks(2, "train", *SMALL, *_sets([*sets, f"parallel.grad_sync={sync}"]), "--out", str(out))
        metrics[sync] = {k: _column(out / "metrics.csv", k)[0] for k in ("comm_all_reduce_count", "time_sync_s")}
    a, b = (load_file(tmp_path / sync / "lora.safetensors") for sync in ("per_update", "per_backward"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-12
    assert metrics["per_update"]["comm_all_reduce_count"] == 1  # the update's gradient, nothing else all-reduced
    # Recompute: a backward per update micro-batch, each synced; Retain backpropagates its kept graphs in one
    # backward (one sync either way)
    backwards = metrics["per_backward"]["comm_all_reduce_count"]
    assert (backwards > 1 if schedule == "recompute" else backwards == 1) and metrics["per_backward"]["time_sync_s"] > 0


def test_what_cannot_sync_every_backward_is_one_config_line():
    from lean.config import ConfigError
    from lean.configure import load_config, validate

    with pytest.raises(ConfigError, match="App. C"):  # a provisional gradient synced before its advantage
        validate(load_config(None, ["parallel.grad_sync=per_backward", "train.schedule=reweight"]), world_size=2)
    sharded = ["parallel.shard=fsdp", "model.full_finetune=true", "train.schedule=reweight"]
    with pytest.raises(ConfigError, match="set parallel.grad_sync=per_update"):  # auto: FSDP2's per backward
        validate(load_config(None, sharded), world_size=2)
    validate(load_config(None, [*sharded, "parallel.grad_sync=per_update"]), world_size=2)
    validate(load_config(None, ["parallel.grad_sync=per_backward", "train.schedule=retain"]), world_size=2)


def _sets(values):
    return [arg for v in values for arg in ("--set", v)]


def test_launch_flags_are_checked(capsys):
    from lean.cli import main

    assert main(["launch", "-n", "1", "--nnodes", "2", "--node-rank", "1", "--", "train"]) == 2
    err = capsys.readouterr().err
    assert "--master-addr" in err and len(err.strip().splitlines()) == 1
