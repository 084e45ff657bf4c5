"""FlashOverlap: communication/computation overlap by decomposed P2P, for TP+SP, Ulysses and data parallelism.

Every op has the semantics of its collective reference and three methods (``collective | sliced | flash``, see
``p2p.py``); ``sim.py`` models their timelines, ``measure.py`` calibrates the model on a machine, ``projection.py``
projects it onto datasheet GPUs and checks it against published figures, and ``lean.tools.bench.overlap`` measures them
(``lean bench overlap``).
"""

from lean.parallel.overlap.autograd import (
    all_gather_matmul,
    all_to_all_matmul,
    matmul_all_to_all,
    matmul_reduce_scatter,
)
from lean.parallel.overlap.dp import ShardedLinear, data_parallel_linear
from lean.parallel.overlap.modules import SequenceParallelMLP, UlyssesAttention, attention, mlp
from lean.parallel.overlap.p2p import METHODS, Method, Overlap, PeerLost

__all__ = [
    "METHODS",
    "Method",
    "Overlap",
    "PeerLost",
    "SequenceParallelMLP",
    "ShardedLinear",
    "UlyssesAttention",
    "all_gather_matmul",
    "all_to_all_matmul",
    "attention",
    "data_parallel_linear",
    "matmul_all_to_all",
    "matmul_reduce_scatter",
    "mlp",
]
