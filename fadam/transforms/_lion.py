"""Lion's sign update: ``scale_by_lion``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_unit_interval


class ScaleByLionState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # momentum


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Replaces updates by the sign of an interpolation between momentum and gradient (Lion).

    .. math::
        u_t = \operatorname{sign}\left(\beta_1 m_{t-1} + (1-\beta_1) g_t\right),\qquad
        m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

    Complex leaves take the sign of the real and imaginary parts separately.

    Args:
        b1: interpolation weight of the momentum in the update.
        b2: decay of the momentum.
        mu_dtype: dtype of the momentum (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_lion()
        >>> tx.update([torch.tensor([0.3, -2.0, 0.0])], tx.init([torch.zeros(3)]))[0]
        [tensor([ 1., -1.,  0.])]

    References:
        Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023 (Algorithm 2).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)

    def prologue(count: torch.Tensor | None) -> dict[str, float]:
        return {"one_minus_b1": 1 - b1, "one_minus_b2": 1 - b2}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any) -> tuple:
        g = o.cast(g, mu)
        return o.sign(o.lerp(mu, g, s.one_minus_b1)), o.lerp(mu, g, s.one_minus_b2)

    return elementwise(Elementwise("scale_by_lion", ScaleByLionState, (Slot("mu", mu_dtype),), True, prologue, body))
