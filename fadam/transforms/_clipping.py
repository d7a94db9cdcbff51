"""Clipping of updates, elementwise or by their global norm."""

from __future__ import annotations

from typing import Any

import torch

from fadam._base import EmptyState, GradientTransformation
from fadam._program import Elementwise, elementwise
from fadam._tree import tree_global_norm
from fadam.transforms._validation import check_non_negative


def clip(max_delta: float | torch.Tensor) -> GradientTransformation:
    r"""Clips every update element to :math:`[-\delta, \delta]`.

    Args:
        max_delta: the bound :math:`\delta`.

    Example:
        >>> import torch, fadam
        >>> fadam.clip(1.0).update([torch.tensor([-3.0, 0.5, 2.0])], fadam.EmptyState())[0]
        [tensor([-1.0000,  0.5000,  1.0000])]
    """
    check_non_negative("max_delta", max_delta)

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (o.clamp(g, s.low, s.high),)

    return elementwise(
        Elementwise("clip", EmptyState, (), False, lambda count: {"low": -max_delta, "high": max_delta}, body)
    )


def clip_by_global_norm(max_norm: float | torch.Tensor) -> GradientTransformation:
    r"""Rescales all updates together when their global L2 norm exceeds ``max_norm``.

    .. math::
        u = g \cdot \frac{\text{max\_norm}}{\max(\|g\|_2, \text{max\_norm})}

    The norm runs over every element of every leaf (complex leaves by modulus); ``None`` updates are ignored. Leaves
    may live on several devices, and may be DTensors (the norm is then reduced across ranks; see ``tree_global_norm``).

    Args:
        max_norm: the largest global norm allowed.

    Example:
        >>> import torch, fadam
        >>> fadam.clip_by_global_norm(1.0).update([torch.tensor([3.0, 4.0])], fadam.EmptyState())[0]
        [tensor([0.6000, 0.8000])]
    """
    check_non_negative("max_norm", max_norm)

    def reduce(updates: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        norm = tree_global_norm(updates)
        return {"factor": max_norm / torch.clamp(norm, min=max_norm)}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (g * s.factor,)

    return elementwise(Elementwise("clip_by_global_norm", EmptyState, (), False, lambda count: {}, body, reduce=reduce))


def clip_by_block_rms(threshold: float | torch.Tensor) -> GradientTransformation:
    r"""Rescales each leaf whose root mean square exceeds ``threshold`` (Adafactor's update clipping).

    .. math::
        u = \frac{g}{\max\left(1, \operatorname{rms}(g) / d\right)}

    Args:
        threshold: the largest root mean square :math:`d` allowed per leaf.

    Example:
        >>> import torch, fadam
        >>> fadam.clip_by_block_rms(1.0).update([torch.tensor([4.0, -4.0])], fadam.EmptyState())[0]
        [tensor([ 1., -1.])]

    References:
        Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018 (section 6).
    """
    check_non_negative("threshold", threshold)

    def reduce_leaf(g: torch.Tensor, p: torch.Tensor | None) -> dict[str, torch.Tensor]:
        rms = torch.linalg.vector_norm(g) / (max(g.numel(), 1) ** 0.5)
        return {"divisor": torch.clamp(rms / threshold, min=1.0).to(g.real.dtype)}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (g / s.divisor,)

    return elementwise(
        Elementwise("clip_by_block_rms", EmptyState, (), False, lambda count: {}, body, reduce_leaf=reduce_leaf)
    )
