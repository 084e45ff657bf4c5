"""The timeline model: the simulator's arithmetic, the schedules' closed forms, where the tail is, and the outputs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lean.overlap.sim import (
    COMM,
    COMPUTE,
    H100_SXM,
    H200,
    OpSpec,
    Profile,
    Span,
    Task,
    draw_gantt,
    exposed_intervals,
    layer_ops,
    predict,
    projection,
    schedule,
    simulate,
)

# A chunk's GEMM (4 rows) takes 1 s, a chunk's transfer `transfer_s` s: no latency, no per-call cost, free memory.
UNIT = Profile("unit", flops=8.0, mem_bw=1e30, alpha=0.0, beta=1.0, launch=0.0)


def unit_op(pattern: str, world: int, transfer_s: float, side: str) -> OpSpec:
    return OpSpec("op", pattern, world, (4, 1, 1), (4 * world, 1, 1), int(transfer_s), side, 1)


def test_streams_run_concurrently_and_contention_slows_the_overlapped_part():
    tasks = [Task("gemm", COMPUTE, 2.0), Task("send", COMM, 1.0)]
    assert {s.name: (s.start, s.end) for s in simulate(tasks, UNIT)} == {"gemm": (0, 2), "send": (0, 1)}
    # compute at half speed while the send runs: 0.5 s of work done by t=1, the remaining 1.5 s at full speed
    slowed = {s.name: s.end for s in simulate(tasks, replace(UNIT, compute_slowdown=1.0))}
    assert slowed == pytest.approx({"gemm": 2.5, "send": 1.0})
    chained = simulate([Task("gemm", COMPUTE, 2.0), Task("send", COMM, 1.0, deps=(0,))], UNIT)
    assert max(s.end for s in chained) == 3.0


def test_deadlocked_schedule_is_refused():
    with pytest.raises(ValueError, match="deadlock"):
        simulate([Task("a", COMPUTE, 1.0, deps=(1,)), Task("b", COMM, 1.0, deps=(0,))], UNIT)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_flash_all_gather_closed_forms(world):
    # compute-bound: every transfer hides behind a GEMM, latency = P GEMMs
    assert predict(unit_op("all_gather", world, 0, "consume"), "flash", UNIT).latency == pytest.approx(world)
    fast = predict(
        replace(unit_op("all_gather", world, 1, "consume"), chunk_bytes=1), "flash", replace(UNIT, beta=2.0)
    )  # 0.5 s transfers
    assert fast.latency == pytest.approx(world) and fast.exposed == pytest.approx(0.0)
    # communication-bound: P-1 transfers back to back, then the last GEMM
    slow = predict(unit_op("all_gather", world, 3, "consume"), "flash", UNIT)
    assert slow.latency == pytest.approx(3 * (world - 1) + 1)
    # the collective exposes all of its communication: (P-1) ring steps
    coll = predict(unit_op("all_gather", world, 3, "consume"), "collective", UNIT)
    assert coll.latency == pytest.approx(3 * (world - 1) + world) and coll.hidden_fraction == pytest.approx(0.0)


def test_bidirectional_ring_halves_the_steps():
    op = unit_op("all_gather", 8, 1, "consume")
    one_way = [t for t in schedule(op, "flash", UNIT) if t.stream == COMM]
    two_way = [t for t in schedule(op, "flash", UNIT, bidirectional=True) if t.stream == COMM]
    assert (len(one_way), len(two_way)) == (7, 4)


def test_tail_sliced_ends_on_communication_flash_ends_on_compute():
    op = unit_op("reduce_scatter", 4, 1, "produce")
    last = {m: max(predict(op, m, UNIT, slices=4).spans, key=lambda s: s.end) for m in ("sliced", "flash")}
    assert last["sliced"].stream == COMM  # the last slice's reduce-scatter: nothing left to hide it
    assert last["flash"].stream == COMPUTE  # the local chunk's GEMM and accumulate come last
    sliced, flash = predict(op, "sliced", UNIT, slices=4), predict(op, "flash", UNIT)
    assert flash.exposed == pytest.approx(0.0)
    assert sliced.exposed == pytest.approx(3 * 1 / 4)  # the last slice's (P-1) ring steps of a quarter chunk


@pytest.mark.parametrize("side", ["produce", "consume"])
def test_all_to_all_flash_hides_transfers_shorter_than_a_block(side):
    op = unit_op("all_to_all", 4, 0, side)
    fast = predict(replace(op, chunk_bytes=1), "flash", replace(UNIT, beta=2.0))
    assert fast.exposed == pytest.approx(0.0)
    assert predict(replace(op, chunk_bytes=1), "collective", replace(UNIT, beta=2.0)).exposed > 0


def test_exposed_intervals_are_communication_with_idle_compute():
    spans = [Span("g", COMPUTE, 0, 2, "gemm"), Span("x", COMM, 1, 4, "transfer"), Span("g2", COMPUTE, 3, 3.5, "gemm")]
    assert exposed_intervals(spans) == [(2, 3), (3.5, 4)]


def test_projection_covers_every_case_and_h200_is_never_slower():
    rows = projection({"H100-SXM": H100_SXM, "H200": H200}, token_counts=(4096,))
    assert len(rows) == len(layer_ops(8, 1, 4096, 8192, 57344)) * 2 * 3
    by = {(r["op"], r["method"], r["profile"]): r["latency_ms"] for r in rows}
    for (op, method, prof), latency in by.items():
        assert latency > 0
        if prof == "H200":
            assert latency <= by[op, method, "H100-SXM"] + 1e-9
    flash_fc1 = next(
        r for r in rows if r["op"].startswith("mlp.fc1") and r["method"] == "flash" and r["profile"] == "H100-SXM"
    )
    assert flash_fc1["hidden_fraction"] > 0.5


def test_gantt_is_drawn(tmp_path):
    op = layer_ops(8, 1, 4096, 8192, 57344, element_bytes=2)[0]
    draw_gantt([(m, predict(op, m, H100_SXM)) for m in ("collective", "sliced", "flash")], str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_16_bit_reduce_scatter_is_an_exchange_summed_in_float32():
    op = replace(unit_op("reduce_scatter", 4, 1, "produce"), element_bytes=2)
    names = [t.name for t in schedule(op, "flash", UNIT)]
    assert [n for n in names if n.startswith("to +")] == ["to +1", "to +2", "to +3"] and names[-1] == "sum"
    flash = predict(op, "flash", UNIT)
    assert flash.exposed == pytest.approx(0.0)  # each partial's transfer hides behind the next block's GEMM
    assert predict(op, "collective", UNIT).exposed == pytest.approx(3.0)  # one all-to-all of (P-1) chunks after
