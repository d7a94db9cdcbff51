"""AdEMAMix's scaling: ``scale_by_ademamix`` (Adam's fast momentum mixed with a slow one)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._numerics import bias_correction, host_number, safe_increment
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByAdemamixState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (optax's count and count_m2, which are always equal)
    m1: PyTree  # fast momentum (decay b1), bias-corrected in the update
    m2: PyTree  # slow momentum (decay b3), not bias-corrected
    nu: PyTree  # second moment


def _at(value: ScalarOrSchedule, count: torch.Tensor) -> float | torch.Tensor:
    """A hyperparameter's value for this step: a schedule evaluated at the steps taken so far."""
    return value(count) if callable(value) else value


def scale_by_ademamix(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 6.0,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Rescales updates by AdEMAMix: Adam's bias-corrected momentum plus ``alpha`` times a slow momentum.

    .. math::
        m^{(1)}_t = \beta_1 m^{(1)}_{t-1} + (1-\beta_1) g_t,\quad
        m^{(2)}_t = \beta_3 m^{(2)}_{t-1} + (1-\beta_3) g_t,\quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\\
        u_t = \frac{m^{(1)}_t/(1-\beta_1^t) + \alpha\, m^{(2)}_t}{\sqrt{v_t/(1-\beta_2^t) + \bar\epsilon} + \epsilon}

    ``b3`` and ``alpha`` may be schedules, evaluated at the steps taken before this one (the paper warms both up
    over its long runs). The three moments are kept in ``mu_dtype`` (optax's choice, the second moment included).
    Complex leaves are treated as pairs of reals.

    Args:
        b1: decay of the fast momentum.
        b2: decay of the second moment.
        b3: decay of the slow momentum: a number or a schedule.
        alpha: weight of the slow momentum: a number or a schedule.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (meta-gradients).
        mu_dtype: dtype of the moments (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_ademamix(alpha=2.0, b3=0.5, eps=0.0)
        >>> tx.update([torch.tensor([1.0, -4.0])], tx.init([torch.zeros(2)]))[0]  # (1 + 2 * 0.5) * sign(g)
        [tensor([ 2., -2.])]

    References:
        Pagliardini et al., "The AdEMAMix Optimizer: Better, Faster, Older", 2024.
        optax's ``optax.contrib.scale_by_ademamix`` (0.2.8), whose semantics these are.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    if not callable(b3):
        check_unit_interval("b3", b3)
    if not callable(alpha):
        check_non_negative("alpha", alpha)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)
    rooted = isinstance(eps_root, torch.Tensor) or eps_root != 0.0

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        steps = safe_increment(count)
        scalars = {
            "one_minus_b1": 1 - b1,
            "one_minus_b3": 1 - _at(b3, count),
            "b2": b2,
            "one_minus_b2": 1 - b2,
            "alpha": _at(alpha, count),
            "bc1": bias_correction(b1, steps),
            "bc2": bias_correction(b2, steps),
            "eps": eps,
        }
        if rooted:
            scalars["eps_root"] = eps_root
        return {name: host_number(value) for name, value in scalars.items()}

    def body(o: Any, s: Any, g: Any, p: Any, m1: Any, m2: Any, nu: Any) -> tuple:
        g = o.cast(g, m1)
        m1 = o.lerp(m1, g, s.one_minus_b1)
        m2 = o.lerp(m2, g, s.one_minus_b3)
        nu = o.addcmul(nu * s.b2, g, g, s.one_minus_b2)
        nu_hat = nu / s.bc2
        denom = o.sqrt(nu_hat + s.eps_root if rooted else nu_hat) + s.eps
        return (m1 / s.bc1 + m2 * s.alpha) / denom, m1, m2, nu

    slots = (Slot("m1", mu_dtype), Slot("m2", mu_dtype), Slot("nu", mu_dtype, nonnegative=True))
    return elementwise(Elementwise("scale_by_ademamix", ScaleByAdemamixState, slots, True, prologue, body))
