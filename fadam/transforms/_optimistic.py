"""Optimistic gradients: ``scale_by_optimistic_gradient`` (the current gradient plus its change since the last
step, the one-call approximation of extra-gradient methods)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import host_number
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree


class ScaleByOptimisticGradientState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (optax keeps whether this is the first, ``is_initial_step``)
    previous_gradient: PyTree


def scale_by_optimistic_gradient(
    alpha: float | torch.Tensor = 1.0, beta: float | torch.Tensor = 1.0
) -> GradientTransformation:
    r"""Optimistic gradient: the gradient plus ``beta`` times its change (optax's ``scale_by_optimistic_gradient``).

    .. math::
        u_t = (\alpha + \beta)\, g_t - \beta\, g_{t-1},\qquad g_0 = g_1

    (the first step has no previous gradient and uses the current one: :math:`u_1 = \alpha g_1`).

    Args:
        alpha: the gradient's coefficient.
        beta: the coefficient of its change (the negative momentum).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_optimistic_gradient()
        >>> u, state = tx.update([torch.tensor([1.0, 2.0])], tx.init([torch.zeros(2)]))
        >>> tx.update([torch.tensor([3.0, 2.0])], state)[0]  # 2 g_2 - g_1
        [tensor([5., 2.])]

    References:
        Mokhtari et al., "A Unified Analysis of Extra-gradient and Optimistic Gradient Methods for Saddle Point
        Problems: Proximal Point Approach", AISTATS 2020. optax's ``optax.scale_by_optimistic_gradient`` (0.2.8),
        whose semantics these are.
    """

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        taken = host_number(count)
        # beta multiplies the current gradient on the first step and the previous one after it; the other term is
        # multiplied by 0, so that each step rounds as optax's (alpha + beta) g - beta g_prev does
        if isinstance(taken, torch.Tensor):
            first = taken == 0
            beta64 = torch.as_tensor(beta, dtype=torch.float64)
            on_current, on_previous = torch.where(first, beta64, 0.0), torch.where(first, 0.0, beta64)
        else:
            on_current, on_previous = (beta, 0.0) if taken == 0 else (0.0, beta)
        scalars = {"alpha_plus_beta": alpha + beta, "on_current": on_current, "on_previous": on_previous}
        return {name: host_number(value) for name, value in scalars.items()}

    def body(o: Any, s: Any, g: Any, p: Any, previous: Any) -> tuple:
        g = o.cast(g, previous)
        return g * s.alpha_plus_beta - (g * s.on_current + previous * s.on_previous), g

    slots = (Slot("previous_gradient"),)
    return elementwise(
        Elementwise("scale_by_optimistic_gradient", ScaleByOptimisticGradientState, slots, True, prologue, body)
    )
