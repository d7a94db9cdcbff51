"""Small numeric helpers shared by stateful transforms: step counters and bias corrections."""

from __future__ import annotations

import torch
from torch._C import _functorch

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


def for_leaf(value: float | torch.Tensor, leaf: torch.Tensor) -> float | torch.Tensor:
    """``value``, derived from a step count (a bias correction, a scheduled rate), in a form that mixes with ``leaf``.

    A 0-d CPU tensor combines with tensors on any device, which is why step counts live on the CPU. Under
    ``torch.func.vmap`` a per-member count is a CPU tensor with a hidden batch dimension, which does not combine with
    an accelerator's tensors, so it is copied to the leaf's device (a few bytes; no host sync for a host-to-device
    copy). Anything else is returned as it is.
    """
    if (
        isinstance(value, torch.Tensor)
        and value.device != leaf.device
        and _functorch.is_functorch_wrapped_tensor(value)
    ):
        return value.to(leaf.device, non_blocking=leaf.device.type != "cpu")
    return value
