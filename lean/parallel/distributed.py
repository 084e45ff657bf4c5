"""The process layout of a run, from Accelerate: one process, several CPU processes on gloo, several GPUs on NCCL.

Every process group gets a timeout (``train.dist_timeout_s``), so a dead or stalled peer makes the others fail with a
message instead of hanging. Launching is Accelerate's (``lean launch`` only chooses its flags).

Sequence parallelism (``parallel.sequence_parallel: P``) groups consecutive processes: ranks kP .. kP+P-1 hold the same
trajectories and split their tokens (``lean.models.sequence_parallel``), and the W/P groups are the data-parallel
ranks. So ``lean launch -n 4`` with P = 2 is 2 data-parallel x 2 sequence-parallel processes: the 2-D mesh

    rank = d * P + s        d: data-parallel index (``data_rank``), s: place in the sequence-parallel group

that :func:`device_mesh` names ("dp", "sp"); Ulysses splits over "sp", FSDP shards over both
(``lean.parallel.sharding``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import ParamSpec, TypeVar

import torch

from lean.observe.metrics import default_heap


@dataclass(frozen=True)
class World:
    """This process's place in the run: rank, number of processes, its device, and the Accelerator behind them."""

    accelerator: object | None = None
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    sequence_parallel: int = 1  # processes per sequence-parallel group (1: none)
    sequence_group: object | None = None  # this process's group (a torch.distributed ProcessGroup) when above 1
    host_group: object | None = None  # the same ranks on gloo: host values gathered beside the group's all-to-alls

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which share of the batch this process holds: its sequence-parallel group's index."""
        return self.rank // self.sequence_parallel

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: processes / sequence_parallel."""
        return self.size // self.sequence_parallel

    @property
    def sequence_rank(self) -> int:
        """This process's place in its sequence-parallel group (0 without sequence parallelism)."""
        return self.rank % self.sequence_parallel

    def sequence_share(self, rows: int) -> slice:
        """The contiguous share of ``rows`` rows this process takes when its sequence-parallel group splits work
        that is whole per sample (sizes differ by at most one; every row when there is no group)."""
        p, s = self.sequence_parallel, self.sequence_rank
        return slice(rows * s // p, rows * (s + 1) // p)

    def gather_over_sequence_group(self, value) -> list:
        """Every process's picklable ``value`` of this sequence-parallel group, in group order (host objects: on
        :attr:`host_group`, so a worker thread may call it while the main thread runs the group's all-to-alls)."""
        if self.sequence_parallel == 1:
            return [value]
        every = [None] * self.sequence_parallel
        torch.distributed.all_gather_object(every, value, group=self.host_group)
        return every

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's ``x`` concatenated along dim 0, in rank order (``x`` itself on one process);
        the processes of a sequence-parallel group hold the same ``x``, so one copy of each is kept."""
        if self.size == 1:
            return x
        every = self.accelerator.gather(x)
        if self.sequence_parallel == 1:
            return every
        return every.unflatten(0, (self.size, -1))[:: self.sequence_parallel].flatten(0, 1)

    def all_reduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Average ``x`` over processes, in place (a value a sequence-parallel group holds replicated: over the
        data-parallel ranks)."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
            x /= self.size
        return x

    def reduce_gradients_(self, x: torch.Tensor) -> torch.Tensor:
        """A gradient summed over each sequence-parallel group (its processes hold shares of it,
        ``lean.parallel.overlap.sequence``) and averaged over the data-parallel ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
            x /= self.data_size
        return x

    def average_replicated_(self, x: torch.Tensor) -> torch.Tensor:
        """A gradient each process holds whole (a sequence-parallel group's processes the same one, not shares of it):
        averaged over the data-parallel ranks, in place. The certificate's float64 twin, which is not split."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
            x /= self.size
        return x

    def main_value(self, value):
        """The main process's ``value`` on every process (a picklable object): one decision for all of them."""
        if self.size == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def wait_for_everyone(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()


MESH_DIMS = ("dp", "sp")  # data-parallel ranks x processes of one sequence-parallel group


def device_mesh(world: World):
    """The run's 2-D ``DeviceMesh`` (``init_device_mesh`` with :data:`MESH_DIMS`): ``mesh["dp"]`` are the processes
    holding the same tokens of different samples, ``mesh["sp"]`` this process's sequence-parallel group (the ranks
    of ``world.sequence_group``). A collective: every process calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(world.device.type, (world.data_size, world.sequence_parallel), mesh_dim_names=MESH_DIMS)


def set_threads(threads: int | None) -> None:
    """Torch's intra-op threads for this process; None or 0: torch's default (left as it is). Tiny models are bound
    by per-op overhead, and on a shared machine a thread that waits for a busy core makes every op slower."""
    if threads:
        torch.set_num_threads(threads)


def pin_cores(cores: int, index: int = 0) -> list[int]:
    """Let this process (every thread of it) run on ``cores`` of the CPUs it may use (0: all), so that work overlapped
    in a second thread competes for the same core instead of taking an idle one: the ``index``-th group of ``cores``
    from the last CPU (a launch's local rank: each process its own cores, wrapping around when there are too few).
    Returns the CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    chosen = sorted({allowed[-1 - (index * cores + k) % len(allowed)] for k in range(cores)}) if cores else allowed
    set_affinity(chosen)
    return chosen


def set_affinity(cpus) -> None:
    """Every thread of this process on ``cpus`` (Linux: an affinity is per thread; new threads inherit it)."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has ended since the listing
            os.sched_setaffinity(int(thread), cpus)


P, R = ParamSpec("P"), TypeVar("R")


def keeps_process_settings(measure: Callable[P, R]) -> Callable[P, R]:
    """``measure`` (a benchmark) restores on return what it changes of the process to measure: torch's threads, the
    CPU affinity (:func:`pin_cores`) and the heap's thresholds (``lean.observe.metrics.keep_freed_memory``). A
    benchmark called in a longer-lived process (a notebook, a test worker) would otherwise leave it on one core, with
    a heap that never returns memory, and every process it starts afterwards inherits the affinity."""

    @functools.wraps(measure)
    def restoring(*args: P.args, **kwargs: P.kwargs) -> R:
        threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
        try:
            return measure(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
            set_affinity(cpus)
            default_heap()

    return restoring


CPU_TIMEOUT_S, GPU_TIMEOUT_S = 60.0, 1800.0  # gloo on a laptop vs NCCL, where checkpoints and loading take minutes


def init_world(timeout_s: float | None = None, sequence_parallel: int = 1) -> World:
    """The layout Accelerate was launched with (a single process when it was not); ``timeout_s`` (default: by the
    backend) bounds every collective; ``sequence_parallel`` groups of consecutive processes (see the module)."""
    if timeout_s is None:
        timeout_s = GPU_TIMEOUT_S if torch.cuda.is_available() else CPU_TIMEOUT_S
    from accelerate import Accelerator  # local: accelerate takes seconds to import
    from accelerate.utils import InitProcessGroupKwargs

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))],
    )
    world = World(accelerator, accelerator.process_index, accelerator.num_processes, accelerator.device)
    return with_sequence_groups(world, sequence_parallel, timeout_s)


def with_sequence_groups(world: World, sequence_parallel: int, timeout_s: float) -> World:
    """``world`` with its sequence-parallel group made (every process creates every group, as ``new_group`` needs)."""
    if sequence_parallel == 1 or world.size % sequence_parallel:  # the config check names the second case
        return world
    mine = host = None
    for first in range(0, world.size, sequence_parallel):
        ranks = list(range(first, first + sequence_parallel))
        group = torch.distributed.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        on_host = torch.distributed.new_group(ranks, timeout=timedelta(seconds=timeout_s), backend="gloo")
        mine, host = (group, on_host) if world.rank in ranks else (mine, host)
    return dataclasses.replace(world, sequence_parallel=sequence_parallel, sequence_group=mine, host_group=host)
