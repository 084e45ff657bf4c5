"""Precision a first GPU run must get right: float32 timesteps under bfloat16, the float32 parts diffusers keeps,
float32 master weights under half precision, the peak FLOP/s an MFU divides by, and the collective timeouts."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny
from safetensors.torch import load_file

from lean.models import Guidance, build_policy
from lean.models.options import ModelConfig
from lean.observe.metrics import gpu_peak_flops
from lean.parallel.distributed import CPU_TIMEOUT_S, World
from lean.run.optimizer import TrainState
from lean.schedules.per_sample import TrajectoryBuffers

PROMPTS = ["a red circle"] * 2


def test_bfloat16_policy_sees_float32_timesteps():
    policy = build_policy(ModelConfig(family="sd3", dtype="bfloat16"), ["a red circle"])
    seen = []
    forward = policy.runtime.forward
    policy.runtime.forward = lambda net, x, sigma, emb, g: seen.append(sigma) or forward(net, x, sigma, emb, g)
    x = torch.randn(2, *policy.latent_shape()).to(torch.bfloat16)
    sigma = torch.tensor(0.91335, dtype=torch.float64)
    policy.velocity(x, sigma, policy.encode_prompts(["a red circle"] * 2))
    assert seen[0].dtype == torch.float32 and abs(1000 * seen[0][0].item() - 913.35) < 1e-3  # bfloat16: 916


def test_half_precision_never_rounds_what_diffusers_keeps_in_float32():
    full = build_policy(ModelConfig(family="wan"), ["a red circle"])
    half = build_policy(ModelConfig(family="wan", dtype="bfloat16"), ["a red circle"])
    reference = dict(full.transformer.named_parameters()) | dict(full.transformer.named_buffers())
    kept = {
        n: t
        for n, t in (*half.transformer.named_parameters(), *half.transformer.named_buffers())
        if t.is_floating_point() and t.dtype == torch.float32
    }
    assert any("scale_shift_table" in n for n in kept) and any(".rope." in n for n in kept)
    for name, tensor in kept.items():  # exactly the float32 values: never rounded to bfloat16 on the way
        assert torch.equal(tensor, reference[name]), name
    assert half.transformer.get_base_model().blocks[0].attn1.to_q.base_layer.weight.dtype == torch.bfloat16


def _loss(policy) -> tuple[torch.Tensor, torch.Tensor]:
    """The guided velocity at a fixed x and sigma, and a float32 scalar of it to backpropagate."""
    x = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(0)).to(policy.dtype)
    v = policy.velocity(x, torch.tensor(0.6), policy.encode_prompts(PROMPTS), Guidance(cfg=True, guidance_scale=4.0))
    return v, v.float().square().mean()


def test_half_precision_keeps_float32_masters_grads_and_optimizer_state(tmp_path):
    policy = build_policy(ModelConfig(family="sd3", dtype="bfloat16"), PROMPTS)
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    params = [p for _, p in policy.trainable_parameters()]
    assert params and all(p.dtype == torch.float32 for p in params)
    frozen = [p for p in policy.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)  # base, VAE, text encoders (SD3 keeps none)
    v, loss = _loss(policy)
    assert v.dtype == torch.bfloat16  # computed in bfloat16, as x is
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    cfg = tiny("ema.enabled=true", "ema.every=1")
    state = TrainState(policy.trainable_parameters(), cfg.optimizer, cfg.ema, World())
    state.step()
    moments = [t for s in state.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert len(moments) == 2 * len(params) and all(t.dtype == torch.float32 for t in moments)
    assert all(e.dtype == torch.float32 for e in state.ema)
    assert TrajectoryBuffers(params, 2).storage.dtype == torch.float32  # Reweight's per-trajectory gradients
    policy.save_lora(tmp_path / "lora.safetensors")
    assert {t.dtype for t in load_file(tmp_path / "lora.safetensors").values()} == {torch.float32}


def test_full_finetuning_in_half_precision_trains_float32_masters_against_a_half_reference():
    policy = build_policy(ModelConfig(family="wan", dtype="bfloat16", full_finetune=True), PROMPTS)
    assert all(p.dtype == torch.float32 for _, p in policy.trainable_parameters())
    assert {p.dtype for p in policy.reference_denoisers.parameters()} == {torch.bfloat16, torch.float32}
    kept = sum(p.dtype == torch.float32 for p in policy.reference_denoisers.parameters())
    assert kept and len(policy._masters) == len(policy.trainable_parameters()) - kept  # what Wan keeps float32 reads so
    _loss(policy)[1].backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for _, p in policy.trainable_parameters())


def test_half_precision_forward_and_gradient_are_the_bfloat16_models():
    """The masters change where the weights and gradients are kept, not what the network computes: the velocity and
    a single backward's gradient are bit for bit those of the same model with bfloat16 trainable weights."""
    policy = build_policy(ModelConfig(family="flux", dtype="bfloat16"), PROMPTS)
    policy.perturb_lora_(0.05, torch.Generator().manual_seed(1))
    v, loss = _loss(policy)
    loss.backward()
    grads = [p.grad.clone() for _, p in policy.trainable_parameters()]
    for module, name, p in policy._masters:  # the bfloat16 model: trainable weights rounded, read as they are
        module._parameters[name] = torch.nn.Parameter(p.detach().to(torch.bfloat16))
    policy._masters = []
    v_half, loss_half = _loss(policy)
    loss_half.backward()
    assert torch.equal(v, v_half)
    for g, (_, p) in zip(grads, policy.trainable_parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(g, p.grad.float())


def test_an_update_below_bfloat16_resolution_moves_the_master():
    policy = build_policy(ModelConfig(family="sd3", dtype="bfloat16"), PROMPTS)
    name, lora_b = next((n, p) for n, p in policy.trainable_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.fill_(0.05)
    before = lora_b.detach().clone()
    _loss(policy)[1].backward()
    cfg = tiny("optimizer.lr=1e-6", "optimizer.weight_decay=0")
    state = TrainState(policy.trainable_parameters(), cfg.optimizer, cfg.ema, World())
    state.step()  # AdamW's first step moves each weight by lr * g / (|g| + eps): 1e-6 where g is not ~0
    moved = (lora_b.detach() - before).abs()
    assert moved.max() == pytest.approx(1e-6, rel=0.05), name
    rounded = before.to(torch.bfloat16)
    assert torch.equal((rounded + moved.to(torch.bfloat16)).to(torch.bfloat16), rounded)  # a bfloat16 master: lost


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_full_precision_reads_its_own_parameters(dtype):
    """float32 and float64 have no masters: the forward reads the parameters themselves, no cast, no autocast."""
    policy = build_policy(ModelConfig(family="sd3", dtype=dtype), PROMPTS)
    assert policy._masters == []
    name, lora_a = next((n, p) for n, p in policy.trainable_parameters() if "lora_A" in n)
    owner = policy.transformer.get_submodule(name.rsplit(".", 1)[0])
    seen = []
    owner.register_forward_hook(
        lambda m, i, o: seen.append((m.weight is lora_a, o.dtype, torch.is_autocast_enabled("cpu")))
    )
    _loss(policy)
    assert seen and set(seen) == {(True, policy.dtype, False)}


def test_peak_flops_by_exact_device_name():
    assert gpu_peak_flops(torch.bfloat16, "NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert gpu_peak_flops(torch.bfloat16, "NVIDIA H100 PCIe") == pytest.approx(756e12)  # not the SXM figure
    assert gpu_peak_flops(torch.bfloat16, "NVIDIA H100 NVL") == pytest.approx(835.5e12)
    assert gpu_peak_flops(torch.float32, "NVIDIA H200") == pytest.approx(66.9e12)
    assert gpu_peak_flops(torch.float32, "NVIDIA H200", tf32=True) == pytest.approx(494.7e12)
    assert gpu_peak_flops(torch.bfloat16, "NVIDIA B200") is None  # unknown: the caller calibrates instead


def test_collective_timeout_defaults_by_backend():
    assert tiny().train.dist_timeout_s is None and CPU_TIMEOUT_S == 60
    assert tiny("train.dist_timeout_s=5").train.dist_timeout_s == 5


def test_float64_scope_keeps_float64_in_its_own_thread_only():
    import threading

    from lean.models.precision import float64_scope

    x = torch.ones(2, dtype=torch.float64)
    entered, done, seen = threading.Event(), threading.Event(), {}

    def other_thread():
        entered.wait(10)
        seen["other"] = x.float().dtype
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with float64_scope():
        entered.set()
        done.wait(10)
        seen["own"] = x.float().dtype
    worker.join(10)
    assert seen == {"own": torch.float64, "other": torch.float32}
    assert x.float().dtype == torch.float32  # nothing left behind


def test_a_float16_trajectory_stays_float16_under_bfloat16_only():
    """sample.latent_dtype=float16 (Flow-Factory's latent_storage_dtype): float16 under a bfloat16 model (not the
    float32 promote_types would give); a float32 or float64 run keeps its own precision."""
    from lean.config.dtypes import storage_dtype

    assert storage_dtype("float16", torch.bfloat16) == torch.float16
    assert storage_dtype("bfloat16", torch.float16) == torch.bfloat16
    assert storage_dtype("float16", torch.float32) == torch.float32
    assert storage_dtype("float16", torch.float64) == torch.float64
    assert storage_dtype("float32", torch.bfloat16) == torch.float32
    assert storage_dtype("model", torch.bfloat16) == torch.bfloat16
