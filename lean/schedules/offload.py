"""Kept graphs' saved tensors moved off the device between the rollout and the backward (``docs/design/
retain-offload.md``).

Retain keeps, per tracked step, every tensor autograd saves for that step's backward; they are written once during
the rollout and read once in the backward, in reverse order. :class:`SavedTensorOffload` installs
``torch.autograd.graph.saved_tensors_hooks``: ``pack`` replaces each saved activation by a record of a host copy,
``unpack`` brings it back. Three modes:

    count   nothing moves: the record holds the tensor; the bytes that would move are counted (a dry run, what
            ``lean plan``'s count is checked against)
    copy    the data path without CUDA: a copy in an arena of plain memory, the original released; on a CPU the
            "host" is the same memory, and the backward provably reads only the copies
    cuda    pinned host arena; the copy on a side stream as the tensor is produced (an event after it, the original
            held until the event has passed); the backward's first read of a group fetches it and prefetches the group
            produced before it, which the backward needs next

What stays where it is (a :class:`Resident` record, counted apart): parameters and views of them (resident anyway;
FSDP2 frees and re-gathers its unsharded parameters itself, so the same object must come back), and leaves (the
caller's inputs: latents, prompt embeddings; they outlive the step). Everything moved has a ``grad_fn``: an activation
of the tracked forward. A view is copied once however many ops save it (records are deduplicated by the live storage,
offset, shape, strides and dtype), with its strides: the copy holds the view's span of its storage, so the backward's
kernels see the same layout and give the same bits.

Bytes: moved = sum over distinct saved views v with a grad_fn of span(v) x itemsize(v) (``numel`` for a dense view);
each crosses the link once each way.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from lean.observe.metrics import nbytes, span, stays_on_device

OFFLOAD_MODES = ("count", "copy", "cuda")
ALIGN_BYTES = 512  # host offsets aligned for the DMA engines (and for any dtype's view)
CHUNK_BYTES = 256 * 2**20  # the arena grows by chunks of this, or of one larger tensor


def offload_mode(device: torch.device) -> str:
    """The mode that moves a ``device``'s tensors: ``cuda`` on a CUDA device, else ``copy`` (the host is the same
    memory)."""
    return "cuda" if device.type == "cuda" else "copy"


def flat_span(t: torch.Tensor) -> torch.Tensor:
    """``t``'s :func:`span` as a 1-D view of its storage (from its storage offset)."""
    return t.detach().as_strided((span(t),), (1,))


