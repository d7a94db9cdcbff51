"""Normalization by the updates' global norm: ``normalize_by_update_norm``."""

from __future__ import annotations

from typing import Any

import torch

from fadam._base import EmptyState, GradientTransformation
from fadam._program import Elementwise, elementwise
from fadam._tree import tree_global_norm
from fadam.transforms._validation import check_non_negative


def normalize_by_update_norm(
    scale_factor: float | torch.Tensor = 1.0, eps: float | torch.Tensor = 1e-6
) -> GradientTransformation:
    r"""Divides all updates by their global L2 norm, then multiplies them by ``scale_factor``.

    .. math::
        u = \frac{g}{(\|g\|_2 + \epsilon) / s}

    The norm runs over every element of every leaf (complex leaves by modulus), as in ``clip_by_global_norm``.

    Args:
        scale_factor: the factor :math:`s` (the norm of the result, up to ``eps``).
        eps: added to the norm.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.normalize_by_update_norm(eps=0.0)
        >>> tx.update([torch.tensor([3.0, 4.0])], tx.init(None))[0]
        [tensor([0.6000, 0.8000])]

    References:
        optax's ``optax.normalize_by_update_norm`` (0.2.8), whose semantics these are.
    """
    check_non_negative("eps", eps)

    def reduce(updates: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        return {"divisor": (tree_global_norm(updates) + eps) / scale_factor}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (g / s.divisor,)

    return elementwise(
        Elementwise("normalize_by_update_norm", EmptyState, (), False, lambda count: {}, body, reduce=reduce)
    )
