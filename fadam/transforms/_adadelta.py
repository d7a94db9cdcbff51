"""Adadelta's scaling: ``scale_by_adadelta`` (torch.optim.Adadelta's step direction, before the learning rate)."""

from __future__ import annotations

from typing import Any, NamedTuple

from fadam._base import GradientTransformation
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree


class ScaleByAdadeltaState(NamedTuple):
    square_avg: PyTree  # running average of squared gradients (torch.optim.Adadelta's ``square_avg``)
    acc_delta: PyTree  # running average of squared steps (its ``acc_delta``)


def check_adadelta_args(rho: float, eps: float) -> None:
    """torch.optim.Adadelta's checks of ``rho`` and ``eps``, with its messages."""
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"Invalid rho value: {rho}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    r"""Scales updates by the ratio of the running RMS of past steps to that of the gradients (Adadelta).

    .. math::
        v_t = \rho v_{t-1} + (1-\rho) g_t^2,\quad
        \Delta_t = \frac{\sqrt{a_{t-1} + \epsilon}}{\sqrt{v_t + \epsilon}}\, g_t,\quad
        a_t = \rho a_{t-1} + (1-\rho) \Delta_t^2,\quad u_t = \Delta_t

    Each operation rounds as torch.optim.Adadelta's for-loop implementation does; ``fadam.adadelta`` scales
    :math:`u_t` by :math:`-\eta`. Complex leaves are pairs of reals, as torch.optim treats them.

    Args:
        rho: decay :math:`\rho` of both running averages, in [0, 1].
        eps: :math:`\epsilon`, added inside both square roots.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_adadelta(rho=0.0, eps=1.0)
        >>> tx.update([torch.tensor([3.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([0.9487])]

    References:
        Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012.
    """
    check_adadelta_args(rho, eps)

    def prologue(count: None) -> dict[str, float]:
        return {"rho": rho, "one_minus_rho": 1 - rho, "eps": eps}

    def body(o: Any, s: Any, g: Any, p: Any, square_avg: Any, acc_delta: Any) -> tuple:
        g = o.cast(g, square_avg)
        square_avg = o.addcmul(square_avg * s.rho, g, g, s.one_minus_rho)
        std = o.sqrt(square_avg + s.eps)
        delta = o.sqrt(acc_delta + s.eps) / std * g  # torch.optim's delta.div_(std).mul_(grad)
        acc_delta = o.addcmul(acc_delta * s.rho, delta, delta, s.one_minus_rho)
        return delta, square_avg, acc_delta

    # averages of squares from zero with a decay in [0, 1]: never negative
    slots = (Slot("square_avg", nonnegative=True), Slot("acc_delta", nonnegative=True))
    return elementwise(Elementwise("scale_by_adadelta", ScaleByAdadeltaState, slots, False, prologue, body))
