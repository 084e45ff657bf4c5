"""Multi-process launch through Accelerate, with the CPU pitfalls handled.

On a machine without GPUs, ``accelerate launch --cpu --num_processes N`` starts ONE process and ``--multi_gpu`` alone
starts N processes that never talk to each other. ``ACCELERATE_USE_CPU=1`` together with ``--multi_gpu`` gives N real
gloo ranks. ``lean launch -n N -- <lean command>`` picks the right layout, says which one it got, and runs
``python -m lean.cli <command>`` on every rank.

Multi-node: ``lean launch -n N --nnodes M --node-rank R --master-addr A --master-port P -- <command>`` on each of the M
machines starts N processes there (N x M in all) through Accelerate's multi-machine path (``--num_machines``,
``--machine_rank``, ``--main_process_ip``, ``--main_process_port``; torch's static rendezvous at A:P, which node 0
opens).
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


@dataclass(frozen=True)
class Nodes:
    """This machine's place in a multi-node job; one node by default."""

    count: int = 1
    rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def problem(self) -> tuple[str, object, str] | None:
        """(flag, value, what is wrong) for the first bad field, or None."""
        if self.count < 1:
            return "--nnodes", self.count, "must be >= 1"
        if not 0 <= self.rank < self.count:
            return "--node-rank", self.rank, f"must be in 0..{self.count - 1}"
        if self.count > 1 and not self.master_addr:
            return "--master-addr", self.master_addr, "a multi-node job needs node 0's address"
        if self.count > 1 and not (self.master_port and 0 < self.master_port < 65536):
            return "--master-port", self.master_port, "a multi-node job needs a port (1..65535) open on node 0"
        return None


def choose_layout(num_processes: int, nodes: Nodes = Nodes()) -> Layout:
    """``num_processes`` on this machine (of ``nodes.count`` machines)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nodes.count > 1:
        if gpus and gpus < num_processes:
            raise SystemExit(f"lean launch: asked for {num_processes} processes but only {gpus} GPUs are visible")
        backend = "nccl" if gpus else "gloo"
        return Layout(
            num_processes,
            backend,
            f"node {nodes.rank} of {nodes.count}: {num_processes} process(es) here, {num_processes * nodes.count} in "
            f"all, {backend}, rendezvous at {nodes.master_addr}:{nodes.master_port}",
        )
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


def launch_command(
    layout: Layout, module_args: list[str], extra_accelerate: list[str] = (), nodes: Nodes = Nodes()
) -> tuple[list[str], dict]:
    """The argv and environment that run ``python -m lean.cli module_args`` on every rank of this machine."""
    env = dict(os.environ)
    if layout.num_processes == 1 and nodes.count == 1:
        return [sys.executable, "-m", "lean.cli", *module_args], env
    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(layout.num_processes * nodes.count),  # Accelerate counts the processes of all machines
        "--num_machines",
        str(nodes.count),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    if layout.backend == "gloo":
        env["ACCELERATE_USE_CPU"] = "1"
        # Each rank gets its share of the cores instead of all ranks fighting over all of them.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // layout.num_processes)))
    if nodes.count > 1:
        cmd += ["--machine_rank", str(nodes.rank), "--main_process_ip", nodes.master_addr]
        cmd += ["--main_process_port", str(nodes.master_port)]
    elif not any(a.startswith("--main_process_port") for a in extra_accelerate):
        cmd += ["--main_process_port", str(free_port())]
    cmd += [*extra_accelerate, "-m", "lean.cli", *module_args]
    return cmd, env


def launch(
    num_processes: int,
    module_args: list[str],
    extra_accelerate: list[str] = (),
    quiet: bool = False,
    nodes: Nodes = Nodes(),
) -> int:
    layout = choose_layout(num_processes, nodes)
    if not quiet:
        print(f"lean launch: {layout.description}", file=sys.stderr, flush=True)
    cmd, env = launch_command(layout, module_args, list(extra_accelerate), nodes)
    return subprocess.call(cmd, env=env)
