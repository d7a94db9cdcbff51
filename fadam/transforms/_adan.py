"""Adan's scaling: ``scale_by_adan`` (Nesterov momentum estimated from the gradients' differences, with Adam-style
moments of the gradient, of its differences and of their combination squared)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, safe_increment
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByAdanState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (optax's ``t``)
    m: PyTree  # moment of the gradients
    v: PyTree  # moment of the gradients' differences
    n: PyTree  # moment of the squared Nesterov combination
    g: PyTree  # the previous gradient


def scale_by_adan(
    b1: float | torch.Tensor = 0.98,
    b2: float | torch.Tensor = 0.92,
    b3: float | torch.Tensor = 0.99,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
) -> GradientTransformation:
    r"""Rescales updates by Adan's three bias-corrected moments (optax's ``scale_by_adan``).

    .. math::
        \Delta_t = g_t - g_{t-1}\ (\Delta_1 = 0),\quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2)\Delta_t,

        n_t = \beta_3 n_{t-1} + (1-\beta_3)\left(g_t + (1-\beta_2)\Delta_t\right)^2,\quad
        u_t = \frac{\hat m_t + (1-\beta_2)\hat v_t}{\sqrt{\hat n_t + \epsilon_{root}} + \epsilon}

    where :math:`\hat x_t = x_t / (1-\beta^t)` with each moment's own decay. The betas are decays (the weight of the
    past), as in optax; the paper writes :math:`1-\beta`. Complex leaves are treated as pairs of reals.

    Args:
        b1: decay of the gradients' moment.
        b2: decay of the differences' moment.
        b3: decay of the squared combination's moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (meta-gradients).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_adan(eps=0.0)
        >>> u, state = tx.update([torch.tensor([2.0, -0.5])], tx.init([torch.zeros(2)]))
        >>> u  # the first step: m_hat = g, v = 0, n_hat = g^2
        [tensor([ 1., -1.])]

    References:
        Xie et al., "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models", 2022
        (Algorithm 1). optax's ``optax.scale_by_adan`` (0.2.8), whose semantics these are.
    """
    for name, value in (("b1", b1), ("b2", b2), ("b3", b3)):
        check_unit_interval(name, value)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        steps = safe_increment(count)
        taken = host_number(count)
        # no previous gradient on the first step: its difference is 0 (optax's tree.where on t == 0)
        if isinstance(taken, torch.Tensor):
            has_previous: float | torch.Tensor = torch.where(taken == 0, 0.0, 1.0).to(torch.float64)
        else:
            has_previous = 0.0 if taken == 0 else 1.0
        scalars = {
            "has_previous": has_previous,
            "b1": b1,
            "one_minus_b1": 1 - b1,
            "b2": b2,
            "one_minus_b2": 1 - b2,
            "b3": b3,
            "one_minus_b3": 1 - b3,
            "bc1": bias_correction(b1, steps),
            "bc2": bias_correction(b2, steps),
            "bc3": bias_correction(b3, steps),
            "eps": eps,
            "eps_root": eps_root,
        }
        return {name: host_number(value) for name, value in scalars.items()}

    def body(o: Any, s: Any, u: Any, p: Any, m: Any, v: Any, n: Any, g_prev: Any) -> tuple:
        g = o.cast(u, m)
        diff = (g - g_prev) * s.has_previous
        # optax's update_moment, (1 - b) x + b t, in its order of operations
        m = g * s.one_minus_b1 + m * s.b1
        v = diff * s.one_minus_b2 + v * s.b2
        combined = g + diff * s.one_minus_b2
        n = combined * combined * s.one_minus_b3 + n * s.b3
        direction = m / s.bc1 + v / s.bc2 * s.one_minus_b2
        return direction / (o.sqrt(n / s.bc3 + s.eps_root) + s.eps), m, v, n, g

    slots = (Slot("m"), Slot("v"), Slot("n", nonnegative=True), Slot("g"))
    return elementwise(Elementwise("scale_by_adan", ScaleByAdanState, slots, True, prologue, body))
