"""Small numeric helpers shared by stateful transforms: step counters, bias corrections, a twice-differentiable sqrt."""

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


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` for ``x >= 0`` whose derivatives of every order are finite at 0 (they are 0 there).

    ``d sqrt(x)/dx = 1 / (2 sqrt(x))`` is infinite at 0, and autograd multiplies it by the zero derivative of the
    argument (Adam's ``v`` where the gradient is exactly zero), giving NaN meta-gradients. The inner ``where`` keeps
    the square root away from 0, the outer one selects 0 there, so no infinity is ever formed; the value is exactly
    ``torch.sqrt(x)`` everywhere. It costs two extra passes, so transforms use it only when autograd records the step.

    Example:
        >>> import torch
        >>> from fadam._numerics import safe_sqrt
        >>> v = torch.tensor([0.0, 4.0], requires_grad=True)
        >>> torch.autograd.grad(safe_sqrt(v).sum(), v)[0]
        tensor([0.0000, 0.2500])
    """
    positive = x > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, x, 1.0)), 0.0)
