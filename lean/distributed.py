"""The process layout of a run, from Accelerate: one process, several CPU processes on gloo, several GPUs on NCCL.

Every process group gets a timeout (``train.dist_timeout_s``), so a dead or stalled peer makes the others fail with a
message instead of hanging. Launching is Accelerate's (``lean launch`` only chooses its flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class World:
    """This process's place in the run: rank, number of processes, its device, and the Accelerator behind them."""

    accelerator: object | None = None
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's ``x`` concatenated along dim 0, in rank order (``x`` itself on one process)."""
        return self.accelerator.gather(x) if self.size > 1 else x

    def all_reduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Average ``x`` over processes, in place."""
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


def set_threads(threads: int | None) -> None:
    """Torch's intra-op threads for this process; None or 0: torch's default (left as it is). Tiny models are bound
    by per-op overhead, and on a shared machine a thread that waits for a busy core makes every op slower."""
    if threads:
        torch.set_num_threads(threads)


CPU_TIMEOUT_S, GPU_TIMEOUT_S = 60.0, 1800.0  # gloo on a laptop vs NCCL, where checkpoints and loading take minutes


def init_world(timeout_s: float | None = None) -> World:
    """The layout Accelerate was launched with (a single process when it was not); ``timeout_s`` (default: by the
    backend) bounds every collective."""
    if timeout_s is None:
        timeout_s = GPU_TIMEOUT_S if torch.cuda.is_available() else CPU_TIMEOUT_S
    from accelerate import Accelerator  # local: accelerate takes seconds to import
    from accelerate.utils import InitProcessGroupKwargs

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))],
    )
    return World(accelerator, accelerator.process_index, accelerator.num_processes, accelerator.device)
