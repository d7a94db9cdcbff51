"""AdaBelief's scaling: ``scale_by_belief`` (Adam whose second moment is that of the gradient's surprise, its
distance from the first moment)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, safe_increment
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByBeliefState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # first moment
    nu: PyTree  # second moment of the prediction error g - m, plus eps_root at every step


def scale_by_belief(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-16,
    eps_root: float | torch.Tensor = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    r"""Rescales updates by AdaBelief's moments (optax's ``scale_by_belief``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
        s_t = \beta_2 s_{t-1} + (1-\beta_2)(g_t - m_t)^2 + \epsilon_{root},\quad
        u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{s_t/(1-\beta_2^t)} + \epsilon}

    With ``nesterov``, the numerator is :math:`\beta_1 m_t/(1-\beta_1^{t+1}) + (1-\beta_1) g_t/(1-\beta_1^t)`. The
    prediction error is taken against the new first moment :math:`m_t`, as optax does. Complex leaves are treated as
    pairs of reals.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment of the prediction error.
        eps: added to the denominator outside the square root.
        eps_root: added to the second moment at every step (must be > 0 for meta-gradients).
        nesterov: Nesterov momentum in the numerator.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_belief()
        >>> u, state = tx.update([torch.tensor([1.0, -2.0])], tx.init([torch.zeros(2)]))
        >>> u[0].round(decimals=4)  # m = 0.1 g, s = 0.001 (0.9 g)^2: 0.1 g / 0.1 / (0.9 |g|)
        tensor([ 1.1111, -1.1111])

    References:
        Zhuang et al., "AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed Gradients", NeurIPS 2020.
        optax's ``optax.scale_by_belief`` (0.2.8), whose semantics these are.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        steps = safe_increment(count)
        bc1 = bias_correction(b1, steps)
        scalars = {
            "one_minus_b1": 1 - b1,
            "b2": b2,
            "one_minus_b2": 1 - b2,
            "eps_root": eps_root,
            "bc2": bias_correction(b2, steps),
            "eps": eps,
        }
        if nesterov:  # b1 m_t / (1 - b1^(t+1)) + (1 - b1) g_t / (1 - b1^t)
            scalars |= {"mu_weight": b1 / bias_correction(b1, safe_increment(steps)), "g_weight": (1 - b1) / bc1}
        else:
            scalars["bc1"] = bc1
        return {name: host_number(value) for name, value in scalars.items()}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g = o.cast(g, mu)
        mu = o.lerp(mu, g, s.one_minus_b1)
        error = g - mu
        nu = o.addcmul(nu * s.b2, error, error, s.one_minus_b2) + s.eps_root
        numer = mu * s.mu_weight + g * s.g_weight if nesterov else mu / s.bc1
        return numer / (o.sqrt(nu / s.bc2) + s.eps), mu, nu

    slots = (Slot("mu"), Slot("nu", nonnegative=True))
    return elementwise(Elementwise("scale_by_belief", ScaleByBeliefState, slots, True, prologue, body))
