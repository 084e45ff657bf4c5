"""Precision a first GPU run must get right: float32 timesteps under bfloat16, the float32 parts diffusers keeps,
the peak FLOP/s an MFU divides by, and the collective timeouts."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from lean.config import ModelConfig
from lean.distributed import CPU_TIMEOUT_S
from lean.metrics import gpu_peak_flops
from lean.models import build_policy


def test_bfloat16_policy_sees_float32_timesteps():
    policy = build_policy(ModelConfig(family="sd3", dtype="bfloat16"), ["a red circle"])
    seen = []
    forward = policy.arch.forward
    policy.arch.forward = lambda net, x, sigma, emb, g: seen.append(sigma) or forward(net, x, sigma, emb, g)
    x = torch.randn(2, *policy.latent_shape()).to(torch.bfloat16)
    sigma = torch.tensor(0.91335, dtype=torch.float64)
    policy.velocity(x, sigma, policy.encode_prompts(["a red circle"] * 2), cfg=False, guidance_scale=1.0)
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
