"""Scaling by running squared-gradient statistics: ``scale_by_rms`` and ``scale_by_stddev`` (RMSprop) and
``scale_by_rss`` (Adagrad).

optax's names and defaults; ``eps_in_sqrt=False`` gives torch.optim's placement of epsilon, outside the square root.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._program import Elementwise, Slot, SparseRule, elementwise
from fadam._tree import PyTree, check_params, tree_map
from fadam.transforms._validation import check_non_negative


def _full(params: PyTree, value: float) -> PyTree:
    # a complex leaf gets ``value`` in both its real and imaginary parts: its statistics are per component
    check_params(params)
    return tree_map(
        lambda p: None if p is None else torch.full_like(p, complex(value, value) if p.is_complex() else value), params
    )


def _scale(o: Any, s: Any, g: Any, second: Any, eps_in_sqrt: bool) -> Any:
    if eps_in_sqrt:  # optax's g * rsqrt(v + eps)
        return g * o.rsqrt(second + s.eps)
    return g / (o.sqrt(second) + s.eps)


def _declared(decl: Elementwise, init: Any) -> GradientTransformation:
    """``decl``'s transform with ``init``'s state (nonzero initial values)."""
    return GradientTransformation(init, elementwise(decl).update)


class ScaleByRmsState(NamedTuple):
    nu: PyTree  # running average of squared gradients (torch.optim.RMSprop's ``square_avg``)


def scale_by_rms(
    decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0, *, eps_in_sqrt: bool = True
) -> GradientTransformation:
    r"""Divides updates by the root of a running average of their squares (RMSprop).

    .. math::
        v_t = \rho v_{t-1} + (1-\rho) g_t^2,\qquad
        u_t = \frac{g_t}{\sqrt{v_t + \epsilon}}\ \text{(eps\_in\_sqrt)}\quad\text{or}\quad
        \frac{g_t}{\sqrt{v_t} + \epsilon}\ \text{(torch.optim.RMSprop)}

    Args:
        decay: the decay :math:`\rho` (torch.optim's ``alpha``).
        eps: the term keeping the denominator away from zero.
        initial_scale: initial value of :math:`v`.
        eps_in_sqrt: put :math:`\epsilon` inside the square root (optax's default) or outside it (torch's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_rms(decay=0.75, eps=0.0)
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([2.])]

    References:
        Hinton, "Lecture 6.5: RMSprop", Coursera: Neural Networks for Machine Learning, 2012.
    """
    check_non_negative("alpha", decay)
    check_non_negative("eps", eps)

    def init(params: PyTree) -> ScaleByRmsState:
        return ScaleByRmsState(_full(params, initial_scale))

    def prologue(count: None) -> dict[str, float]:
        return {"decay": decay, "one_minus_decay": 1 - decay, "eps": eps}

    def body(o: Any, s: Any, g: Any, p: Any, nu: Any) -> tuple:
        g = o.cast(g, nu)
        nu = o.addcmul(nu * s.decay, g, g, s.one_minus_decay)
        return _scale(o, s, g, nu, eps_in_sqrt), nu

    nu = Slot("nu", nonnegative=decay <= 1 and initial_scale >= 0)  # an average of squares from a non-negative start
    decl = Elementwise("scale_by_rms", ScaleByRmsState, (nu,), False, prologue, body)
    return _declared(decl, init)


class ScaleByRStdDevState(NamedTuple):
    mu: PyTree  # running average of gradients (torch.optim.RMSprop's ``grad_avg``)
    nu: PyTree  # running average of squared gradients


def scale_by_stddev(
    decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0, *, eps_in_sqrt: bool = True
) -> GradientTransformation:
    r"""Divides updates by a running estimate of their standard deviation (centered RMSprop).

    .. math::
        m_t = \rho m_{t-1} + (1-\rho) g_t,\quad v_t = \rho v_{t-1} + (1-\rho) g_t^2,\quad
        u_t = \frac{g_t}{\sqrt{v_t - m_t^2 + \epsilon}}\ \text{or}\ \frac{g_t}{\sqrt{v_t - m_t^2} + \epsilon}

    Args:
        decay: the decay :math:`\rho` (torch.optim's ``alpha``).
        eps: the term keeping the denominator away from zero.
        initial_scale: initial value of :math:`v`.
        eps_in_sqrt: put :math:`\epsilon` inside the square root (optax's default) or outside it (torch's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_stddev(decay=0.5, eps=0.0)
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([2.])]

    References:
        Graves, "Generating Sequences With Recurrent Neural Networks", 2013.
    """
    check_non_negative("alpha", decay)
    check_non_negative("eps", eps)

    def init(params: PyTree) -> ScaleByRStdDevState:
        return ScaleByRStdDevState(_full(params, 0.0), _full(params, initial_scale))

    def prologue(count: None) -> dict[str, float]:
        return {"decay": decay, "one_minus_decay": 1 - decay, "eps": eps}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g = o.cast(g, nu)
        nu = o.addcmul(nu * s.decay, g, g, s.one_minus_decay)
        mu = o.lerp(mu, g, s.one_minus_decay)
        return _scale(o, s, g, o.addcmul(nu, mu, mu, -1.0), eps_in_sqrt), mu, nu  # v - m^2 as torch.optim

    nu = Slot("nu", nonnegative=decay <= 1 and initial_scale >= 0)
    decl = Elementwise("scale_by_stddev", ScaleByRStdDevState, (Slot("mu"), nu), False, prologue, body)
    return _declared(decl, init)


class ScaleByRssState(NamedTuple):
    sum_of_squares: PyTree  # torch.optim.Adagrad's ``sum``


def scale_by_rss(
    initial_accumulator_value: float = 0.1, eps: float = 1e-7, *, eps_in_sqrt: bool = True
) -> GradientTransformation:
    r"""Divides updates by the root of the sum of all their past squares (Adagrad).

    .. math::
        s_t = s_{t-1} + g_t^2,\qquad
        u_t = \frac{g_t}{\sqrt{s_t + \epsilon}}\ \text{(eps\_in\_sqrt; 0 where } s_t = 0)\quad\text{or}\quad
        \frac{g_t}{\sqrt{s_t} + \epsilon}\ \text{(torch.optim.Adagrad)}

    Args:
        initial_accumulator_value: initial value of :math:`s`.
        eps: the term keeping the denominator away from zero.
        eps_in_sqrt: optax's placement of :math:`\epsilon` (inside the root, zero update where the sum is zero) or
            torch's (outside).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_rss(0.0, 0.0)
        >>> tx.update([torch.tensor([-3.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([-1.])]

    References:
        Duchi et al., "Adaptive Subgradient Methods for Online Learning and Stochastic Optimization", 2011.
    """
    check_non_negative("initial_accumulator_value", initial_accumulator_value)
    check_non_negative("eps", eps)

    def init(params: PyTree) -> ScaleByRssState:
        return ScaleByRssState(_full(params, initial_accumulator_value))

    def prologue(count: None) -> dict[str, float]:
        return {"eps": eps}

    def body(o: Any, s: Any, g: Any, p: Any, total: Any) -> tuple:
        g = o.cast(g, total)
        total = o.addcmul(total, g, g, 1.0)
        u = _scale(o, s, g, total, eps_in_sqrt)
        return (o.where(total > 0, u, 0.0) if eps_in_sqrt else u), total

    slots = (Slot("sum_of_squares", nonnegative=True),)  # the initial value is checked non-negative
    options = (("initial_accumulator_value", initial_accumulator_value), ("eps", eps), ("eps_in_sqrt", eps_in_sqrt))
    # a sparse gradient updates its stored elements only, as torch.optim.Adagrad's sparse path does
    decl = Elementwise(
        "scale_by_rss", ScaleByRssState, slots, False, prologue, body, options=options, sparse=SparseRule()
    )
    return _declared(decl, init)
