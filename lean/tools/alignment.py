"""LeanGRPO's numerical alignment protocol (arXiv 2609.03528, App. E): one update of each schedule from identical
weights and AdamW state, with deterministic kernels, compared with Recompute's in the run's own dtype.

``lean equivalence --deterministic`` runs it. Deterministic mode is what makes a bitwise claim testable:

  * ``torch.use_deterministic_algorithms(True)`` and one intra-op thread (a reduction's order is then fixed); on
    CUDA also ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set before the first cuBLAS call);
  * ``train.recompute_batching=rollout``: Recompute's update forwards run at the rollout's own micro-batches and CFG
    batch, so its recomputed forward is the rollout's, op for op;
  * ``train.retain.backward=step``: Retain backpropagates each kept graph on its own, in Recompute's order (step,
    then micro-batch), so each parameter's gradient accumulates the same terms in the same order;
  * ``parallel.layout=slice``: no schedule finishes a unit early (an early unit would reorder the accumulation).

Then, as App. E's Table 2 for each Lean schedule against Recompute, over every trainable element flattened:

    cos(x, y) = x.y / (|x| |y|)     RelL2 = |x - y| / |x|     MaxAbs = max |x - y|

of the synchronised gradient (before clipping), the update Δθ = θ_after - θ_before, and AdamW's first and second
moments after the step. Retain's are bitwise Recompute's (RelL2 exactly 0); Reweight scales an already formed
gradient by the advantage after its backward where Recompute scales the loss before it, so in finite precision it is
close, not equal (the paper: gradient cosine 0.999802, RelL2 1.99 % in bf16 on FLUX.1-dev).
"""

from __future__ import annotations

import contextlib
import os

import torch

from lean.schedules import REWEIGHT

DETERMINISTIC_OVERRIDES = (
    "train.recompute_batching=rollout",
    "train.retain.backward=step",
    "parallel.layout=slice",
)
QUANTITIES = ("gradient", "update", "exp_avg", "exp_avg_sq")
# App. E, Table 2 (FLUX.1-dev, bf16, fixed trajectories): Reweight against Native, (cosine, RelL2)
PAPER_REWEIGHT = {"gradient": (0.999802, 0.0199), "update": (0.999286, 0.0378)}
PAPER_RETAIN = {"gradient": (1.0, 0.0), "update": (1.0, 0.0)}  # bitwise, and so are its AdamW moments


def deterministic_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides with the protocol's (its own win where it sets the same keys)."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    return [*(o for o in DETERMINISTIC_OVERRIDES if o.split("=", 1)[0] not in given), *overrides]


@contextlib.contextmanager
def deterministic_kernels():
    """Deterministic algorithms and one intra-op thread (and cuBLAS's fixed workspace on CUDA), restored on exit."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.set_num_threads(threads)


def metrics(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """cos, RelL2 and MaxAbs of ``y`` against the reference ``x`` (flat tensors, in float64)."""
    x, y = x.double(), y.double()
    norm, other = x.norm().item(), y.norm().item()
    return {  # the cosine without cosine_similarity's floor on the norms (AdamW's second moments are ~1e-20)
        "cosine": (x @ y).item() / (norm * other) if norm and other else float(norm == other),
        "rel_l2": (x - y).norm().item() / norm if norm else float((x - y).norm().item() != 0),
        "max_abs": (x - y).abs().max().item(),
        "bitwise_equal": torch.equal(x, y),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's part on this process (a DTensor's local shard), flattened."""
    return (t.to_local() if hasattr(t, "to_local") else t).flatten()


def flat_state(update, start: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """An update's gradient, Δθ and AdamW moments, each flattened over the trainable tensors (this process's parts:
    with FSDP the metrics are per process)."""
    moments = update.moments
    return {
        "gradient": torch.cat([_local(g) for g in update.grads]),
        "update": torch.cat([_local(p) - _local(s) for p, s in zip(update.params, start)]),
        "exp_avg": torch.cat([_local(m) for m, _ in moments]),
        "exp_avg_sq": torch.cat([_local(v) for _, v in moments]),
    }


def alignment(updates: dict, baseline: str, start: list[torch.Tensor]) -> dict[str, dict[str, dict]]:
    """Per schedule other than ``baseline``: per quantity (:data:`QUANTITIES`) its :func:`metrics` against the
    baseline's."""
    reference = flat_state(updates[baseline], start)
    out = {}
    for name, update in updates.items():
        if name != baseline:
            ours = flat_state(update, start)
            out[name] = {q: metrics(reference[q], ours[q]) for q in QUANTITIES}
    return out


def format_alignment(report: dict, baseline: str) -> str:
    lines = [
        f"alignment against {baseline} (LeanGRPO App. E), deterministic kernels, in the run's dtype:",
        f"{'schedule':10} {'quantity':11} {'cosine':>10} {'RelL2':>11} {'MaxAbs':>11}  bitwise  paper (cos, RelL2)",
    ]
    for name, by_quantity in report.items():
        for q, m in by_quantity.items():
            paper = PAPER_REWEIGHT.get(q) if name == REWEIGHT else PAPER_RETAIN.get(q)
            cited = f"{paper[0]:.6f}, {paper[1]:.2%}" if paper else ""
            lines.append(
                f"{name:10} {q:11} {m['cosine']:10.6f} {m['rel_l2']:11.3e} {m['max_abs']:11.3e}  "
                f"{'yes' if m['bitwise_equal'] else 'no':7}  {cited}"
            )
    return "\n".join(lines)
