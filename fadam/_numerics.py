"""Small numeric helpers shared by stateful transforms: step counters, bias corrections, a twice-differentiable sqrt."""

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


def dtype_for(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype | None:
    """``dtype``'s precision for ``tensor`` (``None``: keep the tensor's): a complex tensor stays complex.

    Used for state dtypes (``mu_dtype``, ``accumulator_dtype``) and casts: a real dtype applied to a complex param
    (``float64`` -> ``complex128``) would otherwise silently drop the imaginary part.
    """
    if dtype is None or not tensor.is_complex() or dtype.is_complex:
        return dtype
    return dtype.to_complex()


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` whose derivatives of every order are finite at 0 (they are 0 there); equal to ``torch.sqrt``.

    ``d sqrt(x)/dx = 1 / (2 sqrt(x))`` is infinite at 0, and autograd multiplies it by the zero derivative of the
    argument (Adam's ``v`` where the gradient is exactly zero), giving NaN meta-gradients. Where ``x == 0`` the inner
    ``where`` takes the square root of 1 instead and the outer one returns 0, so no infinity is ever formed; NaN and
    negative inputs give NaN as ``torch.sqrt`` does. The two ``where`` cost about 10% of a small meta-learning step,
    so a CPU tensor with no zero (checked with one reduction, free of host syncs on the CPU) takes ``torch.sqrt``
    directly: same values and same derivatives.

    Example:
        >>> import torch
        >>> from fadam._numerics import safe_sqrt
        >>> v = torch.tensor([0.0, 4.0], requires_grad=True)
        >>> torch.autograd.grad(safe_sqrt(v).sum(), v)[0]
        tensor([0.0000, 0.2500])
    """
    if _no_zero_on_cpu(x):
        return torch.sqrt(x)
    zero = x == 0
    return torch.where(zero, 0.0, torch.sqrt(torch.where(zero, 1.0, x)))


def _no_zero_on_cpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is a plain CPU tensor (not traced, vmapped or compiled) whose elements are all > 0."""
    if type(x) is not torch.Tensor or x.device.type != "cpu" or not x.numel():
        return False
    if _functorch.is_functorch_wrapped_tensor(x) or torch.compiler.is_compiling():
        return False  # data-dependent control flow is not allowed there
    return bool(torch.amin(x.detach()) > 0)  # NaN or a negative value also take the general path


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
