"""Multi-process launch through Accelerate, with the CPU pitfalls handled.

On a machine without GPUs, ``accelerate launch --cpu --num_processes N`` starts ONE process and ``--multi_gpu`` alone
starts N processes that never talk to each other. ``ACCELERATE_USE_CPU=1`` together with ``--multi_gpu`` gives N real
gloo ranks. ``lean launch -n N -- <lean command>`` picks the right layout, says which one it got, and runs
``python -m lean.cli <command>`` on every rank. Multi-node runs pass Accelerate's own flags after ``--accelerate``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    num_processes: int
    backend: str  # nccl | gloo | none
    description: str


def choose_layout(num_processes: int) -> Layout:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_processes == 1:
        where = "1 GPU" if gpus else "CPU"
        return Layout(1, "none", f"single process on {where}")
    if gpus >= num_processes:
        return Layout(num_processes, "nccl", f"{num_processes} processes, one per GPU, NCCL")
    if gpus:
        raise SystemExit(f"lean launch: asked for {num_processes} processes but only {gpus} GPUs are visible")
    return Layout(num_processes, "gloo", f"{num_processes} CPU processes, gloo (ACCELERATE_USE_CPU=1 --multi_gpu)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(layout: Layout, module_args: list[str], extra_accelerate: list[str] = ()) -> tuple[list[str], dict]:
    """The argv and environment that run ``python -m lean.cli module_args`` on every rank."""
    env = dict(os.environ)
    if layout.num_processes == 1:
        return [sys.executable, "-m", "lean.cli", *module_args], env
    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(layout.num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    if layout.backend == "gloo":
        env["ACCELERATE_USE_CPU"] = "1"
        # Each rank gets its share of the cores instead of all ranks fighting over all of them.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // layout.num_processes)))
    if not any(a.startswith("--main_process_port") for a in extra_accelerate):
        cmd += ["--main_process_port", str(free_port())]
    cmd += [*extra_accelerate, "-m", "lean.cli", *module_args]
    return cmd, env


def launch(num_processes: int, module_args: list[str], extra_accelerate: list[str] = (), quiet: bool = False) -> int:
    layout = choose_layout(num_processes)
    if not quiet:
        print(f"lean launch: {layout.description}", file=sys.stderr, flush=True)
    cmd, env = launch_command(layout, module_args, list(extra_accelerate))
    return subprocess.call(cmd, env=env)
