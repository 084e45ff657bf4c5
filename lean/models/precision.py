"""Keep float64 models in float64.

diffusers upcasts some operations "to float32" for half-precision stability: ``RMSNorm`` computes its variance in
float32, ``FP32LayerNorm`` and Wan's blocks call ``.float()`` on the residual stream. For a float64 model these are
*downcasts*: the forward loses precision and, worse, the backward rounds every cotangent that passes through them to
float32, so two mathematically equal gradient computations (Retain's and Reweight's, say) differ at 1e-8 instead of
1e-16. ``float64_scope()`` makes those casts leave float64 tensors alone while a float64 model runs; it changes
nothing for other dtypes, nothing outside the scope and nothing in other threads (the scoring worker decodes while
the rollout's thread is inside the scope, and its images must stay float32 as they are when scored after the rollout).
"""

from __future__ import annotations

import contextlib
import threading

import torch

_original_float = torch.Tensor.float
_in_scope = threading.local()  # .depth: how many float64 scopes this thread is inside
_installed = {"scopes": 0}  # open scopes in all threads; the patch is installed while > 0
_install_lock = threading.Lock()


def _float_keeping_float64(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if self.dtype == torch.float64 and getattr(_in_scope, "depth", 0) > 0:
        return self
    return _original_float(self, *args, **kwargs)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm computed in the input's dtype (float64 here)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
    if self.weight is not None:
        hidden_states = hidden_states * self.weight.to(hidden_states.dtype)
        if getattr(self, "bias", None) is not None:
            hidden_states = hidden_states + self.bias.to(hidden_states.dtype)
    return hidden_states


def keep_rms_norm_dtype(model: torch.nn.Module) -> None:
    """Give every diffusers ``RMSNorm`` of a float64 model a dtype-preserving forward (instance-level)."""
    from diffusers.models.normalization import RMSNorm  # local: diffusers takes seconds to import

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = _rms_norm_forward.__get__(module)


@contextlib.contextmanager
def float64_scope(active: bool = True):
    """While active, ``tensor.float()`` called from this thread returns float64 tensors unchanged. ``Tensor.float``
    is process-wide, so the patch stays installed while any thread has a scope open and asks the calling thread."""
    if not active:
        yield
        return
    with _install_lock:
        _installed["scopes"] += 1
        torch.Tensor.float = _float_keeping_float64
    _in_scope.depth = getattr(_in_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _in_scope.depth -= 1
        with _install_lock:
            _installed["scopes"] -= 1
            if _installed["scopes"] == 0:
                torch.Tensor.float = _original_float


def set_matmul_precision(dtype: torch.dtype, tf32: bool, device: torch.device) -> None:
    """float32 on a GPU: TF32 tensor cores for matmuls and convolutions when ``tf32``, else full float32. Nothing
    else is touched (a process-wide setting of torch)."""
    if device.type == "cuda" and dtype == torch.float32:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
