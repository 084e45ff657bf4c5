"""Objective equivalence: Retain and Reweight must produce Recompute's update.

From identical trainable weights and optimizer state, one iteration of each schedule (same seed, so the same
trajectories, rewards and advantages). We compare, on every trainable tensor, the synchronised gradient just before
the optimizer step, and the weights just after it:

    max_abs_grad_diff            max_t ||g_t - g_t^rc||_inf
    max_rel_grad_diff            max_t ||g_t - g_t^rc||_inf / ||g_t^rc||_inf     (tensors with g^rc = 0 must match exactly)
    cosine                       <g, g^rc> / (||g|| ||g^rc||) over all tensors flattened together
    max_rel_param_diff_after_step  max_t ||w_t - w_t^rc||_inf / ||w_t^rc - w_t^0||_inf  (relative to the update size)

The adapter starts from a random perturbation (peft initialises LoRA's B to zero, which would make the gradients of
A, and the KL term, vanish and the check weaker than it looks).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lean.config import RunConfig

LEAN_SCHEDULES = ("retain", "reweight")


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    d, r = diff.abs().max().item(), ref.abs().max().item()
    if r == 0:
        return 0.0 if d == 0 else float("inf")
    return d / r


def compare(grads: list[torch.Tensor], ref_grads: list[torch.Tensor], params: list[torch.Tensor],
            ref_params: list[torch.Tensor], start: list[torch.Tensor], names: list[str]) -> dict:
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


def run_equivalence(cfg: RunConfig, trainer=None, perturb_std: float = 0.02) -> dict:
    """One iteration per schedule from the same state; returns the certificate (identical on every rank)."""
    from lean.train import Trainer

    trainer = trainer or Trainer(cfg)
    trainer.policy.perturb_lora_(perturb_std, torch.Generator().manual_seed(cfg.train.seed))
    start_state = trainer.trainable_state()
    start = start_state["params"]
    names = [n for n, _ in trainer.policy.trainable_parameters()]
    results = {}
    for name in ("recompute", *LEAN_SCHEDULES):
        trainer.load_trainable_state(start_state)
        captured = {}
        trainer.grad_probe = lambda params: captured.update(grads=[p.grad.detach().clone() for p in params])
        row = trainer.iteration(0, name)
        results[name] = (captured["grads"], [p.detach().clone() for p in trainer.params], row)
    trainer.grad_probe = None
    trainer.load_trainable_state(start_state)

    ref_grads, ref_params, ref_row = results["recompute"]
    report = {"dtype": cfg.model.dtype, "world_size": trainer.world, "family": cfg.model.family,
              "reward_mean": ref_row["reward_mean"]}
    for name in LEAN_SCHEDULES:
        grads, params, _ = results[name]
        report[name] = compare(grads, ref_grads, params, ref_params, start, names)
    return report


def tolerance(dtype: str) -> tuple[float, float]:
    """(max_rel_grad_diff, 1 - cosine) targets: 1e-10 in float64, 1e-5 / 1e-6 in float32."""
    return (1e-10, 1e-10) if dtype == "float64" else (1e-5, 1e-6)


def passes(report: dict) -> bool:
    rel_tol, cos_tol = tolerance(report["dtype"])
    return all(report[s]["max_rel_grad_diff"] <= rel_tol and report[s]["cosine"] >= 1 - cos_tol
               for s in LEAN_SCHEDULES)


def main(cfg: RunConfig, out: str | None = None) -> dict:
    """``lean equivalence``: write DIR/equivalence.json and print a summary (rank 0)."""
    from lean.train import Trainer

    trainer = Trainer(cfg)
    report = run_equivalence(cfg, trainer)
    report["passes"] = passes(report)
    if trainer.is_main:
        out_dir = Path(out or "outputs/equivalence")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "equivalence.json").write_text(json.dumps(report, indent=2))
        rel_tol, cos_tol = tolerance(cfg.model.dtype)
        print(f"objective equivalence vs recompute ({cfg.model.family}, {cfg.model.dtype}, "
              f"world_size={trainer.world}; targets: rel <= {rel_tol:g}, 1-cos <= {cos_tol:g})")
        print(f"{'schedule':10} {'max_abs_grad_diff':>18} {'max_rel_grad_diff':>18} {'1-cosine':>10} "
              f"{'rel_param_diff':>15}")
        for s in LEAN_SCHEDULES:
            r = report[s]
            print(f"{s:10} {r['max_abs_grad_diff']:18.3e} {r['max_rel_grad_diff']:18.3e} {1 - r['cosine']:10.2e} "
                  f"{r['max_rel_param_diff_after_step']:15.3e}")
        print("PASS" if report["passes"] else "FAIL")
    trainer.accelerator.wait_for_everyone()
    return report
