"""Small numeric helpers shared by stateful transforms: step counters and bias corrections."""

from __future__ import annotations

import torch

_INT32_MAX = torch.iinfo(torch.int32).max


def zero_count() -> torch.Tensor:
    """A fresh step counter: a 0-d int32 CPU tensor.

    It lives on the CPU, as torch.optim's step does on its default path: a 0-d CPU tensor mixes with tensors on any
    device without a host-device copy, and bias corrections computed from it cost no kernel launch on an accelerator.
    """
    return torch.zeros([], dtype=torch.int32)


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1`` that saturates at the int32 maximum instead of wrapping (optax's convention)."""
    return torch.where(count < _INT32_MAX, count + 1, count)


def bias_correction(decay: float | torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``1 - decay ** count`` in float64, matching torch.optim, which computes it with Python floats (doubles)."""
    exponent = count.to(torch.float64)
    if isinstance(decay, torch.Tensor):
        return 1 - decay.to(torch.float64) ** exponent
    return 1 - torch.pow(decay, exponent)


def dtype_for(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype | None:
    """``dtype``'s precision for ``tensor`` (``None``: keep the tensor's): a complex tensor stays complex.

    Used for state dtypes (``mu_dtype``, ``accumulator_dtype``) and casts: a real dtype applied to a complex param
    (``float64`` -> ``complex128``) would otherwise silently drop the imaginary part.
    """
    if dtype is None or not tensor.is_complex() or dtype.is_complex:
        return dtype
    return dtype.to_complex()
