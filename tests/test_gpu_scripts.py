"""The GPU scripts on a machine without a GPU: they refuse clearly (or fall back, for the overlap benchmark), and
never benchmark a CPU build of torch beside a GPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import python

REPO = Path(__file__).resolve().parents[1]


def run(script: str, tmp_path: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHON": python(), **env},
    )


@pytest.mark.parametrize("script", ["gpu_smoke.sh"])  # gpu_schedules.sh sources the same check
def test_without_a_gpu_the_gpu_scripts_refuse_in_one_line(script, tmp_path):
    proc = run(script, tmp_path, PATH=f"{tmp_path}:{os.environ['PATH']}")
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU visible" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["gpu_schedules.sh", "gpu_overlap.sh"])
def test_a_cpu_torch_beside_a_gpu_is_refused(script, tmp_path):
    fake = tmp_path / "nvidia-smi"  # a GPU is present, the interpreter's torch cannot use it
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    proc = run(script, tmp_path, PATH=f"{tmp_path}:{os.environ['PATH']}", DRY_RUN="1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot use it" in proc.stderr


def test_the_retain_offload_check_runs_its_code_on_the_cpu_in_a_dry_run(tmp_path):
    """benchmarks/gpu_retain_offload.py --dry-run: every variant measured at the tiny size (offload in copy mode),
    the certificates pass, the peaks are not compared (the CPU's "host" is its device memory); without it and
    without a GPU, a one-line refusal."""
    import json

    import torch

    script = str(REPO / "benchmarks" / "gpu_retain_offload.py")
    out = tmp_path / "out"
    cmd = [python(), script, "--dry-run", "--out", str(out), "--repeats", "1", "--warmup", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "estimated" in proc.stdout  # the plan and its estimate come first
    result = json.loads((out / "retain_offload.json").read_text())
    k = result["config"]["trained_steps"]
    m = max(1, k // 2)
    assert set(result["variants"]) == {"recompute", "retain", "retain_offload", f"retain_m{m}", f"retain_m{m}_offload"}
    assert result["variants"][f"retain_m{m}"]["kept_share"] == m / k
    assert 1 < result["variants"][f"retain_m{m}"]["speedup_bound"] < result["variants"]["retain"]["speedup_bound"]
    assert all(holds for claim, holds in result["claims"].items() if claim.startswith("certificate"))
    assert [holds for claim, holds in result["claims"].items() if claim.startswith("peak")] == [None, None]
    assert result["host_link"]["h2d_gb_s"] > 0 and (out / "retain_offload.md").exists()  # inf: no link on a CPU
    assert (out / "measured.jsonl").read_text().count("\n") == 5 * 2  # each variant's memory pass and timed round
    if not torch.cuda.is_available():
        proc = subprocess.run([python(), script, "--out", str(tmp_path / "gpu")], capture_output=True, text=True)
        assert proc.returncode == 2 and "no CUDA GPU visible" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "gpu").exists()


@pytest.mark.timeout(300)
def test_the_papers_experiments_script_runs_each_command_in_a_dry_run(tmp_path):
    """benchmarks/gpu_paper_experiments.sh with DRY_RUN=1: Table 1's ablation on 2 gloo processes, the sweep over the
    timestep fraction, the memory curves from its largest fraction and the bfloat16 alignment protocol, each writing
    its tables at the tiny size; the summary holds them all."""
    import json

    proc = run("gpu_paper_experiments.sh", tmp_path, timeout=280, DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    ablation = json.loads((out / "ablation" / "lora" / "ablation.json").read_text())
    assert [r["row"] for r in ablation["rows"]][:1] == ["native"]
    sweep = json.loads((out / "sweep" / "sweep.json").read_text())
    assert [p["value"] for p in sweep["points"]] == ["0.5", "1.0"]
    assert "| retain |" in (out / "memory.md").read_text()
    assert json.loads((out / "alignment" / "equivalence.json").read_text())
    summary = (out / "summary.md").read_text()
    assert all(f"## {part}" in summary for part in ("Table 1", "Fig. 3", "Fig. 6", "App. E"))
