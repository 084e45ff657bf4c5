"""The saved-tensor hooks that move kept graphs off the device (``lean.schedules.offload``): the backward reads the
records alone and gives the same bits, the bytes counted are the saved activations', parameters and inputs stay."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lean.schedules.offload import Moved, PinnedArena, SavedTensorOffload, flat_span, nbytes, span

HOST_MODES = ("count", "copy")


class Tiny(torch.nn.Module):
    """Two linears around a tanh, a transposed view saved by a product, and a square: activations saved twice (the
    tanh's output is also the second linear's input), one non-contiguous."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(6, 10), torch.nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.first(x))  # saved by tanh (its output) and by the second linear (its input)
        z = self.second(h)
        mixed = z.t().sin()  # saves the transposed view z.t(): strides (1, 10)
        return {"loss": (mixed * mixed).sum() + z.pow(2).sum(), "h": h, "z": z, "mixed": mixed}


def gradients(model: torch.nn.Module, x: torch.Tensor, offload: SavedTensorOffload | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if offload is None:
        loss = model(x)["loss"]
    else:
        with offload.saving():
            loss = model(x)["loss"]
        offload.close_group()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", HOST_MODES)
def test_the_backward_through_the_records_gives_the_same_bits(mode):
    model, x = Tiny(), torch.randn(4, 6)
    plain = gradients(model, x, None)
    offload = SavedTensorOffload(mode)
    hooked = gradients(model, x, offload)
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked))
    assert offload.stats.fetched_bytes == offload.stats.moved_bytes > 0


@pytest.mark.parametrize("mode", HOST_MODES)
def test_the_bytes_moved_are_the_saved_activations_once_each(mode):
    """Moved: h once (saved by two ops), z, z.t() and its sine (saved by the product, twice). Left: the input x (a
    leaf, saved for the first weight's gradient) and the second weight's transposed view (for h's gradient; the first
    weight is not saved: x needs no gradient)."""
    model, x = Tiny(), torch.randn(4, 6)
    offload = SavedTensorOffload(mode)
    with offload.saving():
        out = model(x)
    h, z, mixed = out["h"], out["z"], out["mixed"]
    assert offload.stats.moved_bytes == nbytes(h) + 2 * nbytes(z) + nbytes(mixed)
    assert offload.stats.records == 4
    assert offload.stats.resident_bytes == nbytes(model.second.weight) + nbytes(x)


def test_the_copies_free_the_originals_and_a_dry_run_keeps_them():
    """Copy mode: once the forward's own references are gone, no moved original is alive (the device side holds
    nothing of the kept graph); count mode keeps every one of them, as the graph would without hooks."""
    model, x = Tiny(), torch.randn(4, 6)
    live = {}
    for mode in HOST_MODES:
        offload = SavedTensorOffload(mode)
        with offload.saving():
            loss = model(x)["loss"]
        live[mode] = offload.device_live_bytes()
        loss.backward()
    assert live["copy"] == 0
    out = model(x)  # the storages of h, z (z.t() shares it) and sin(z.t())
    assert live["count"] == nbytes(out["h"]) + nbytes(out["z"]) + nbytes(out["mixed"])


def test_a_checkpointed_block_packs_only_its_inputs():
    """Non-reentrant checkpointing (``lean.models.policy``) saves the block's input before its own hooks take over:
    that input is what moves, and the gradients are the same bits."""
    model, x = Tiny(), torch.randn(4, 6)

    def run(offload):
        model.zero_grad(set_to_none=True)
        with offload.saving() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            h = torch.tanh(model.first(x))
            z = checkpoint(lambda a: model.second(a).sin(), h, use_reentrant=False)
        z.sum().backward()
        return h, [p.grad.clone() for p in model.parameters()]

    _, plain = run(None)
    offload = SavedTensorOffload("copy")
    h, hooked = run(offload)
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked))
    assert offload.stats.moved_bytes == nbytes(h) and offload.stats.records == 1


def test_a_copy_keeps_the_strides_of_any_view():
    """A copy holds the view's span of its storage with the view's strides: a permuted view (dense: its numel), a
    strided slice (its gaps too), an expanded one (stride 0: one row, not the broadcast)."""
    base = torch.arange(24.0).view(2, 3, 4)
    views = {
        "permuted": (base.permute(2, 0, 1), 24),
        "strided": (base[:, :, ::2], 23),  # from element 0 to 22
        "expanded": (base[0, 0].expand(5, 4), 4),
    }
    arena = PinnedArena(pinned=False)
    for name, (view, elements) in views.items():
        assert span(view) == elements, name
        host = arena.take_like(view)
        flat_span(host).copy_(flat_span(view))
        assert torch.equal(host, view) and host.stride() == view.stride(), name


def test_the_arena_grows_by_chunks_and_rewinds():
    arena = PinnedArena(pinned=False, chunk_bytes=1024)
    small, large = torch.ones(10), torch.ones(600)  # 40 bytes (512 with alignment), 2400 bytes (a chunk of its own)
    first = arena.take_like(small)
    arena.take_like(small)
    arena.take_like(small)  # a third does not fit the first 1024-byte chunk: a second chunk
    arena.take_like(large)
    assert len(arena.chunks) == 3 and arena.capacity_bytes == 1024 + 1024 + 2400
    high = arena.high_water
    arena.rewind()
    again = arena.take_like(small)
    assert again.data_ptr() == first.data_ptr() and len(arena.chunks) == 3 and arena.high_water == high


