"""The three communication patterns behind every overlap op, each run by one of three methods.

A pattern moves a tensor that is cut into P chunks, one per rank of the group, each chunk ``rows`` rows long
(dimension 0). The op's computation enters as callbacks on *blocks*: a block ``(peers, rows)`` holds the chunks of the
group ranks in the slice ``peers`` (leading dimension), restricted to the slice ``rows`` (second dimension).

    all_gather_apply(chunk, consume)        consume(j, :, chunk_j) for every rank j      (gather, then compute)
    reduce_scatter_apply(produce)           returns sum over ranks q of produce_q(me, :)  (compute, then reduce)
    all_to_all_apply(produce, consume)      consume(j, :, produce_j(me, :)) for every j   (compute, swap, compute)
                                            (or just keep the blocks, received in place: ``into``)

Methods (what runs while the GEMMs run):
    collective  one collective on the whole tensor and one callback on the whole block: nothing overlaps.
    sliced      the rows are cut into ``slices`` slices; the collective of slice i is in flight while slice i+-1
                computes. The first gather (or the last reduce-scatter / all-to-all) has nothing left to hide behind:
                that exposed slice is the tail.
    flash       one P2P step (``batch_isend_irecv``) per peer chunk, each in flight while a chunk GEMM runs.
                All-gather: a ring that consumes the local chunk first while the first transfer flies (optionally
                both ways round the ring: half the steps). Reduce-scatter: a ring whose partial sums are accumulated
                while they travel and whose last step computes the local chunk, so after the last GEMM only its own
                accumulate remains, no transfer and no separate reduction (16-bit dtypes: an all-to-all and float32
                sums instead, see below). All-to-all: each block is sent as soon as
                it is computed, the local block is computed last (and, on the receiving side, consumed first).

Precision of the sums over ranks (reduce-scatter; all_to_all_matmul and the data-parallel forward also sum over
peers): every rank's partial p_j is its GEMM's output, rounded once to the tensor's dtype (the GEMM itself accumulates
in float32); the partials are summed in :func:`accumulation_dtype` (float32 for float16/bfloat16, the dtype itself
otherwise) and the sum is rounded once at the end. With the dtype's unit roundoff u (bfloat16 2^-8, float16 2^-11) each
element of y = sum_j x_j w_j comes out with

    |fl(y) - y| <= u |y| + u sum_j |x_j w_j|        (+ O(u^2), and float32 terms of order P 2^-24 sum_j |x_j w_j|),

whereas a running sum kept in 16 bits rounds again at every hop: u (|S_2| + .. + |S_{P-1}|) more, S_t the sum of the
first t partials in the ring's order. That is what a 16-bit ``torch.distributed.reduce_scatter`` does: gloo reduces
in ``c10::BFloat16`` / ``gloo::float16``, which round each add (``tests/test_overlap.py`` counts its misses), and
NCCL's ring stores each hop's partial sum in the tensor's dtype (NVIDIA/nccl#1026; hence FSDP's ``reduce_dtype`` and
Megatron-LM's reduce-scatter with fp32 accumulation, a 16-bit all-to-all plus a float32 local sum, the scheme below).
So the 16-bit paths of every method avoid it:

    float32/float64  the running sum travels in the accumulation dtype already: the flash ring and the collective
                     (``reduce_scatter``) are used as they are, no extra copy.
    16-bit           a travelling sum would be rounded at every hop, and sending it as float32 would double the bytes
                     of a transfer that barely hides as it is (``sim.H200``: a bfloat16 partial's transfer takes
                     2060/k times its GEMM of inner size k: 0.57 for Llama-70B's down projection at TP=8, k = 3584,
                     1.15 in float32).
                     So each partial travels once, in its own dtype, straight to the rank that owns its rows: an
                     all-to-all by the same method (``collective``: one ``all_to_all_single``; ``sliced``: one per
                     slice; ``flash``: one P2P step per peer, the local chunk computed last), the same (P-1)/P of the
                     partial per rank as a ring reduce-scatter, and the owner sums the P blocks in one reduction
                     with a float32 accumulator (``_exchange_and_sum``: fewer passes over memory than the ring's adds;
                     flash has that reduction left after its last GEMM where the ring has one add). The timeline
                     model (``sim.projection``, 4096 tokens at TP=8 on an H200, flash) gives the MLP's fc2 0.74 ms
                     against 0.79 ms for the 16-bit ring that rounds at every hop and 0.85 ms for a float32 ring, and
                     a data-parallel weight gradient 5.8 ms against 6.1 and 6.9.

Every wait has a timeout (gloo: ``Work.wait(timeout)``; NCCL: the process group's timeout and watchdog, because a
timed wait there would block the host and stop it queueing the next GEMM), so a lost peer raises :class:`PeerLost`
instead of hanging. On NCCL the transfers run on NCCL's own streams and ``Work.wait`` only orders the compute stream
after them, so the same code overlaps on GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from lean.config.registry import Registry

Method = Literal["collective", "sliced", "flash"]
METHODS: tuple[str, ...] = get_args(Method)
OVERLAP_METHODS: Registry[str] = Registry(
    "overlap method",
    [
        ("collective", "one collective after the whole GEMM (the baseline)"),
        ("sliced", "the GEMM in slices, each slice's collective overlapping the next slice's compute"),
        ("flash", "one P2P transfer per peer, each block sent as soon as it is computed"),
    ],
)
assert OVERLAP_METHODS.names == METHODS
DEFAULT_TIMEOUT_S = 60.0

Produce = Callable[[slice, slice], Tensor]  # (peers, rows) -> block of shape (n_peers, n_rows, ...)
Consume = Callable[[slice, slice, Tensor], None]  # (peers, rows, block); must copy what it keeps of block

# Recent torch names the tensor collectives *_single (the *_into_tensor / *_tensor names warn); older ones lack them.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PeerLost(RuntimeError):
    """A transfer did not complete within the timeout (a peer died, hung or took another code path)."""


@dataclass(frozen=True)
class Overlap:
    """How an op communicates: the method, the group and the method's knobs.

    ``slices``: number of slices for ``sliced`` (default: the world size, the same granularity as ``flash``).
    ``bidirectional``: ``flash`` all-gather sends round the ring both ways (ceil((P-1)/2) steps instead of P-1).
    ``timeout``: seconds any single wait may take before :class:`PeerLost` is raised.
    ``loopback``: every transfer replaced by a local copy of the same bytes (this rank's own data where a peer's would
    arrive): the same GEMMs and copies with no communication, wrong numbers. Only for timing the compute-only run that
    exposed communication is measured against (``lean bench schedules`` under sequence parallelism).
    """

    method: Method = "flash"
    group: dist.ProcessGroup | None = None
    slices: int | None = None
    bidirectional: bool = False
    timeout: float = DEFAULT_TIMEOUT_S
    loopback: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown overlap method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.slices is not None and self.slices < 1:
            raise ValueError(f"slices must be >= 1, got {self.slices}")

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def peer(self, j: int) -> int:
        """Global rank of group rank ``j`` (taken modulo the world size)."""
        j %= self.world
        return j if self.group is None else dist.get_global_rank(self.group, j)


@dataclass(frozen=True)
class SimulatedOverlap(Overlap):
    """Rank 0 of a group of ``size`` that does not exist: every transfer a local copy (``loopback``), so a model runs
    its sequence-parallel code at one rank's shapes with no process group (``lean plan`` counts it on the meta
    device, ``lean.plan.meta``)."""

    size: int = 1
    loopback: bool = True

    @property
    def world(self) -> int:
        return self.size

    @property
    def rank(self) -> int:
        return 0


def as_overlap(
    method: Method | Overlap,
    group: dist.ProcessGroup | None = None,
    slices: int | None = None,
    bidirectional: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Overlap:
    """``method`` itself if it is an :class:`Overlap`, else one built from the arguments."""
    return method if isinstance(method, Overlap) else Overlap(method, group, slices, bidirectional, timeout)


def divisible_rows(x: Tensor, world: int, op: str) -> int:
    """Rows per rank of ``x`` split over dimension 0; refuses shapes that do not split evenly."""
    if x.shape[0] % world:
        raise ValueError(
            f"{op}: dimension 0 of the input with shape {tuple(x.shape)} is {x.shape[0]}, "
            f"not divisible by the world size {world}"
        )
    return x.shape[0] // world


def row_slices(rows: int, slices: int) -> list[slice]:
    """``slices`` contiguous, nearly equal slices covering ``range(rows)`` (never empty ones)."""
    n = max(1, min(slices, rows))
    bounds = [rows * i // n for i in range(n + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def wait(works: Sequence[dist.Work], ov: Overlap, what: str) -> None:
    """Waits for ``works``; a transfer that fails or outlasts ``ov.timeout`` raises :class:`PeerLost` naming ``what``.

    On NCCL the wait only orders the current stream after the transfer; the process group's timeout applies there.
    """
    if not works:  # loopback: nothing was posted
        return
    timeout = None if dist.get_backend(ov.group) == "nccl" else timedelta(seconds=ov.timeout)
    try:
        for work in works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
    except RuntimeError as e:
        raise PeerLost(f"rank {dist.get_rank()}: {what} did not complete (timeout {ov.timeout:g}s): {e}") from e


def exchange(sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]], ov: Overlap) -> list[dist.Work]:
    """Posts the sends and receives (tensor, group rank) as one ``batch_isend_irecv``; returns the works. (Every
    caller pairs the i-th send with an i-th receive of the same shape, which is what ``loopback`` copies.)"""
    if ov.loopback:
        for (sent, _), (received, _) in zip(sends, recvs, strict=True):
            received.copy_(sent)
        return []
    ops = [dist.P2POp(dist.isend, t, ov.peer(j), ov.group) for t, j in sends]
    ops += [dist.P2POp(dist.irecv, t, ov.peer(j), ov.group) for t, j in recvs]
    return dist.batch_isend_irecv(ops)


def post_all_gather(out: Tensor, chunk: Tensor, ov: Overlap) -> list[dist.Work]:
    """``out`` (world x chunk's rows) <- every rank's ``chunk``, posted; loopback: ``chunk`` repeated."""
    if ov.loopback:
        out.view(-1, *chunk.shape).copy_(chunk)
        return []
    return [_all_gather(out, chunk, group=ov.group, async_op=True)]


def post_reduce_scatter(out: Tensor, full: Tensor, ov: Overlap) -> list[dist.Work]:
    """``out`` <- this rank's rows of the sum over ranks of ``full``, posted; loopback: its own rows."""
    if ov.loopback:
        out.copy_(full.view(-1, *out.shape)[ov.rank])
        return []
    return [_reduce_scatter(out, full, group=ov.group, async_op=True)]


def post_all_to_all(recv: Tensor, send: Tensor, ov: Overlap) -> list[dist.Work]:
    """``recv`` <- block r of every rank's ``send``, posted; loopback: ``send`` itself."""
    if ov.loopback:
        recv.copy_(send)
        return []
    return [dist.all_to_all_single(recv, send, group=ov.group, async_op=True)]


def _one(j: int, world: int) -> slice:
    j %= world
    return slice(j, j + 1)


_ALL = slice(None)


def all_gather_apply(chunk: Tensor, consume: Consume, ov: Overlap) -> None:
    """Calls ``consume`` on every rank's ``chunk`` (as blocks), the all-gather overlapped with the calls."""
    world, me, chunk = ov.world, ov.rank, chunk.contiguous()
    if ov.method == "collective":
        out = chunk.new_empty((world * chunk.shape[0], *chunk.shape[1:]))  # gloo wants the concatenated form
        wait(post_all_gather(out, chunk, ov), ov, "all-gather")
        consume(_ALL, _ALL, out.view(world, *chunk.shape))
        return
    if ov.method == "sliced":  # every slice's gather is queued at once; slice i computes while i+1.. fly
        pending = []
        for rows in row_slices(chunk.shape[0], ov.slices or world):
            out = chunk.new_empty((world * (rows.stop - rows.start), *chunk.shape[1:]))
            pending.append((rows, out, post_all_gather(out, chunk[rows], ov)))  # works: none under loopback
        for rows, out, works in pending:
            wait(works, ov, "sliced all-gather")
            consume(_ALL, rows, out.view(world, -1, *chunk.shape[1:]))
        return
    # flash ring: chunks of ranks me-1, me-2, .. arrive from the left; with `bidirectional` the second half of them
    # (me+1, me+2, ..) arrives from the right instead. Step t consumes what step t-1 received while step t's
    # transfers fly.
    from_left = world // 2 if ov.bidirectional else world - 1
    from_right = world - 1 - from_left
    left = right = chunk.unsqueeze(0)
    ready = [(me, left)]
    for t in range(1, from_left + 1):
        sends, recvs, arriving = [(left, me + 1)], [], []
        left = torch.empty_like(left)
        recvs.append((left, me - 1))
        arriving.append((me - t, left))
        if t <= from_right:
            sends.append((right, me - 1))
            right = torch.empty_like(right)
            recvs.append((right, me + 1))
            arriving.append((me + t, right))
        works = exchange(sends, recvs, ov)
        for j, block in ready:
            consume(_one(j, world), _ALL, block)
        wait(works, ov, f"all-gather ring step {t}")
        ready = arriving
    for j, block in ready:
        consume(_one(j, world), _ALL, block)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums over ranks are accumulated in: float32 for the 16-bit floats, ``dtype`` itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def reduce_scatter_apply(produce: Produce, rows: int, ov: Overlap, dtype: torch.dtype) -> Tensor:
    """Sum over ranks of ``produce(me, :)``, shape ``(rows, ...)``, the reduce-scatter overlapped with ``produce``.

    ``dtype``: that of the blocks ``produce`` returns; 16-bit ones are summed in float32 (see the module docstring).
    """
    if accumulation_dtype(dtype) != dtype:
        return _exchange_and_sum(produce, rows, ov)
    world, me = ov.world, ov.rank
    if ov.method == "collective":
        full = produce(_ALL, _ALL).contiguous()
        out = full.new_empty(full.shape[1:])
        wait(post_reduce_scatter(out, full.flatten(0, 1), ov), ov, "reduce-scatter")
        return out
    if ov.method == "sliced":  # slice i reduces while slice i+1 computes; the last slice's reduction is exposed
        outs, works = [], []
        for part in row_slices(rows, ov.slices or world):
            full = produce(_ALL, part).contiguous()
            outs.append(full.new_empty(full.shape[1:]))
            works += post_reduce_scatter(outs[-1], full.flatten(0, 1), ov)
        wait(works, ov, "sliced reduce-scatter")
        return torch.cat(outs)
    # flash ring: the partial sum of chunk c starts at rank c+1 and travels right, each rank adding its own partial;
    # step t computes the partial of chunk me-1-t while step t-1's sum is in flight, and the last step is chunk `me`.
    works, received = [], None
    for t in range(world):
        partial = produce(_one(me - 1 - t, world), _ALL)
        if t > 0:
            wait(works, ov, f"reduce-scatter ring step {t}")
            partial = partial + received
        if t < world - 1:
            sent, received = partial.contiguous(), torch.empty_like(partial)
            works = exchange([(sent, me + 1)], [(received, me - 1)], ov)
    return partial[0]


def _exchange_and_sum(produce: Produce, rows: int, ov: Overlap) -> Tensor:
    """Sum over ranks of ``produce(me, :)`` by an all-to-all of the blocks and one reduction over them, which PyTorch
    runs with a float32 accumulator for 16-bit floats (``at::acc_type``, CPU and CUDA) and rounds once.

    ``collective`` / ``sliced``: a slice's P blocks arrive together and are reduced straight into its rows of the
    output (P + 1 passes over the output's bytes in all). ``flash``: the blocks arrive one per step, received in place
    in a ``(P, rows, ...)`` stack (the local one, computed last, copied in) that is reduced at the end (P + 3 passes),
    where the ring's P - 1 adds make 3(P - 1)."""
    out: list[Tensor] = []  # made at the first block, which gives the trailing shape

    def allocate_on_first(block: Tensor, leading: tuple[int, ...]) -> Tensor:
        if not out:
            out.append(block.new_empty((*leading, rows, *block.shape[2:])))
        return block

    if ov.method != "flash":

        def consume(peers: slice, part: slice, block: Tensor) -> None:  # block (P, rows of part, ...)
            torch.sum(allocate_on_first(block, ()), 0, out=out[0][part])

        all_to_all_apply(produce, consume, rows, ov)
        return out[0]
    all_to_all_apply(
        lambda peers, part: allocate_on_first(produce(peers, part), (ov.world,)),
        None,
        rows,
        ov,
        into=lambda peers, part: out[0][peers, part],
    )
    return out[0].sum(0)


def all_to_all_apply(
    produce: Produce,
    consume: Consume | None,
    rows: int,
    ov: Overlap,
    into: Callable[[slice, slice], Tensor] | None = None,
) -> None:
    """Rank j's block for this rank, ``produce_j(me, :)``, for every j: kept in ``into(j, rows)`` if given (received
    straight into it where it is contiguous, copied there otherwise) and passed to ``consume`` if given."""
    world, me = ov.world, ov.rank

    def landing(peers: slice, part: slice, like: Tensor) -> tuple[Tensor, bool]:
        """(where the block is received, whether that is already its place in ``into``)."""
        target = into(peers, part) if into is not None else None
        if target is not None and target.is_contiguous():
            return target, True
        return torch.empty_like(like), False

    def arrived(peers: slice, part: slice, block: Tensor, in_place: bool) -> None:
        if into is not None and not in_place:
            into(peers, part).copy_(block)
        if consume is not None:
            consume(peers, part, block)

    pending = []  # (peers, rows, received block, already in place, works), consumed in posting order
    if ov.method in ("collective", "sliced"):
        for part in row_slices(rows, ov.slices or world) if ov.method == "sliced" else [_ALL]:
            send = produce(_ALL, part).contiguous()
            recv, in_place = landing(_ALL, part, send)
            works = post_all_to_all(recv, send, ov)
            pending.append((_ALL, part, recv, in_place, works))
    else:  # flash: step k sends to me+k what was just computed for it, receives from me-k; the local block goes last
        for k in range(1, world):
            send = produce(_one(me + k, world), _ALL).contiguous()
            recv, in_place = landing(_one(me - k, world), _ALL, send)
            works = exchange([(send, me + k)], [(recv, me - k)], ov)
            pending.append((_one(me - k, world), _ALL, recv, in_place, works))
        arrived(_one(me, world), _ALL, produce(_one(me, world), _ALL), False)
    for peers, part, recv, in_place, works in pending:
        wait(works, ov, f"all-to-all from {peers}")
        arrived(peers, part, recv, in_place)
