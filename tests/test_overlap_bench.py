"""`lean bench overlap`: options, the re-launch, the verdicts, the flat metrics, the single-process path, the GPU
script's branches, and a real run on two gloo processes launched through Accelerate."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, python

from lean.config import ConfigError
from lean.parallel.overlap import sim
from lean.tools.bench import overlap, overlap_report

REPO = Path(__file__).resolve().parents[1]


def parse(argv: list[str]) -> overlap.OverlapOptions:
    """The options ``lean bench overlap ARGV`` runs with (the parser ``lean.cli`` builds for the subcommand)."""
    parser = argparse.ArgumentParser(prog="lean bench overlap")
    overlap.add_arguments(parser)
    return overlap.options_from_args(parser.parse_args(argv))


def test_options_are_validated():
    options = parse(["--nproc", "3", "--methods", "flash,sliced", "--quick"])
    assert (options.nproc, options.methods, options.quick) == (3, ("flash", "sliced"), True)
    assert (options.effective_repeats, options.effective_warmup) == (3, 1)
    assert parse([]) == overlap.OverlapOptions()
    for bad, key in (
        (["--methods", "flash,ring"], "--methods"),
        (["--ops", "mlp.fc3"], "--ops"),
        (["--repeats", "0"], "--repeats"),
        (["--nproc", "0"], "--nproc"),
        (["--warmup", "-1"], "--warmup"),
        (["--dtype", "int8"], "--dtype"),
    ):
        with pytest.raises(ConfigError) as err:
            parse(bad)
        assert err.value.key == key
    with pytest.raises(ConfigError, match="unknown ring; choose from collective, sliced, flash, flash-bidir"):
        overlap.OverlapOptions(methods=("flash", "ring"))


def test_options_survive_the_relaunch_argv():
    options = overlap.OverlapOptions(
        nproc=3,
        out="x/y",
        shapes=("narrow", "wide"),
        quick=True,
        ops=("mlp.fc2",),
        repeats=4,
        warmup=0,
        methods=("flash",),
        block_ms=12.5,
        timeout=30.0,
        dtype=overlap.DTYPES.default,
    )
    assert parse(overlap.to_argv(options)) == options
    assert parse(overlap.to_argv(overlap.OverlapOptions())) == overlap.OverlapOptions()


def test_outside_a_launch_it_relaunches_itself_on_every_rank(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    calls = []
    monkeypatch.setattr("lean.parallel.launch.launch", lambda n, argv: calls.append((n, argv)) or 0)
    options = overlap.OverlapOptions(nproc=2, quick=True, ops=("mlp.fc1",))
    assert overlap.main(options) == 0
    ((n, argv),) = calls
    assert n == 2 and argv[:2] == ["bench", "overlap"] and parse(argv[2:]) == options


def test_flash_vs_sliced_verdict_uses_the_noise():
    def row(method, latency, iqr):
        return {
            "op": "op",
            "shape": "s",
            "method": method,
            "latency_ms": latency,
            "latency_iqr_ms": iqr,
            "latency_min_ms": latency - iqr,
        }

    verdicts = [
        overlap_report.flash_vs_sliced([row("sliced", 10.0, 0.5), row("flash", f, 0.5)])[0]["verdict"]
        for f in (8.0, 10.3, 11.0)
    ]
    assert verdicts == ["faster", "within noise", "slower"]


def test_overlap_metrics_are_medians_per_method():
    rows = [{"method": "flash", "exposed_ms": x, "latency_ms": 2.0} for x in (0.2, 0.6, 0.9)]
    rows += [{"method": "flash-bidir", "exposed_ms": 0.5, "latency_ms": 1.0}]
    out = overlap_report.flat_metrics({"results": rows, "model": {"mean_abs_error_median": 0.1}})
    assert out == {
        "overlap_exposed_ms_flash": 0.6,
        "overlap_latency_ms_flash": 2.0,
        "overlap_exposed_ms_flash_bidir": 0.5,
        "overlap_latency_ms_flash_bidir": 1.0,
        "overlap_model_mean_abs_error": 0.1,
    }


def test_pytorch_fused_ops_are_offered_for_fc1_and_fc2_and_skipped_off_nccl():
    specs = {s.name.split()[0]: s for s in sim.layer_ops(2, 1, 8, 4, 8)}
    offered = [kind for kind, s in specs.items() if overlap.FUSED in overlap.variants_for(s, overlap.VARIANTS)]
    assert offered == list(overlap.FUSED_OPS)
    reason = overlap.fused_unavailable("mlp.fc1", torch.device("cpu"))
    assert reason is not None and ("needs CUDA GPUs on NCCL" in reason or "has no" in reason)


def test_pytorch_fused_op_calls_fit_their_schemas_on_meta_tensors():
    """The benchmark's calls of torch.ops.symm_mem's fused ops, run through their shape functions (Meta kernels)
    on a one-process gloo group: the arguments fit the ops' schemas and the outputs have the compute-only shapes."""
    missing = [reason for kind in overlap.FUSED_OPS if (reason := overlap.fused_missing(kind))]
    if missing:
        pytest.skip("; ".join(missing))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shape, meta = overlap.Shape(2, 8, 4, 16), torch.device("meta")
        for spec in sim.layer_ops(1, **asdict(shape)):
            kind = spec.name.split()[0]
            if kind not in overlap.FUSED_OPS:
                continue
            case = overlap.make_case(spec, shape, torch.float32, meta)
            out = case.fused(dist.group.WORLD.group_name)
            result = out[1][0] if kind == "mlp.fc1" else out  # fused_all_gather_matmul: (gathered A, [A @ B])
            assert result.shape == case.compute_only().shape, kind
    finally:
        dist.destroy_process_group()


