"""Exactness of the overlap ops and blocks on 2, 3 and 4 gloo processes, their bfloat16 precision, and that a lost
peer raises.

One process group per world size runs every op x method x dtype case, forward and backward, and writes the relative
errors to a file per rank; the test asserts on them, naming every case that failed. References: the single-process
math on the full tensors (forward and all gradients) and the plain collective followed by the same compute (forward).
In bfloat16 both references are float32 math on the same bfloat16-rounded inputs, so what is measured is the ops' own
rounding (tolerances: ``U``).
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import spawn

U = 2.0**-8  # bfloat16's unit roundoff (8 significant bits, round to nearest)
# Relative error (norm over a rank's output) allowed per dtype, for single ops and for the blocks.
# bfloat16 ops: an element that is a sum over ranks, y = sum_j p_j, each partial p_j a GEMM output rounded once and the
# sum rounded once (float32 accumulation, p2p.py), has |e| <= u |y| + u sum_j |p_j|, so in norm
#     ||e|| / ||y|| <= u (1 + ||sum_j |p_j| || / ||y||) ~ u (1 + sqrt(1 + 2 (P-1) / pi)) <= 2.71 u at P = 4,
# the ratio's value for independent zero-mean Gaussian partials: E(sum_j |p_j|)^2 = P s^2 + P (P-1) (2/pi) s^2 against
# E y^2 = P s^2. Outputs that are one GEMM (gathers, all-to-alls, weight gradients) are rounded once: <= u. So 3u
# (measured on 2 and 4 ranks: at most 0.89u).
# bfloat16 blocks chain such roundings: the MLP's forward rounds x W1, gelu(.) and the reduce-scatter sum (u + u +
# 2.71u), a rounded intermediate reaching the output with a gain of about 1 for these random layers (weights ~N(0,1)/3,
# gelu' in [-0.13, 1.13], softmax rows averaging values); each backward chain is as long again and starts from the
# forward's rounded activations and loss gradient, so gradients get up to about twice the forward's 4.7u. So 10u
# (measured: at most 2.3u). A 16-bit running sum rounded at every hop would still fit these norm bounds on random data
# (it adds u |S_t| at each of the P-2 inner hops: matmul_reduce_scatter's forward at P = 4 measured 0.95u-1.18u against
# 0.65u with float32 sums), so ``test_half_precision_sums_round_once`` is the test that tells them apart.
TOLERANCE = {
    "ops": {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3 * U},
    "blocks": {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 10 * U},
}
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The references' dtype: float32 for bfloat16 (computed from the same bfloat16 inputs), the dtype otherwise."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


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
    from lean.parallel.overlap import autograd as ag
    from lean.parallel.overlap.dp import DataParallelLinear

    s, b, k, n = 5, 2, 6, 4

    def randn(*shape):  # bfloat16: float32 draws rounded, the references get them back exactly
        return torch.randn(*shape, generator=g, dtype=_reference_dtype(dtype)).to(dtype)

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
    """The plain torch.distributed collective, written independently of lean.parallel.overlap."""

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
    from lean.parallel.overlap import Overlap

    errors = {}
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
        ref = _reference_dtype(dtype)
        for name, fn, local, full_fn, full, out_view, grad_views, coll_fn, replicated, grad_full in _op_problems(
            world, r, dtype, g
        ):
            y_full, full_grads = _full_grads(full_fn, [t.to(ref) for t in full], grad_full.to(ref))
            want_y, want_grads = out_view(y_full), grad_views(*full_grads)
            want_coll = coll_fn(*[t.to(ref) for t in local])
            for variant, options in VARIANTS.items():
                leaves = [t.clone().requires_grad_() for t in local]
                y = fn.apply(*leaves, Overlap(**options, timeout=20))
                grads = torch.autograd.grad(y, leaves, out_view(grad_full))
                tag = f"{name} {variant} {str(dtype)[6:]}"
                errors[f"{tag} forward"] = _rel(y, want_y)
                errors[f"{tag} forward-vs-collective-reference"] = _rel(y, want_coll)
                for i, (got, want) in enumerate(zip(grads, want_grads)):
                    if replicated and i == 1:  # summed in the reference dtype: the ranks' sum is not the op's
                        got = got.to(ref, copy=True)
                        dist.all_reduce(got)
                    errors[f"{tag} grad[{i}]"] = _rel(got, want)
    return errors


def _block_problems(world: int, r: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    """name -> (full params, full forward, distributed module from an Overlap, this rank's part of each full param)."""
    from lean.parallel.overlap import SequenceParallelMLP, ShardedLinear, UlyssesAttention, attention, mlp

    d, f, heads = 4 * world, 4 * world, 2 * world

    def randn(*shape):  # bfloat16: float32 draws rounded, the references get them back exactly
        return (torch.randn(*shape, generator=g, dtype=_reference_dtype(dtype)) / 3).to(dtype)

    W1, W2 = randn(d, f), randn(f, d)
    Wqkv = randn(d, 3 * heads * 2)
    Wo = randn(heads * 2, d)
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
    rounding faster than the 1e-5 bound allows after a few steps, whatever the method, so float32 and bfloat16 check
    one step)."""
    from lean.parallel.overlap import Overlap

    errors = {}
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(99)
        ref_dtype = _reference_dtype(dtype)
        X, T = (
            torch.randn(world * 3, 2, 4 * world, generator=g, dtype=ref_dtype).to(dtype),
            torch.randn(world * 3, 2, 4 * world, generator=g, dtype=ref_dtype).to(dtype),
        )
        for name, (params, full_fn, make, part) in _block_problems(world, r, dtype, g).items():
            for variant, options in VARIANTS.items():
                ref = [p.to(ref_dtype, copy=True).requires_grad_() for p in params]
                module = make(Overlap(**options, timeout=20))
                x = _rows(X, r, world).clone().requires_grad_()
                tag = f"{name} {variant} {str(dtype)[6:]}"
                for step in range(3 if dtype == torch.float64 else 1):
                    full_x = X.to(ref_dtype, copy=True).requires_grad_()
                    y_full = full_fn(full_x, *ref)
                    full_loss = ((y_full - T.to(ref_dtype)) ** 2).sum() / T.numel()
                    dx_full, *ref_grads = torch.autograd.grad(full_loss, [full_x, *ref])
                    y = module(x)
                    loss = ((y - _rows(T, r, world)) ** 2).sum() / T.numel()  # the ranks' losses sum to the full one
                    dx, *grads = torch.autograd.grad(loss, [x, *module.parameters()])
                    if name == "ulysses attention":  # replicated weights: sum the ranks' contributions (in float32)
                        grads = [grad.to(ref_dtype) for grad in grads]
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
    from lean.parallel.overlap import Overlap, UlyssesAttention, matmul_reduce_scatter

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


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ops_and_blocks_equal_references(world, tmp_path):
    spawn(_worker, world, str(tmp_path), deadline_s=220)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    errors, tolerance = {}, {}
    for result in ranks:
        for kind in ("ops", "blocks"):
            for case, err in result[kind].items():
                errors[case] = max(errors.get(case, 0.0), err)
                tolerance[case] = next(tol for dt, tol in TOLERANCE[kind].items() if f" {str(dt)[6:]} " in case)
    assert len(errors) > 5 * len(VARIANTS) * len(DTYPES) * 5
    failed = {case: err for case, err in errors.items() if not err <= tolerance[case]}
    worst = {}
    for case, err in errors.items():
        key = " ".join(w for w in case.split() if w not in VARIANTS and not w.isdigit() and w != "step")
        worst[key] = max(worst.get(key, 0.0), err)
    print("\n".join(f"worst relative error {key}: {err:.2e}" for key, err in sorted(worst.items())))
    assert not failed, "\n".join(
        f"{case}: relative error {err:.3g} (tolerance {tolerance[case]:.3g})" for case, err in sorted(failed.items())
    )
    for name, message in ranks[0]["refusals"].items():
        assert "shape" in message or "heads" in message, f"{name}: {message}"
        assert "world size" in message, f"{name}: {message}"


def _top_binade_factors(dtype: torch.dtype, g: torch.Generator, *shape: int) -> torch.Tensor:
    """Integers a in [lo, hi] with lo^2 >= 2^(p-1) and hi^2 < 2^p, p the dtype's significant bits (bfloat16 12..15,
    float16 32..45): the product of two is exact in the dtype and lies in its top binade below 2^p, so sums of 2..P
    such products need more bits than the dtype has and a rounding shows (all exact in float32)."""
    bits = 1 - round(math.log2(torch.finfo(dtype).eps))  # eps = 2^(1-p)
    lo, hi = math.ceil(2 ** ((bits - 1) / 2)), math.isqrt(2**bits - 1)
    return torch.randint(lo, hi + 1, shape, generator=g).to(dtype)


def _rounding_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every summing op (matmul_reduce_scatter, all_to_all_matmul, the data-parallel forward) x method x 16-bit dtype on
    partials that are exact products: counts the output elements that differ from the float32 sum rounded once."""
    from lean.parallel.overlap import Overlap, all_to_all_matmul, data_parallel_linear, matmul_reduce_scatter

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        r, s, b, n, counts = rank, 4, 2, 8, {}
        for dtype in (torch.bfloat16, torch.float16):
            g = torch.Generator().manual_seed(7)  # the same full tensors on every rank
            tag = str(dtype)[6:]
            X, W = _top_binade_factors(dtype, g, world * s, b, world), _top_binade_factors(dtype, g, world, n)
            Os = _top_binade_factors(dtype, g, world, world * s, b, 1)
            # this rank's rows of rank j's partial, exact in float32 (the products are exact in the dtype too)
            products = torch.stack(
                [_rows(X[..., j : j + 1].float() @ W[j : j + 1].float(), r, world) for j in range(world)]
            )
            problems = {  # name -> (op, this rank's inputs, the partials its output sums)
                "matmul_reduce_scatter": (matmul_reduce_scatter, (X[..., r : r + 1], W[r : r + 1]), products),
                "all_to_all_matmul": (
                    all_to_all_matmul,
                    (Os[r], W.unsqueeze(1)),
                    torch.stack([_rows(Os[j].float(), r, world) @ W[j : j + 1].float() for j in range(world)]),
                ),
                "data_parallel_linear": (data_parallel_linear, (_rows(X, r, world), W[r : r + 1]), products),
            }
            for name, (op, inputs, partials) in problems.items():
                want = partials.sum(0).to(dtype)  # the exact sum rounded once
                counts[f"{name} {tag} elements"] = want.numel()
                for variant, options in VARIANTS.items():
                    with torch.no_grad():
                        got = op(*inputs, Overlap(**options, timeout=20))
                    counts[f"{name} {tag} {variant}"] = int((got != want).sum())
                # what a running sum kept in the dtype gives, added in the flash ring's order (ranks r+1, .., r)
                running = partials[(r + 1) % world].to(dtype)
                for j in range(2, world + 1):
                    running = (running.float() + partials[(r + j) % world]).to(dtype)
                counts[f"{name} {tag} running 16-bit sum"] = int((running != want).sum())
            # torch.distributed's own 16-bit reduce-scatter on the same partials, for the record
            scattered = torch.empty(s, b, n, dtype=dtype)
            dist.reduce_scatter_tensor(scattered, (X[..., r : r + 1] @ W[r : r + 1]).contiguous())
            counts[f"torch.distributed.reduce_scatter {tag}"] = int((scattered != products.sum(0).to(dtype)).sum())
        Path(out, f"rank{rank}.json").write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_half_precision_sums_round_once(world, tmp_path):
    """In bfloat16 and float16 every method of every op that sums over ranks returns, bit for bit, the float32 sum
    rounded once, on partials that are exact in 16 bits but whose sums are not (``_top_binade_factors``). A running sum
    kept in 16 bits (the ring before float32 accumulation; gloo's reduce-scatter) rounds at every hop and misses it on
    a good part of the elements from 3 ranks on (with 2 its one add is the final rounding, so there only the
    equality is checked)."""
    spawn(_rounding_worker, world, str(tmp_path), deadline_s=100)
    counts = {}
    for r in range(world):
        for case, count in json.loads((tmp_path / f"rank{r}.json").read_text()).items():
            counts[case] = counts.get(case, 0) + count
    print("\n".join(f"{case}: {count}" for case, count in sorted(counts.items())))
    mismatched = {case: c for case, c in counts.items() if case.split()[-1] in VARIANTS and c}
    assert not mismatched, f"elements that differ from the float32 sum rounded once: {mismatched}"
    assert sum(1 for case in counts if case.split()[-1] in VARIANTS) == 3 * 2 * len(VARIANTS)
    if world > 2:  # the data would catch a per-hop rounding
        for case, count in counts.items():
            if case.endswith("running 16-bit sum"):
                elements = counts[case.replace("running 16-bit sum", "elements")]
                assert count > elements / 10, f"{case}: only {count} of {elements} elements differ"


def _silent_peer_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 never joins the ring: rank 0's flash all-gather must raise PeerLost within its timeout."""
    from lean.parallel.overlap import PeerLost, all_gather_matmul

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
    spawn(_silent_peer_worker, 2, str(tmp_path), deadline_s=50)
    outcome = (tmp_path / "outcome.txt").read_text()
    assert outcome.startswith("PeerLost"), outcome
    assert float(outcome.split("after ")[1].split("s")[0]) < 5, outcome
