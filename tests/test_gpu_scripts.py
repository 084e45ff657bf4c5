"""The GPU scripts on a machine without a GPU: they refuse clearly (or fall back, for the overlap benchmark), and
never benchmark a CPU build of torch beside a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable, **env},
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