def laid_out_like(flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``flat`` (1-D, :func:`span` elements of ``t.dtype``) viewed with ``t``'s shape and strides: the same layout, so
    the backward's kernels take the same paths and round alike."""
    return flat.as_strided(t.shape, t.stride())


class HostMemoryExceeded(MemoryError):
    """The offloaded graphs would take more host memory than the process may pin."""

    def __init__(self, needed: int, limit: float):
        self.needed, self.limit = needed, limit
        super().__init__(f"{needed / 2**20:.0f} MiB of host memory needed, {limit / 2**20:.0f} MiB allowed")


class PinnedArena:
    """A bump allocator over chunks of host memory (pinned for CUDA copies), kept across iterations.

    The records of one backward are taken in production order and all released after it, so a stack is enough:
    :meth:`take` hands out the next aligned bytes, :meth:`rewind` starts over. Unlike torch's pinned allocator it does
    not round a request up to a power of two, and it calls ``cudaHostAlloc`` only when it grows."""

    def __init__(self, pinned: bool, chunk_bytes: int = CHUNK_BYTES, limit_bytes: float | None = None):
        self.pinned, self.chunk_bytes, self.limit_bytes = pinned, chunk_bytes, limit_bytes
        self.chunks: list[torch.Tensor] = []  # uint8 buffers
        self.chunk, self.offset = 0, 0  # where the next take starts
        self.high_water = 0  # the most bytes taken between two rewinds

    @property
    def capacity_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    @property
    def taken_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks[: self.chunk]) + self.offset

    def take_like(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory for a copy of ``t``: its shape, dtype and strides (:func:`laid_out_like`)."""
        size = nbytes(t)
        while self.chunk < len(self.chunks) and self.offset + size > self.chunks[self.chunk].numel():
            self.chunk, self.offset = self.chunk + 1, 0
        if self.chunk == len(self.chunks):
            grown = max(size, self.chunk_bytes)
            if self.limit_bytes is not None and self.capacity_bytes + grown > self.limit_bytes:
                raise HostMemoryExceeded(self.capacity_bytes + grown, self.limit_bytes)
            self.chunks.append(torch.empty(grown, dtype=torch.uint8, pin_memory=self.pinned))
        flat = self.chunks[self.chunk][self.offset : self.offset + size].view(t.dtype)
        self.offset += -(-size // ALIGN_BYTES) * ALIGN_BYTES
        self.high_water = max(self.high_water, self.taken_bytes)
        return laid_out_like(flat, t)

    def rewind(self) -> None:
        """Every copy taken is dead: start over at the first chunk."""
        self.chunk, self.offset = 0, 0


@dataclass
class OffloadStats:
    """What the hooks did (bytes per process)."""

    moved_bytes: int = 0  # device -> host (in count mode: what would move)
    fetched_bytes: int = 0  # host -> device, each record once
    resident_bytes: int = 0  # saved tensors left in place (parameters, leaves), each view once per group
    records: int = 0  # distinct views moved
    groups: int = 0  # closed groups (a tracked step's forwards of one micro-batch)
    demand_fetches: int = 0  # cuda: groups the backward read before any prefetch (0 when the order is the reverse)


class Resident:
    """A saved tensor left where it is."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class Moved:
    """A saved tensor's record: ``host`` (count mode: the tensor itself), and on CUDA the events of its copies and its
    copy back on the device once fetched."""

    __slots__ = ("host", "device", "group", "stored", "fetched", "on_device", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: int, stored=None):
        self.host, self.device, self.group = host, device, group
        self.stored = stored  # cuda: event after the device -> host copy
        self.fetched = None  # cuda: event after the host -> device copy; elsewhere True once read
        self.on_device: torch.Tensor | None = None


class SavedTensorOffload:
    """The saved-tensor hooks of one schedule's kept graphs (module docstring). ``window_bytes`` (cuda): the most
    bytes whose device -> host copy may be in flight; beyond it the compute stream waits for the oldest copy (device
    memory stays bounded; None: unbounded, released as the copies complete)."""

    def __init__(self, mode: str, window_bytes: int | None = None, host_limit_bytes: float | None = None):
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offload mode {mode!r}: one of {', '.join(OFFLOAD_MODES)}")
        if mode == "cuda" and not torch.cuda.is_available():
            raise ValueError("offload mode 'cuda' needs a CUDA device")
        self.mode, self.window_bytes = mode, window_bytes
        self.arena = PinnedArena(mode == "cuda", limit_bytes=host_limit_bytes) if mode != "count" else None
        self.stats = OffloadStats()
        # this group's records by view, with a weak reference to the storage they were made from: an address alone
        # could be a freed original's, reused by a later tensor
        self.seen: dict[tuple, tuple[weakref.ref, Moved | Resident]] = {}
        self.groups: list[list[weakref.ref]] = [[]]  # each group's records (weakly: the graph owns them); last: open
        self.prefetched: set[int] = set()  # cuda: groups whose copy back has started
        self.in_flight: list[tuple[object, torch.Tensor]] = []  # cuda: (event, original) until its copy is done
        self.in_flight_bytes = 0
        self.live: dict[int, int] = {}  # storages of moved originals still alive: their key -> bytes
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream()) if mode == "cuda" else None  # (d2h, h2d)

    @contextlib.contextmanager
    def saving(self):
        """The hooks on: every tensor autograd saves inside goes through :meth:`pack`."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self

    def close_group(self) -> None:
        """The forwards of one group (a tracked step of one micro-batch) are done; later packs open the next."""
        self.stats.groups += 1
        self.seen = {}
        self.groups.append([])
        if self.streams is not None:  # originals whose copies are done go now, not at the next group's first pack
            self._release_copied(wait=False)

    def reset(self) -> None:
        """After the backward: every record is dead; the arena starts over."""
        self.groups, self.seen, self.prefetched = [[]], {}, set()
        self._release_copied(wait=True)
        if self.streams is not None:  # the next copies into the arena start after the last copies out of it
            d2h, h2d = self.streams
            d2h.wait_stream(h2d)
        if self.arena is not None:
            self.arena.rewind()

    def device_live_bytes(self) -> int:
        """Bytes of the moved tensors' original storages still alive (count: all of them; copy: what something
        beside the graph holds; cuda: also the copies in flight)."""
        return sum(self.live.values())

    # ------------------------------------------------------------ the hooks

    def pack(self, t: torch.Tensor) -> Moved | Resident:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if key in self.seen and self.seen[key][0]() is storage:  # the same view of a live storage: saved again
            return self.seen[key][1]
        if stays_on_device(t) or (self.mode == "cuda" and t.device.type != "cuda"):
            record = Resident(t)
            self.stats.resident_bytes += nbytes(t)
        else:
            record = self._move(t)
            self.stats.moved_bytes += nbytes(t)
            self.stats.records += 1
            self.groups[-1].append(weakref.ref(record))
            self._watch(storage)
        self.seen[key] = (weakref.ref(storage), record)
        return record

    def unpack(self, record: Moved | Resident) -> torch.Tensor:
        if isinstance(record, Resident):
            return record.tensor
        if self.mode != "cuda":
            if record.fetched is None:
                record.fetched = True
                self.stats.fetched_bytes += nbytes(record.host)
            return record.host
        self._release_copied(wait=False)  # the rollout's last originals, before the backward allocates
        if record.fetched is None:  # read before any prefetch reached its group
            self.stats.demand_fetches += 1
            self._fetch(record.group)
        return self._arrived(record)

    # ------------------------------------------------------------ moving

    def _move(self, t: torch.Tensor) -> Moved:
        group = len(self.groups) - 1
        if self.mode == "count":
            return Moved(t, t.device, group)
        host = self.arena.take_like(t)
        if self.mode == "copy":
            flat_span(host).copy_(flat_span(t))
            return Moved(host, t.device, group)
        d2h, _ = self.streams
        d2h.wait_stream(torch.cuda.current_stream(t.device))  # the producer's writes first
        with torch.cuda.stream(d2h):
            flat_span(host).copy_(flat_span(t), non_blocking=True)
            stored = torch.cuda.Event()
            stored.record(d2h)
        self.in_flight.append((stored, t))
        self.in_flight_bytes += nbytes(t)
        self._release_copied(wait=False)
        return Moved(host, t.device, group, stored)

    def _release_copied(self, wait: bool) -> None:
        """Drop the originals whose copy is done; over ``window_bytes`` in flight (or ``wait``), make the compute
        stream wait for the oldest first (a block reused after that wait is written only after the copy read it)."""
        while self.in_flight:
            stored, original = self.in_flight[0]
            over = self.window_bytes is not None and self.in_flight_bytes > self.window_bytes
            if not (stored.query() or over or wait):
                return
            torch.cuda.current_stream(original.device).wait_event(stored)
            self.in_flight.pop(0)
            self.in_flight_bytes -= nbytes(original)

    def _fetch(self, group: int) -> None:
        """Copy group ``group``'s live records back to the device on the h2d stream (each after its own d2h copy)."""
        if group < 0 or group in self.prefetched:
            return
        self.prefetched.add(group)
        _, h2d = self.streams
        for ref in self.groups[group]:
            record = ref()
            if record is None or record.fetched is not None:
                continue
            self.stats.fetched_bytes += nbytes(record.host)
            with torch.cuda.stream(h2d):
                h2d.wait_event(record.stored)
                flat = torch.empty(span(record.host), dtype=record.host.dtype, device=record.device)
                flat.copy_(flat_span(record.host), non_blocking=True)
                record.on_device = laid_out_like(flat, record.host)
                record.fetched = torch.cuda.Event()
                record.fetched.record(h2d)

    def _arrived(self, record: Moved) -> torch.Tensor:
        """A fetched record's device tensor, usable on the current stream; the first read of a group prefetches the
        group before it (the backward runs the groups in reverse)."""
        current = torch.cuda.current_stream(record.device)
        current.wait_event(record.fetched)
        record.on_device.record_stream(current)  # allocated on h2d, read here
        self._fetch(record.group - 1)
        return record.on_device

    def _watch(self, storage: torch.UntypedStorage) -> None:
        """Count a moved original's ``storage`` in :meth:`device_live_bytes` until it is freed."""
        key = storage._cdata
        if key not in self.live:
            self.live[key] = storage.nbytes()
            weakref.finalize(storage, self.live.pop, key, None)
