"""Predict each schedule's peak memory and time per iteration from one probed step, and choose for ``auto``.

The probe runs the first trained step of a real local batch and measures:
  * ``activation_mb``: bytes autograd saves for the backward of one tracked step at the rollout batch (counted with
    ``saved_tensors_hooks``, each storage once), and ``activation_one_mb`` at one trajectory;
  * ``backward_transient_mb`` (T): the peak of one tracked step and its backward beyond its saved activations (the
    activation gradients in flight); ``decode_mb`` (D, scaled to the local batch): the VAE decoder's working set; both
    from a trimmed heap (CPU) or the caching allocator's statistics (CUDA);
  * ``t_forward``: one untracked step; ``t_forward_backward``: one tracked step plus its backward, at both sizes.
A schedule peaks either inside a backward or inside the decode, with whatever activations are alive then. With n
steps, K trained per sample, B local samples, P trainable parameters (bytes), base = resident memory now:

    Recompute  mem = base + max(D, activation(train batch) + T)      time = n f + K (f + fb)   (+ K f_ref if beta > 0)
    Retain     mem = base + K activation(B) + max(D, T)              time = (n - K) f + K fb
    Reweight   mem = base + (B + 1) P + max(D, activation(B) + T)    time = n f + K (fb - f)   (x2 backward if beta > 0)
               (one trajectory per micro-batch when a trainable parameter is not in an nn.Linear:
                activation(1) instead of activation(B),  time = (n - K) f + K B fb_1)

``auto`` takes Retain when its predicted peak fits ``train.memory_budget_mb`` (default: the device's memory), else
Reweight, and logs both figures. Retain and Reweight run the on-policy variant of an off-policy recipe (one optimizer
step per rollout); the report says so. The published sizes are not built on a CPU: ``lean plan`` then reports the
transformer's parameters and the memory its weights, trainable parameters and AdamW moments take, counted on the meta
device (:func:`published_size`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from lean.metrics import PeakMemory, live_bytes_heap, median, rss_mb
from lean.rollout import policy_step
from lean.sde import plan_steps


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times)


def device_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 1024 + rss_mb()


def probe(trainer) -> dict:
    """Measure one step of the configured policy at the local rollout batch and at one trajectory."""
    cfg = trainer.cfg
    samples = trainer.global_samples(0)
    batch = min(len(samples) // trainer.world, cfg.train.rollout_batch_size)
    prompts = [cfg.train.prompts[p] for _, p, _ in samples[:batch]]
    emb = trainer.policy.encode_prompts(prompts)
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    x = trainer.policy.init_latents(gens)
    index = torch.zeros(batch, dtype=torch.long)

    def step(rows: slice, grad: bool):
        def run():
            with torch.set_grad_enabled(grad):
                out = policy_step(trainer.policy, x[rows], index[rows], emb.index(torch.arange(batch)[rows]),
                                  cfg.sample, trainer.sigmas, generators=gens[rows])
            if grad:
                out[1].sum().backward()
        return run

    full, one = slice(0, batch), slice(0, 1)
    with live_bytes_heap():
        with PeakMemory(trainer.device) as tracked:  # one tracked step and its backward, from a trimmed heap
            step(full, True)()
        with PeakMemory(trainer.device) as decoding:
            trainer.policy.decode(x)
    result = {
        "batch": batch,
        "activation_mb": _saved_bytes(lambda: policy_step(trainer.policy, x, index, emb, cfg.sample, trainer.sigmas,
                                                          generators=gens)) / 2**20,
        "activation_one_mb": _saved_bytes(lambda: policy_step(trainer.policy, x[one], index[one],
                                                              emb.index(torch.arange(1)), cfg.sample,
                                                              trainer.sigmas, generators=gens[one])) / 2**20,
        "t_forward": _timed(step(full, False)),
        "t_forward_backward": _timed(step(full, True)),
        "t_forward_backward_one": _timed(step(one, True)),
        "param_mb": sum(p.numel() * p.element_size() for p in trainer.params) / 2**20,
        "base_mb": tracked.start_mb,
    }
    # What the backward needs beyond the saved activations (gradients of the activations in flight).
    result["backward_transient_mb"] = max(tracked.delta_mb - result["activation_mb"], 0.0)
    result["decode_mb"] = max(decoding.delta_mb, 0.0)  # the VAE's working set at the probe batch
    trainer.optimizer.zero_grad(set_to_none=True)
    return result


def predict(trainer, measured: dict) -> dict:
    cfg = trainer.cfg
    n = cfg.sample.num_steps
    local = len(trainer.global_samples(0)) // trainer.world
    plan = plan_steps(n, 1, timestep_fraction=cfg.sample.timestep_fraction, selection=cfg.sample.timestep_selection,
                      sde_window=cfg.sample.sde_window, sde_window_max_start=cfg.sample.sde_window_max_start,
                      window_generator=torch.Generator().manual_seed(0),
                      sample_generators=[torch.Generator().manual_seed(0)])
    k = int(plan.trained[0].sum())
    rounds = -(-local // measured["batch"])  # rollout micro-batches per step
    f, fb, fb1 = measured["t_forward"] * rounds, measured["t_forward_backward"] * rounds, measured[
        "t_forward_backward_one"]
    ref = k * f if cfg.train.beta else 0.0
    base, act, act1 = measured["base_mb"], measured["activation_mb"] * rounds, measured["activation_one_mb"]
    # Each schedule peaks either in a backward (its live activations + the backward's transient) or in the VAE decode
    # (whatever activations are still alive + the decoder's working set).
    transient, decode = measured["backward_transient_mb"], measured["decode_mb"] * local / measured["batch"]
    train_rows = min(cfg.train.train_batch_size, local)
    buffers = (local + (1 if cfg.train.beta else 0)) * measured["param_mb"]
    return {
        "steps_trained": k,
        "recompute": {"peak_memory_mb": base + max(decode, act * train_rows / max(measured["batch"] * rounds, 1)
                                                   + transient),
                      "time_iteration_s": n * f + k * fb + ref},
        "retain": {"peak_memory_mb": base + k * act + max(decode, transient),
                   "time_iteration_s": (n - k) * f + k * fb + ref},
        "reweight": _reweight(trainer, n, k, f, fb, fb1, local, ref, base + buffers, act + transient,
                              act1 + transient, decode),
    }


def _reweight(trainer, n, k, f, fb, fb1, local, ref, base, step_mb, step_one_mb, decode) -> dict:
    """Batched when every trainable parameter is in an nn.Linear (per-row gradients), else one trajectory at a time;
    the KL term, when on, costs a second backward per step."""
    from lean.schedules.per_sample import linear_owners

    kl = 2 if trainer.cfg.train.beta else 1
    if linear_owners(trainer.policy, trainer.params) is not None:
        backward = fb - f
        return {"peak_memory_mb": base + max(decode, step_mb), "time_iteration_s": n * f + k * kl * backward + ref}
    return {"peak_memory_mb": base + max(decode, step_one_mb),
            "time_iteration_s": (n - k) * f + k * local * fb1 * kl + ref}


def choose_schedule(trainer) -> tuple[str, dict]:
    """For ``train.schedule: auto``: Retain if its predicted peak fits the budget, else Reweight."""
    measured = probe(trainer)
    prediction = predict(trainer, measured)
    budget = trainer.cfg.train.memory_budget_mb or device_memory_mb(trainer.device)
    retain_mb = prediction["retain"]["peak_memory_mb"]
    choice = "retain" if retain_mb <= budget else "reweight"
    decision = {"choice": choice, "budget_mb": budget, "retain_predicted_peak_mb": retain_mb,
                "reweight_predicted_peak_mb": prediction["reweight"]["peak_memory_mb"]}
    if trainer.is_main:
        print(f"lean auto: Retain needs ~{retain_mb:.0f} MiB of a {budget:.0f} MiB budget -> {choice}", flush=True)
    return choice, decision


def published_size(cfg) -> dict:
    """The configured transformer with its adapter, built on the meta device (no memory, no initialisation): its
    parameters, the MiB its weights take at ``model.dtype``, the trainable parameters P (LoRA factors, or all under
    full fine-tuning) and the MiB of their state: values, gradients and AdamW's two moments (torch keeps them in the
    parameter's dtype), 4 P. Reweight adds (B + 1) P of buffers."""
    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model

    from lean.models import DTYPES, family_module

    m = cfg.model
    spec = family_module(m.family)
    with init_empty_weights(include_buffers=True):
        model = spec.COMPONENTS["transformer"][0](**spec.SIZES[m.size]["transformer"])
    total = sum(p.numel() for p in model.parameters())
    if not m.full_finetune:
        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha,
                                                 target_modules=spec.lora_targets(m.lora_ffn)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    size = DTYPES[m.dtype].itemsize
    return {"transformer_parameters": total, "weight_mb": total * size / 2**20, "trainable_parameters": trainable,
            "trainable_state_mb": 4 * trainable * size / 2**20}


