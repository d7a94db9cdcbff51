"""optax's numerics helpers under their names: ``safe_norm`` and ``safe_root_mean_squares`` (a floor on a norm whose
gradient stays finite at zero) and ``safe_increment`` (a counter that saturates instead of wrapping)."""

from __future__ import annotations

import torch

from fadam._numerics import safe_increment as _saturating_int32_increment

__all__ = ["safe_increment", "safe_int32_increment", "safe_norm", "safe_root_mean_squares"]


def safe_norm(
    x: torch.Tensor,
    min_norm: float | torch.Tensor,
    ord: int | float | str | None = None,
    axis: int | tuple[int, ...] | None = None,
    keepdims: bool = False,
) -> torch.Tensor:
    r"""``max(norm(x), min_norm)`` whose gradient is 0, not NaN, where the norm is at most ``min_norm``.

    .. math::
        \operatorname{safe\_norm}(x) = \begin{cases} \|x\| & \|x\| > n_{min} \\ n_{min} & \text{otherwise}
        \end{cases}

    The norm is taken a second time of ``x`` with ones where the first is at most ``min_norm``, so that autograd
    never differentiates a norm at zero.

    Args:
        x: a tensor (complex by modulus).
        min_norm: the floor :math:`n_{min}`.
        ord: the order, as ``torch.linalg.norm``'s (``None``: the 2-norm of all elements, or along ``axis``).
        axis: ``None``, a dim (vector norms) or two dims (matrix norms).
        keepdims: keep the reduced dims with size one.

    Example:
        >>> import torch, fadam
        >>> x = torch.zeros(3, requires_grad=True)
        >>> norm = fadam.safe_norm(x, 0.5)
        >>> norm, torch.autograd.grad(norm, x)[0]
        (tensor(0.5000, grad_fn=<WhereBackward0>), tensor([0., 0., 0.]))

    References:
        optax's ``optax.safe_norm`` (0.2.8), whose semantics these are.
    """
    norm = torch.linalg.norm(x, ord=ord, dim=axis, keepdim=True)
    masked = torch.where(norm <= min_norm, torch.ones_like(x), x)
    if not keepdims:
        norm = norm.squeeze() if axis is None else norm.squeeze(axis)
    masked_norm = torch.linalg.norm(masked, ord=ord, dim=axis, keepdim=keepdims)
    return torch.where(norm <= min_norm, min_norm, masked_norm)


def safe_root_mean_squares(x: torch.Tensor, min_rms: float | torch.Tensor) -> torch.Tensor:
    r"""``max(rms(x), min_rms)`` whose gradient is 0, not NaN, where the RMS is at most ``min_rms``.

    .. math::
        \operatorname{rms}(x) = \sqrt{\tfrac{1}{n}\textstyle\sum_i |x_i|^2}

    Args:
        x: a tensor (complex by modulus).
        min_rms: the floor.

    Example:
        >>> import torch, fadam
        >>> fadam.safe_root_mean_squares(torch.tensor([3.0, -3.0]), 1.0), fadam.safe_root_mean_squares(
        ...     torch.zeros(2), 1e-3)
        (tensor(3.), tensor(0.0010))

    References:
        optax's ``optax.safe_root_mean_squares`` (0.2.8), whose semantics these are.
    """

    def rms(y: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.mean(y.abs().square() if y.is_complex() else y.square()))

    small = rms(x) <= min_rms
    return torch.where(small, min_rms, rms(torch.where(small, torch.ones_like(x), x)))


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, or ``count`` where that would overflow its dtype (an int32 step count stays at 2**31 - 1; a
    floating one at its dtype's largest value).

    Args:
        count: an integer or floating tensor.

    Example:
        >>> import torch, fadam
        >>> fadam.safe_increment(torch.tensor(1, dtype=torch.int32)), fadam.safe_increment(
        ...     torch.tensor(2**31 - 1, dtype=torch.int32))
        (tensor(2, dtype=torch.int32), tensor(2147483647, dtype=torch.int32))

    References:
        optax's ``optax.safe_increment`` (0.2.8), whose semantics these are.
    """
    if not isinstance(count, torch.Tensor):
        raise TypeError(f"safe_increment expects a tensor, got {type(count).__name__}")
    if count.dtype == torch.int32:  # fadam's step counts
        return _saturating_int32_increment(count)
    if count.dtype.is_floating_point:
        largest = torch.finfo(count.dtype).max
    elif not count.is_complex() and count.dtype != torch.bool:
        largest = torch.iinfo(count.dtype).max
    else:
        raise ValueError(
            f"Cannot safely increment a count of dtype {count.dtype}: expected an integer or floating dtype"
        )
    return torch.where(count < largest, count + 1, count)


safe_int32_increment = safe_increment  # optax's older name
