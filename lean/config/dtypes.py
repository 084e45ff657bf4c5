"""The floating-point types a run can compute in: the registry of ``model.dtype`` names.

Code compares ``torch.dtype`` objects, never these strings: a name is read once, from the config, through
:data:`DTYPES`.
"""

from __future__ import annotations

import torch

from lean.config.registry import Registry

DTYPES: Registry[torch.dtype] = Registry(
    "dtype",
    [
        ("float32", torch.float32),  # the default
        ("float64", torch.float64),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
    ],
)
HALF = (torch.bfloat16, torch.float16)
MODEL_DTYPE = "model"  # model.vae_dtype, sample.latent_dtype: the name of model.dtype's precision


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """What trainable parameters, their gradients and the optimizer state are kept in for a run computing in
    ``dtype``: float32 under half precision (near 0.05 a bfloat16 step is 2.4e-4, so an update of 1e-5 would vanish),
    else ``dtype`` itself. The one place this rule is decided."""
    return torch.float32 if dtype in HALF else dtype


def or_model(name: str, model: torch.dtype) -> torch.dtype:
    """A precision that keys such as ``model.vae_dtype`` widen ``model.dtype`` to: the wider of the dtype named
    ``name`` and ``model`` (``model`` itself for the name ``model``), so that a float64 run stays float64."""
    return model if name == MODEL_DTYPE else torch.promote_types(DTYPES[name], model)


def storage_dtype(name: str, model: torch.dtype) -> torch.dtype:
    """``sample.latent_dtype``'s precision: :func:`or_model`'s, except that a half precision named under a
    half-precision model is kept as named (Flow-Factory stores a bfloat16 run's trajectory in float16, its
    ``latent_storage_dtype``), where ``promote_types`` would widen the pair to float32. A float32 or float64 run
    stays at its own precision."""
    if name != MODEL_DTYPE and DTYPES[name] in HALF and model in HALF:
        return DTYPES[name]
    return or_model(name, model)


def dtype_name(dtype: torch.dtype) -> str:
    """The registry name of a torch dtype (``torch.float64 -> "float64"``)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise KeyError(f"{dtype} is not one of {', '.join(DTYPES)}")