def test_groups_and_a_bad_mode():
    model, x = Tiny(), torch.randn(4, 6)
    offload = SavedTensorOffload("count")
    for _ in range(2):  # the same step twice: each group its own records
        with offload.saving():
            model(x)
        offload.close_group()
    assert offload.stats.groups == 2 and offload.stats.records == 8
    offload.reset()
    assert offload.groups == [[]]
    with pytest.raises(ValueError, match="offload mode"):
        SavedTensorOffload("disk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_gives_the_same_bits_and_prefetches_in_reverse():
    """Three groups (three forwards), one backward over all: the backward reads the last group first (one demand
    fetch), and each first read of a group prefetches the one before it."""
    model, x = Tiny().cuda(), torch.randn(4, 6, device="cuda")

    def three(offload):
        model.zero_grad(set_to_none=True)
        losses = []
        for k in range(3):
            with offload.saving() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                losses.append(model(x * (k + 1))["loss"])
            if offload:
                offload.close_group()
        sum(losses).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = three(None)
    offload = SavedTensorOffload("cuda", window_bytes=2**20)
    hooked = three(offload)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked))
    assert offload.stats.demand_fetches == 1 and offload.stats.fetched_bytes == offload.stats.moved_bytes
    offload.reset()


def test_a_freed_original_is_not_mistaken_for_a_later_tensor_at_its_address():
    """Copy mode drops each original once copied; the allocator may hand its address to the next tensor of the same
    shape. Records are matched by the storage object (alive), not the address, so each gets its own copy."""
    torch.manual_seed(0)
    weight, x = torch.nn.Parameter(torch.randn(64, 64)), torch.randn(8, 64)

    def chain(offload):
        weight.grad = None
        with offload.saving() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = x @ weight
            for _ in range(6):
                y = (y * 1.5).sin()  # sin saves y * 1.5, freed (copy mode) before the next is made
        y.sum().backward()
        return weight.grad.clone()

    offload = SavedTensorOffload("copy")
    assert torch.equal(chain(None), chain(offload))
    assert offload.stats.records == 6  # each sine's input (x @ weight saves only x, a leaf, for the weight's gradient)


def test_a_tiny_flux_step_through_the_hooks():
    """One tracked step of the tiny FLUX policy (attention, norms, rotary embeddings, LoRA): the same gradient bits
    through the copies, and what the hooks see (moved + left in place) is what ``lean plan``'s probe counts as the
    step's saved tensors (``SavedBytes``: each storage once) to 10%."""
    from helpers import tiny

    from lean.observe.metrics import SavedBytes
    from lean.parallel.distributed import World
    from lean.run.iteration import build_pipeline
    from lean.sampling.rollout import Sampler, policy_step
    from lean.sampling.transition import Transition

    pipe = build_pipeline(tiny("model.family=flux"), World(device=torch.device("cpu")))
    batch = pipe.local_batch(0)
    policy, params = pipe.policy, [p for _, p in pipe.policy.trainable_parameters()]
    emb, x = policy.encode_prompts(batch.prompts), policy.init_latents(batch.generators)
    rows, noise = slice(0, len(batch.prompts)), torch.randn(x.shape, generator=torch.Generator().manual_seed(0))

    def step(hooks):
        for p in params:
            p.grad = None
        with hooks:
            at = Transition(index=torch.zeros(rows.stop, dtype=torch.long), rows=rows, sample=x)
            out = policy_step(policy, Sampler(pipe.cfg.sample, pipe.sigmas), at, emb, noise=noise)
        out.log_prob.sum().backward()
        return [p.grad.clone() for p in params]

    plain, saved = step(contextlib.nullcontext()), SavedBytes()
    step(saved.watching())
    offload = SavedTensorOffload("copy")
    hooked = step(offload.saving())
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked))
    total, moved = saved.take_split()  # SavedBytes leaves out the parameters, which the offload leaves in place
    assert abs(offload.stats.moved_bytes - moved) <= 0.1 * moved  # spans of views against whole storages
    assert moved <= total <= offload.stats.moved_bytes + offload.stats.resident_bytes


def test_one_backward_over_several_steps_reads_them_in_reverse():
    """What the prefetch rests on: one backward over independent steps' graphs (each from its own detached input, as
    the rollout's) runs every node of the latest step before any of the step before it (the engine takes the highest
    sequence number first), so the groups are read last first, each group in one run."""
    model, x = Tiny(), torch.randn(4, 6)
    offload, order = SavedTensorOffload("count"), []
    read = offload.unpack

    def unpack(record):
        if isinstance(record, Moved) and (not order or order[-1] != record.group):
            order.append(record.group)
        return read(record)

    offload.unpack = unpack
    losses = []
    for k in range(3):
        with offload.saving():
            losses.append(model(x * (k + 1))["loss"])
        offload.close_group()
    sum(losses).backward()
    assert order == [2, 1, 0]
