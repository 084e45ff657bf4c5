"""Exactness of the overlap ops and blocks on 2, 3 and 4 gloo processes, and that a lost peer raises.

One process group per world size runs every op x method x dtype case, forward and backward, and writes the relative
errors to a file per rank; the test asserts on them, naming every case that failed. References: the single-process
math on the full tensors (forward and all gradients) and the plain collective followed by the same compute (forward).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lean.launch import free_port

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
VARIANTS = {  # name -> Overlap options
    "collective": {"method": "collective"},
    "sliced": {"method": "sliced"},
    "sliced/2": {"method": "sliced", "slices": 2},
    "flash": {"method": "flash"},
    "flash/bidirectional": {"method": "flash", "bidirectional": True},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.detach() - b.detach()).norm() / b.detach().norm()).item()


def _rows(t: torch.Tensor, r: int, world: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(world, dim)[r]


def _full_grads(fn, tensors: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    return y.detach(), list(torch.autograd.grad(y, leaves, grad_out))


def _op_problems(world: int, r: int, dtype: torch.dtype, g: torch.Generator):
    """Per op: (Function, local inputs, full forward on full inputs, full inputs, local view of full output,
    local views of the full gradients, collective reference forward, whether the weight is replicated)."""
    from lean.overlap import autograd as ag
    from lean.overlap.dp import DataParallelLinear

    s, b, k, n = 5, 2, 6, 4

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    def coll(x):
        return _collective(x, world)

    X, W = randn(world * s, b, k), randn(k, world * n)
    yield (
        "all_gather_matmul",
        ag.AllGatherMatmul,
        [_rows(X, r, world), _rows(W, r, world, 1)],
        lambda x, w: x @ w,
        [X, W],
        lambda Y: _rows(Y, r, world, 2),
        lambda dX, dW: [_rows(dX, r, world), _rows(dW, r, world, 1)],
        lambda x, w: coll("all_gather")(x) @ w,
        False,
        randn(world * s, b, world * n),
    )

    X, W = randn(world * s, b, world * k), randn(world * k, n)
    yield (
        "matmul_reduce_scatter",
        ag.MatmulReduceScatter,
        [_rows(X, r, world, 2), _rows(W, r, world)],
        lambda x, w: x @ w,
        [X, W],
        lambda Y: _rows(Y, r, world),
        lambda dX, dW: [_rows(dX, r, world, 2), _rows(dW, r, world)],
        lambda x, w: coll("reduce_scatter")(x @ w),
        False,
        randn(world * s, b, n),
    )

    X, Wb = randn(world * s, b, k), randn(world, k, n)
    yield (
        "matmul_all_to_all",
        ag.MatmulAllToAll,
        [_rows(X, r, world), Wb],
        lambda x, wb: torch.stack([x @ wj for wj in wb]),
        [X, Wb],
        lambda Y: Y[r],
        lambda dX, dWb: [_rows(dX, r, world), dWb],
        lambda x, wb: coll("all_to_all")(torch.stack([x @ wj for wj in wb])).flatten(0, 1),
        True,
        randn(world, world * s, b, n),
    )

    Os, Wb = randn(world, world * s, b, k), randn(world, k, n)
    yield (
        "all_to_all_matmul",
        ag.AllToAllMatmul,
        [Os[r], Wb],
        lambda o, wb: sum(oj @ wj for oj, wj in zip(o, wb)),
        [Os, Wb],
        lambda Y: _rows(Y, r, world),
        lambda dO, dWb: [dO[r], dWb],
        lambda o, wb: sum(oj @ wj for oj, wj in zip(coll("all_to_all")(o.unflatten(0, (world, s))), wb)),
        True,
        randn(world * s, b, n),
    )

    X, W = randn(world * s, b, world * k), randn(world * k, n)
    yield (
        "data_parallel_linear",
        DataParallelLinear,
        [_rows(X, r, world), _rows(W, r, world)],
        lambda x, w: x @ w,
        [X, W],
        lambda Y: _rows(Y, r, world),
        lambda dX, dW: [_rows(dX, r, world), _rows(dW, r, world)],
        lambda x, w: x @ coll("all_gather")(w),
        False,
        randn(world * s, b, n),
    )


def _collective(name: str, world: int):
    """The plain torch.distributed collective, written independently of lean.overlap."""

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if name == "all_gather":
            out = x.new_empty((world * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x)
            return out
        if name == "reduce_scatter":
            out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
            dist.reduce_scatter_tensor(out, x)
            return out
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    return run


def _check_ops(world: int, r: int) -> dict[str, float]:
    from lean.overlap import Overlap

    errors = {}
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
        for name, fn, local, full_fn, full, out_view, grad_views, coll_fn, replicated, grad_full in _op_problems(
            world, r, dtype, g
        ):
            y_full, full_grads = _full_grads(full_fn, full, grad_full)
            want_y, want_grads = out_view(y_full), grad_views(*full_grads)
            want_coll = coll_fn(*local)
            for variant, options in VARIANTS.items():
                leaves = [t.clone().requires_grad_() for t in local]
                y = fn.apply(*leaves, Overlap(**options, timeout=20))
                grads = torch.autograd.grad(y, leaves, out_view(grad_full))
                tag = f"{name} {variant} {str(dtype)[6:]}"
                errors[f"{tag} forward"] = _rel(y, want_y)
                errors[f"{tag} forward-vs-collective-reference"] = _rel(y, want_coll)
                for i, (got, want) in enumerate(zip(grads, want_grads)):
                    if replicated and i == 1:
                        got = got.clone()
                        dist.all_reduce(got)
                    errors[f"{tag} grad[{i}]"] = _rel(got, want)
    return errors


def _block_problems(world: int, r: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    """name -> (full params, full forward, distributed module from an Overlap, this rank's part of each full param)."""
    from lean.overlap import SequenceParallelMLP, ShardedLinear, UlyssesAttention, attention, mlp

    d, f, heads = 4 * world, 4 * world, 2 * world
    W1, W2 = torch.randn(d, f, generator=g, dtype=dtype) / 3, torch.randn(f, d, generator=g, dtype=dtype) / 3
    Wqkv = torch.randn(d, 3 * heads * 2, generator=g, dtype=dtype) / 3
    Wo = torch.randn(heads * 2, d, generator=g, dtype=dtype) / 3
    return {
        "tp+sp mlp": (
            [W1, W2],
            mlp,
            lambda ov: SequenceParallelMLP.from_full(W1, W2, ov),
            lambda p: [_rows(p[0], r, world, 1), _rows(p[1], r, world)],
        ),
        "ulysses attention": (
            [Wqkv, Wo],
            lambda x, a, c: attention(x, a, c, heads),
            lambda ov: UlyssesAttention(Wqkv.clone(), Wo.clone(), heads, ov),
            lambda p: p,
        ),
        "data-parallel mlp": (
            [W1, W2],
            mlp,
            lambda ov: _DataParallelMLP(ShardedLinear.from_full(W1, ov), ShardedLinear.from_full(W2, ov)),
            lambda p: [_rows(p[0], r, world), _rows(p[1], r, world)],
        ),
    }


def _check_blocks(world: int, r: int) -> dict[str, float]:
    """The TP+SP MLP, the Ulysses attention and a data-parallel MLP against the single-process math, for every method;
    in float64 through three SGD steps, so they also train identically (in float32 the two trajectories drift apart by
    rounding faster than the 1e-5 bound allows after a few steps, whatever the method, so float32 checks one step)."""
    from lean.overlap import Overlap

    errors = {}
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(99)
        X, T = (
            torch.randn(world * 3, 2, 4 * world, generator=g, dtype=dtype),
            torch.randn(world * 3, 2, 4 * world, generator=g, dtype=dtype),
        )
        for name, (params, full_fn, make, part) in _block_problems(world, r, dtype, g).items():
            for variant, options in VARIANTS.items():
                ref = [p.clone().requires_grad_() for p in params]
                module = make(Overlap(**options, timeout=20))
                x = _rows(X, r, world).clone().requires_grad_()
                tag = f"{name} {variant} {str(dtype)[6:]}"
                for step in range(3 if dtype == torch.float64 else 1):
                    full_x = X.clone().requires_grad_()
                    y_full = full_fn(full_x, *ref)
                    dx_full, *ref_grads = torch.autograd.grad(((y_full - T) ** 2).sum() / T.numel(), [full_x, *ref])
                    y = module(x)
                    loss = ((y - _rows(T, r, world)) ** 2).sum() / T.numel()  # the ranks' losses sum to the full one
                    dx, *grads = torch.autograd.grad(loss, [x, *module.parameters()])
                    if name == "ulysses attention":  # replicated weights: sum the ranks' contributions
                        for grad in grads:
                            dist.all_reduce(grad)
                    errors[f"{tag} step {step} forward"] = _rel(y, _rows(y_full, r, world))
                    errors[f"{tag} step {step} grad x"] = _rel(dx, _rows(dx_full, r, world))
                    for i, (got, want) in enumerate(zip(grads, part(ref_grads))):
                        errors[f"{tag} step {step} grad param {i}"] = _rel(got, want)
                    with torch.no_grad():
                        for p, grad in zip([*module.parameters(), *ref], [*grads, *ref_grads]):
                            p -= 0.5 * grad
    return errors


class _DataParallelMLP(torch.nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _check_refusals(world: int, r: int) -> dict[str, str]:
    """Uneven shapes are refused with an error that names the shape."""
    from lean.overlap import Overlap, UlyssesAttention, matmul_reduce_scatter

    messages = {}
    for name, call in {
        "matmul_reduce_scatter rows": lambda: matmul_reduce_scatter(torch.zeros(world * 2 + 1, 3), torch.zeros(3, 2)),
        "ulysses heads": lambda: UlyssesAttention(
            torch.zeros(4, 3 * (world + 1)), torch.zeros(world + 1, 4), world + 1, Overlap()
        ),
    }.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    return messages


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        result = {
            "ops": _check_ops(world, rank),
            "blocks": _check_blocks(world, rank),
            "refusals": _check_refusals(world, rank),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, *args, deadline_s: float) -> None:
    """Runs fn(rank, world, port, *args) on `world` processes; kills them all if they outlive the deadline."""
    ctx = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world} overlap test processes still running after {deadline_s}s")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ops_and_blocks_equal_references(world, tmp_path):
    _spawn(_worker, world, str(tmp_path), deadline_s=220)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    errors = {}
    for result in ranks:
        for case, err in {**result["ops"], **result["blocks"]}.items():
            errors[case] = max(errors.get(case, 0.0), err)
    assert len(errors) > 5 * len(VARIANTS) * 2 * 5
    failed = {
        case: err
        for case, err in errors.items()
        if not err <= TOLERANCE[torch.float64 if "float64" in case else torch.float32]
    }
    worst = {}
    for case, err in errors.items():
        key = " ".join(w for w in case.split() if w not in VARIANTS and not w.isdigit() and w != "step")
        worst[key] = max(worst.get(key, 0.0), err)
    print("\n".join(f"worst relative error {key}: {err:.2e}" for key, err in sorted(worst.items())))
    assert not failed, "\n".join(f"{case}: relative error {err:.3g}" for case, err in sorted(failed.items()))
    for name, message in ranks[0]["refusals"].items():
        assert "shape" in message or "heads" in message, f"{name}: {message}"
        assert "world size" in message, f"{name}: {message}"


def _silent_peer_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 never joins the ring: rank 0's flash all-gather must raise PeerLost within its timeout."""
    from lean.overlap import PeerLost, all_gather_matmul

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    if rank == 1:
        time.sleep(4)
        os._exit(0)  # skip the process group's teardown: the abandoned ring step would make it linger
    start = time.monotonic()
    try:
        all_gather_matmul(torch.ones(2, 3), torch.ones(3, 2), "flash", timeout=1.5)
        outcome = "returned"
    except PeerLost as e:
        outcome = f"PeerLost after {time.monotonic() - start:.1f}s: {e}"
    Path(out, "outcome.txt").write_text(outcome)
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lost_peer_raises_instead_of_hanging(tmp_path):
    _spawn(_silent_peer_worker, 2, str(tmp_path), deadline_s=50)
    outcome = (tmp_path / "outcome.txt").read_text()
    assert outcome.startswith("PeerLost"), outcome
    assert float(outcome.split("after ")[1].split("s")[0]) < 5, outcome