def test_single_process_measures_compute_and_says_what_it_could_not(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    options = parse(["--nproc", "1", "--quick", "--ops", "mlp.fc1,ulysses.out", "--out", str(tmp_path)])
    assert overlap.main(options) == 0
    summary = json.loads((tmp_path / "overlap.json").read_text())
    assert summary["world"] == 1 and summary["results"] == []
    assert [r["op"].split()[0] for r in summary["compute_only"]] == ["mlp.fc1", "ulysses.out"]
    assert all(r["compute_ms"] > 0 and 0 < r["mfu"] for r in summary["compute_only"])
    assert any("exposed communication" in line for line in summary["not_measured"])
    logged = [json.loads(line) for line in (tmp_path / "measured.jsonl").read_text().splitlines()]
    assert [row["compute_only"]["op"] for row in logged] == [r["op"] for r in summary["compute_only"]]
    projection = json.loads((tmp_path / "projection.json").read_text())
    assert {r["profile"] for r in projection["rows"]} == {"H100-SXM", "H200"}
    assert {b["block"].split()[0] for b in projection["blocks"]} == {"mlp", "ulysses", "dp"}
    assert projection["published"] and projection["assumptions"]
    assert (tmp_path / "gantt.png").stat().st_size > 0


def test_unknown_shape_exits_2(tmp_path, monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert overlap.main(overlap.OverlapOptions(nproc=1, shapes=("huge",), out=str(tmp_path))) == 2
    assert "unknown shape huge" in capsys.readouterr().err


@pytest.mark.parametrize("gpus, expect", [("0", "--nproc 2 --quick"), ("1", "--nproc 1"), ("4", "--nproc 4")])
def test_gpu_script_picks_the_layout(gpus, expect):
    env = dict(os.environ, GPUS=gpus, DRY_RUN="1", PYTHON=python())
    out = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu_overlap.sh"), "/tmp/unused"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    commands = [line for line in out.splitlines() if line.startswith("+ ")]
    assert "bench overlap" in commands[0] and expect in commands[0]
    # from 2 GPUs on, then the SP GRPO iteration: every schedule x method under sequence parallelism on 2 GPUs
    sequence_parallel = [c for c in commands[1:] if "bench schedules" in c and "parallel.sequence_parallel=2" in c]
    assert len(sequence_parallel) == (1 if int(gpus) >= 2 else 0) and len(commands) == 1 + len(sequence_parallel)
    if gpus == "1":
        assert "need >= 2 GPUs" in out


def _printing_rank(rank: int, world: int, port: int, env: dict, cwd: str, args: list[str], printed: str) -> None:
    """``helpers.lean_ranks``' rank, what it prints written to ``printed.<rank>``."""
    import contextlib

    from helpers import _lean_rank

    with open(f"{printed}.{rank}", "w") as out, contextlib.redirect_stdout(out):
        _lean_rank(rank, world, port, env, cwd, args)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_runs_on_two_gloo_processes(tmp_path):
    """``lean bench overlap`` on two gloo ranks as ``lean launch`` starts them (forked from the preloaded server,
    ``helpers.lean_ranks``: seconds of imports less per process); the re-launch's argv is the test above, the launch
    through Accelerate the smoke's overlap stage's (tests/test_workbench.py) and tests/test_distributed.py's."""
    from helpers import spawn

    args = ["bench", "overlap", "--nproc", "2", "--quick", "--ops", "mlp.fc1,mlp.fc2", "--repeats", "2"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    printed = tmp_path / "printed"
    spawn(_printing_rank, 2, env, os.getcwd(), [*args, "--out", str(tmp_path)], str(printed), deadline_s=220)
    stdout = (tmp_path / "printed.0").read_text()
    assert "exposed" in stdout and "timeline model vs measured latency" in stdout
    assert "The model against published figures" in stdout
    summary = json.loads((tmp_path / "overlap.json").read_text())
    assert summary["world"] == 2 and summary["backend"] == "gloo"
    cases = {(r["op"].split()[0], r["method"]) for r in summary["results"]}
    assert cases == {(op, m) for op in ("mlp.fc1", "mlp.fc2") for m in ("collective", "sliced", "flash")}
    for r in summary["results"]:
        assert r["latency_ms"] > 0 and r["comm_ms"] > 0 and r["compute_ms"] > 0
        assert r["exposed_ms"] == pytest.approx(r["latency_ms"] - r["compute_ms"])
    assert len(summary["model"]["cases"]) == len(summary["results"])
    assert {"p2p_latency", "collective_latency", "beta", "mem_bw", "compute_slowdown"} <= set(summary["calibration"])
    assert summary["model"]["profile"]["contention_source"].startswith("measured")
    # PyTorch's fused ops cannot run on gloo: skipped, with the reason, in the summary and in measured.jsonl
    assert {(s["op"].split()[0], s["method"]) for s in summary["skipped"]} == {
        ("mlp.fc1", "symm_mem"),
        ("mlp.fc2", "symm_mem"),
    }
    assert all("NCCL" in s["reason"] for s in summary["skipped"])
    logged = [json.loads(line) for line in (tmp_path / "measured.jsonl").read_text().splitlines()]
    assert sum("skipped" in row for row in logged) == 2 and sum("results" in row for row in logged) == 2
    assert (tmp_path / "gantt_measured.png").stat().st_size > 0 and (tmp_path / "projection.json").exists()