def main(cfg, out: str | None = None) -> dict:
    """``lean plan``: print the predicted peak memory and time per iteration of each schedule (on a CPU, for a
    published size: the meta-device counts of :func:`published_size` instead)."""
    from lean.train import Trainer

    if cfg.model.size == "full" and not torch.cuda.is_available():
        report = {"published_size": published_size(cfg)}
        r = report["published_size"]
        print(f"lean plan: {cfg.model.family}/full is not built on a CPU; on the meta device its transformer has "
              f"{r['transformer_parameters'] / 1e9:.2f}B parameters ({r['weight_mb'] / 1024:.1f} GiB in "
              f"{cfg.model.dtype}), {r['trainable_parameters'] / 1e6:.1f}M trainable "
              f"({r['trainable_state_mb']:.0f} MiB with their gradients and AdamW moments)")
        _write(out, report)
        return report
    trainer = Trainer(cfg)
    measured = probe(trainer)
    prediction = predict(trainer, measured)
    budget = cfg.train.memory_budget_mb or device_memory_mb(trainer.device)
    report = {"probe": measured, "prediction": prediction, "budget_mb": budget,
              "auto_choice": "retain" if prediction["retain"]["peak_memory_mb"] <= budget else "reweight"}
    if trainer.is_main:
        print(f"lean plan: {cfg.model.family}/{cfg.model.size} {cfg.model.dtype}, {cfg.sample.num_steps} steps, "
              f"{prediction['steps_trained']} trained, one step saves {measured['activation_mb']:.1f} MiB "
              f"of activations at batch {measured['batch']}")
        print(f"{'schedule':10} {'peak memory MiB':>16} {'time/iteration s':>17}")
        for s in ("recompute", "retain", "reweight"):
            p = prediction[s]
            print(f"{s:10} {p['peak_memory_mb']:16.1f} {p['time_iteration_s']:17.3f}")
        print(f"budget {budget:.0f} MiB -> auto takes {report['auto_choice']}")
        t = cfg.train
        changes = [f"train.{k}=1" for k in ("optimizer_steps_per_iteration", "num_inner_epochs") if getattr(t, k) != 1]
        if changes:
            saved = prediction["recompute"]["time_iteration_s"] - prediction["retain"]["time_iteration_s"]
            print(f"off-policy recipe ({t.optimizer_steps_per_iteration * t.num_inner_epochs} optimizer steps per "
                  f"rollout): the retain/reweight rows are its on-policy variant, set {' and '.join(changes)}: one "
                  f"step per rollout instead, and Retain saves {saved:.3f} s per iteration over Recompute")
        _write(out, report)
    return report


def _write(out: str | None, report: dict) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "plan.json").write_text(json.dumps(report, indent=2))
