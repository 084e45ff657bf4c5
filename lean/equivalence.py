"""Objective equivalence: Retain and Reweight must produce Recompute's update.

From identical trainable weights and optimizer state, one iteration of each schedule (same seed, so the same
trajectories, rewards and advantages). We compare, on every trainable tensor, the synchronised gradient just before
the optimizer step, and the weights just after it:

    max_abs_grad_diff            max_t ||g_t - g_t^rc||_inf
    max_rel_grad_diff            max_t ||g_t - g_t^rc||_inf / ||g_t^rc||_inf   (tensors with g^rc = 0 must match)
    cosine                       <g, g^rc> / (||g|| ||g^rc||) over all tensors flattened together
    max_rel_param_diff_after_step  max_t ||w_t - w_t^rc||_inf / ||w_t^rc - w_t^0||_inf  (relative to the update size)

The adapter starts from a random perturbation (peft initialises LoRA's B to zero, which would make the gradients of
A, and the KL term, vanish and the check weaker than it looks).
"""

from __future__ import annotations

import torch

from lean.config import RunConfig
from lean.optimizer import capture_synced_grads
from lean.outputs import write_json
from lean.schedules import BASELINE, LEAN_SCHEDULES
from lean.train import Trainer


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    d, r = diff.abs().max().item(), ref.abs().max().item()
    if r == 0:
        return 0.0 if d == 0 else float("inf")
    return d / r


def compare(
    grads: list[torch.Tensor],
    ref_grads: list[torch.Tensor],
    params: list[torch.Tensor],
    ref_params: list[torch.Tensor],
    start: list[torch.Tensor],
    names: list[str],
) -> dict:
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    cosine = torch.nn.functional.cosine_similarity(flat.double(), ref_flat.double(), dim=0).item()
    per_tensor = {n: _rel(g - r, r) for n, g, r in zip(names, grads, ref_grads)}
    return {
        "max_abs_grad_diff": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)),
        "max_rel_grad_diff": max(per_tensor.values()),
        "cosine": cosine,
        "max_rel_param_diff_after_step": max(_rel(p - q, q - s) for p, q, s in zip(params, ref_params, start)),
        "rel_grad_diff_per_tensor": per_tensor,
    }


def one_update(trainer: Trainer, schedule: str, iteration: int = 0) -> tuple[list[torch.Tensor], dict]:
    """(the synchronised gradient of the update, the iteration's metrics) of one iteration with ``schedule``."""
    with capture_synced_grads(trainer.state) as grads:
        metrics = trainer.iteration(iteration, schedule).metrics
    return list(grads), metrics


def run_equivalence(cfg: RunConfig, trainer: Trainer | None = None, perturb_std: float = 0.02) -> dict:
    """One iteration per schedule from the same state; returns the certificate (identical on every rank)."""
    trainer = trainer or Trainer(cfg)
    trainer.policy.perturb_lora_(perturb_std, torch.Generator().manual_seed(cfg.train.seed))
    start_state = trainer.state.state_dict()
    start = start_state["params"]
    results = {}
    for name in (BASELINE, *LEAN_SCHEDULES):
        trainer.state.load_state_dict(start_state)
        grads, metrics = one_update(trainer, name)
        results[name] = (grads, [p.detach().clone() for p in trainer.params], metrics)
    trainer.state.load_state_dict(start_state)

    ref_grads, ref_params, ref_metrics = results[BASELINE]
    report = {
        "dtype": cfg.model.dtype,
        "world_size": trainer.world.size,
        "family": cfg.model.family,
        "reward_mean": ref_metrics["reward_mean"],
    }
    for name in LEAN_SCHEDULES:
        grads, params, _ = results[name]
        report[name] = compare(grads, ref_grads, params, ref_params, start, trainer.state.names)
    return report


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(max_rel_grad_diff, 1 - cosine) targets: 1e-10 in float64, 1e-5 / 1e-6 in float32."""
    return (1e-10, 1e-10) if dtype == torch.float64 else (1e-5, 1e-6)


def passes(report: dict, dtype: torch.dtype) -> bool:
    rel_tol, cos_tol = tolerance(dtype)
    return all(report[s]["max_rel_grad_diff"] <= rel_tol and report[s]["cosine"] >= 1 - cos_tol for s in LEAN_SCHEDULES)


def main(cfg: RunConfig, out: str | None = None) -> dict:
    """``lean equivalence``: write DIR/equivalence.json and print a summary (rank 0)."""
    trainer = Trainer(cfg)
    report = run_equivalence(cfg, trainer)
    report["passes"] = passes(report, cfg.model.torch_dtype)
    if trainer.world.is_main:
        write_json(f"{out or 'outputs/equivalence'}/equivalence.json", report)
        print_report(cfg, report, trainer.world.size)
    trainer.world.wait_for_everyone()
    return report


def print_report(cfg: RunConfig, report: dict, world_size: int) -> None:
    rel_tol, cos_tol = tolerance(cfg.model.torch_dtype)
    print(
        f"objective equivalence vs {BASELINE} ({cfg.model.family}, {cfg.model.dtype}, world_size={world_size}; "
        f"targets: rel <= {rel_tol:g}, 1-cos <= {cos_tol:g})"
    )
    print(
        f"{'schedule':10} {'max_abs_grad_diff':>18} {'max_rel_grad_diff':>18} {'1-cosine':>10} {'rel_param_diff':>15}"
    )
    for s in LEAN_SCHEDULES:
        r = report[s]
        print(
            f"{s:10} {r['max_abs_grad_diff']:18.3e} {r['max_rel_grad_diff']:18.3e} {1 - r['cosine']:10.2e} "
            f"{r['max_rel_param_diff_after_step']:15.3e}"
        )
    print("PASS" if report["passes"] else "FAIL")
