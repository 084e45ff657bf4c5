"""`lean bench overlap`: options, the verdicts, the single-process path, the GPU script's branches, and a real run on
two gloo processes launched through Accelerate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lean.overlap import bench

REPO = Path(__file__).resolve().parents[1]


def test_options_are_validated():
    args = bench.parse_args(["--nproc", "3", "--methods", "flash,sliced", "--quick"])
    assert (args.nproc, args.methods, args.quick) == (3, "flash,sliced", True)
    for bad in (["--methods", "flash,ring"], ["--ops", "mlp.fc3"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_flash_vs_sliced_verdict_uses_the_noise():
    def row(method, latency, iqr):
        return {"op": "op", "shape": "s", "method": method, "latency_ms": latency, "latency_iqr_ms": iqr,
                "latency_min_ms": latency - iqr}

    verdicts = [bench.flash_vs_sliced([row("sliced", 10.0, 0.5), row("flash", f, 0.5)])[0]["verdict"]
                for f in (8.0, 10.3, 11.0)]
    assert verdicts == ["faster", "within noise", "slower"]


def test_single_process_measures_compute_and_says_what_it_could_not(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert bench.cli_main(["--nproc", "1", "--quick", "--ops", "mlp.fc1,ulysses.out", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "overlap.json").read_text())
    assert summary["world"] == 1 and summary["results"] == []
    assert [r["op"].split()[0] for r in summary["compute_only"]] == ["mlp.fc1", "ulysses.out"]
    assert all(r["compute_ms"] > 0 and 0 < r["mfu"] for r in summary["compute_only"])
    assert any("hidden fraction" in line for line in summary["not_measured"])
    projection = json.loads((tmp_path / "projection.json").read_text())
    assert {r["profile"] for r in projection["rows"]} == {"H100-SXM", "H200"}
    assert (tmp_path / "gantt.png").stat().st_size > 0


@pytest.mark.parametrize("gpus, expect", [("0", "--nproc 2 --quick"), ("1", "--nproc 1"), ("4", "--nproc 4")])
def test_gpu_script_picks_the_layout(gpus, expect):
    env = dict(os.environ, GPUS=gpus, DRY_RUN="1", PYTHON=sys.executable)
    out = subprocess.run(["bash", str(REPO / "benchmarks/gpu_overlap.sh"), "/tmp/unused"], env=env,
                         capture_output=True, text=True, check=True, timeout=30).stdout
    command = out.splitlines()[-1]
    assert command.startswith("+ ") and "bench overlap" in command and expect in command
    if gpus == "1":
        assert "need >= 2 GPUs" in out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_runs_on_two_gloo_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "lean.cli", "bench", "overlap", "--nproc", "2", "--quick",
                           "--ops", "mlp.fc1,mlp.fc2", "--repeats", "2", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=220, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hidden" in proc.stdout and "timeline model vs measured latency" in proc.stdout
    summary = json.loads((tmp_path / "overlap.json").read_text())
    assert summary["world"] == 2 and summary["backend"] == "gloo"
    cases = {(r["op"].split()[0], r["method"]) for r in summary["results"]}
    assert cases == {(op, m) for op in ("mlp.fc1", "mlp.fc2") for m in ("collective", "sliced", "flash")}
    for r in summary["results"]:
        assert r["latency_ms"] > 0 and r["comm_ms"] > 0 and r["compute_ms"] > 0
        assert r["exposed_ms"] == pytest.approx(r["latency_ms"] - r["compute_ms"])
    assert len(summary["model"]["cases"]) == len(summary["results"])
    assert {"alpha", "beta", "mem_bw", "compute_slowdown"} <= set(summary["calibration"])
    assert (tmp_path / "gantt_measured.png").stat().st_size > 0 and (tmp_path / "projection.json").exists()
