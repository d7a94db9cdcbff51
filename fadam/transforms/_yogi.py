"""Yogi's scaling: ``scale_by_yogi`` (Adam whose second moment moves additively, by at most the squared gradient)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, safe_increment, zero_count
from fadam._program import Elementwise, Slot
from fadam._tree import PyTree
from fadam.transforms._rms import _declared, _full
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByYogiState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # first moment
    nu: PyTree  # second moment, kept > 0 by its additive update


def scale_by_yogi(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-3,
    eps_root: float | torch.Tensor = 0.0,
    initial_accumulator_value: float = 1e-6,
) -> GradientTransformation:
    r"""Rescales updates by Yogi's moments (optax's ``scale_by_yogi``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
        v_t = v_{t-1} - (1-\beta_2)\operatorname{sign}(v_{t-1} - g_t^2)\, g_t^2,\quad
        u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}

    Both moments start at ``initial_accumulator_value``, as in optax and the paper. Complex leaves are treated as
    pairs of reals (that value in both components).

    Args:
        b1: decay of the first moment.
        b2: rate of the second moment's additive update.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (meta-gradients).
        initial_accumulator_value: the moments' initial value (> 0 keeps the second moment positive).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_yogi(initial_accumulator_value=0.0, eps=0.0)
        >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
        [tensor([ 1., -1.])]

    References:
        Zaheer et al., "Adaptive Methods for Nonconvex Optimization", NeurIPS 2018.
        optax's ``optax.scale_by_yogi`` (0.2.8), whose semantics these are.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)
    check_non_negative("initial_accumulator_value", initial_accumulator_value)
    rooted = isinstance(eps_root, torch.Tensor) or eps_root != 0.0

    def init(params: PyTree) -> ScaleByYogiState:
        return ScaleByYogiState(
            zero_count(),
            _full(params, initial_accumulator_value),
            _full(params, initial_accumulator_value),
        )

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        steps = safe_increment(count)
        scalars = {
            "one_minus_b1": 1 - b1,
            "one_minus_b2": 1 - b2,
            "bc1": bias_correction(b1, steps),
            "bc2": bias_correction(b2, steps),
            "eps": eps,
        }
        if rooted:
            scalars["eps_root"] = eps_root
        return {name: host_number(value) for name, value in scalars.items()}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g = o.cast(g, mu)
        mu = o.lerp(mu, g, s.one_minus_b1)
        g_sq = g * g
        nu = nu - o.sign(nu - g_sq) * g_sq * s.one_minus_b2
        nu_hat = nu / s.bc2
        return mu / s.bc1 / (o.sqrt(nu_hat + s.eps_root if rooted else nu_hat) + s.eps), mu, nu

    slots = (Slot("mu"), Slot("nu", nonnegative=True))  # the initial value is checked non-negative
    return _declared(Elementwise("scale_by_yogi", ScaleByYogiState, slots, True, prologue, body), init)
