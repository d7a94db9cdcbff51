"""Resilient backpropagation: ``scale_by_rprop`` (torch.optim.Rprop's per-element step sizes)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._numerics import zero_count
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree, check_params, tree_map
from fadam.transforms._validation import check_non_negative


class ScaleByRpropState(NamedTuple):
    prev: PyTree  # the previous step's gradient, zeroed where its sign flipped (torch.optim.Rprop's ``prev``)
    step_size: PyTree  # per-element step sizes (its ``step_size``)


def check_rprop_args(etas: tuple[float, float], step_sizes: tuple[float, float]) -> None:
    """torch.optim.Rprop's check of ``etas`` with its message, and that the step-size bounds are ordered."""
    if not 0.0 < etas[0] < 1.0 < etas[1]:
        raise ValueError(f"Invalid eta values: {etas[0]}, {etas[1]}")
    if not 0.0 <= step_sizes[0] <= step_sizes[1]:
        raise ValueError(f"Invalid step_sizes values: {step_sizes[0]}, {step_sizes[1]}")


def _initial_step(lr: ScalarOrSchedule) -> float:
    """The learning rate the step sizes start from (a schedule's value at step 0), as a number."""
    value = lr(zero_count()) if callable(lr) else lr
    return float(value)


def scale_by_rprop(
    lr: ScalarOrSchedule = 1e-2, etas: tuple[float, float] = (0.5, 1.2), step_sizes: tuple[float, float] = (1e-6, 50)
) -> GradientTransformation:
    r"""Steps each element by its own step size, grown while its gradient keeps its sign and shrunk when it flips
    (Rprop, as torch.optim.Rprop).

    .. math::
        s = \operatorname{sign}(g_t\, g_{t-1}),\quad
        f = \begin{cases}\eta_+ & s > 0\\ \eta_- & s < 0\\ 1 & s = 0\end{cases},\quad
        \delta_t = \operatorname{clamp}(f\,\delta_{t-1}, \delta_{\min}, \delta_{\max}),\quad
        g_t \leftarrow 0 \text{ where } s < 0,\quad u_t = \operatorname{sign}(g_t)\, \delta_t

    with :math:`\delta_0 = \eta` and :math:`g_0 = 0`; the zeroed :math:`g_t` is kept as the next step's
    :math:`g_{t-1}`. ``fadam.rprop`` negates :math:`u_t`. Unlike optax's Rprop, the step size is clamped on every
    step (also where :math:`s = 0`), as torch's is. Complex leaves are pairs of reals, as torch.optim treats them.

    Args:
        lr: the initial step size :math:`\eta` (a float, a 0-d tensor, or a schedule, read at step 0).
        etas: the factors :math:`(\eta_-, \eta_+)`, with :math:`0 < \eta_- < 1 < \eta_+`.
        step_sizes: the bounds :math:`(\delta_{\min}, \delta_{\max})` of the step sizes.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_rprop(lr=0.1)
        >>> state = tx.init([torch.zeros(2)])
        >>> updates, state = tx.update([torch.tensor([2.0, -1.0])], state)
        >>> updates, state.step_size
        ([tensor([ 0.1000, -0.1000])], [tensor([0.1000, 0.1000])])

    References:
        Riedmiller & Braun, "A Direct Adaptive Method for Faster Backpropagation Learning: The RPROP Algorithm",
        1993.
    """
    if not callable(lr):
        check_non_negative("lr", lr)
    check_rprop_args(etas, step_sizes)
    etaminus, etaplus = etas
    step_size_min, step_size_max = step_sizes

    def init(params: PyTree) -> ScaleByRpropState:
        check_params(params)
        first = _initial_step(lr)
        # a complex leaf steps its real and imaginary parts alike (torch.optim's complex(lr, lr))
        filled = tree_map(
            lambda p: None if p is None else torch.full_like(p, complex(first, first) if p.is_complex() else first),
            params,
        )
        return ScaleByRpropState(tree_map(lambda p: None if p is None else torch.zeros_like(p), params), filled)

    def prologue(count: None) -> dict[str, float]:
        return {"etaminus": etaminus, "etaplus": etaplus, "low": step_size_min, "high": step_size_max}

    def body(o: Any, s: Any, g: Any, p: Any, prev: Any, step_size: Any) -> tuple:
        g = o.cast(g, prev)
        sign = o.sign(g * prev)
        # each branch scales the step size itself: a where between two numbers would round them to float32
        shrunk = o.where(sign < 0, step_size * s.etaminus, step_size)
        step_size = o.clamp(o.where(sign > 0, step_size * s.etaplus, shrunk), s.low, s.high)
        g = o.where(sign < 0, 0.0, g)  # where the step size shrank (torch tests factor == etaminus)
        return o.sign(g) * step_size, g, step_size

    # bounds checked >= 0 and factors > 0: the step sizes stay in [low, high]
    slots = (Slot("prev"), Slot("step_size", nonnegative=True))
    decl = Elementwise("scale_by_rprop", ScaleByRpropState, slots, False, prologue, body)
    return GradientTransformation(init, elementwise(decl).update)
