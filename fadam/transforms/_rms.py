"""Scaling by running squared-gradient statistics: ``scale_by_rms`` and ``scale_by_stddev`` (RMSprop) and
``scale_by_rss`` (Adagrad).

optax's names and defaults; ``eps_in_sqrt=False`` gives torch.optim's placement of epsilon, outside the square root.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._leafwise import map_moments
from fadam.transforms._validation import check_non_negative, check_state


def _full(params: PyTree, value: float) -> PyTree:
    # a complex leaf gets ``value`` in both its real and imaginary parts: its statistics are per component
    check_params(params)
    return tree_map(
        lambda p: None if p is None else torch.full_like(p, complex(value, value) if p.is_complex() else value), params
    )


def _scale(g: torch.Tensor, second: torch.Tensor, eps: float, eps_in_sqrt: bool) -> torch.Tensor:
    return g * torch.rsqrt(second + eps) if eps_in_sqrt else g / (second.sqrt() + eps)


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

    def update(
        updates: PyTree, state: ScaleByRmsState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByRmsState]:
        check_state(state, ScaleByRmsState, "scale_by_rms")
        grads, nus, spec = check_leaves(updates, state.nu, like_what="the RMS state (params)")

        def leaf(g: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            g = g.to(nu.dtype)
            nu_new = torch.addcmul(nu * decay, g, g, value=1 - decay)
            return _scale(g, nu_new, eps, eps_in_sqrt), nu_new

        new_updates, (new_nus,) = map_moments(leaf, grads, nus)
        return spec.unflatten(new_updates), ScaleByRmsState(spec.unflatten(new_nus))

    return GradientTransformation(init, update)


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

    def update(
        updates: PyTree, state: ScaleByRStdDevState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByRStdDevState]:
        check_state(state, ScaleByRStdDevState, "scale_by_stddev")
        grads, mus, spec = check_leaves(updates, state.mu, like_what="the stddev state (params)")
        nus = spec.flatten_up_to(state.nu)

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            g = g.to(nu.dtype)
            nu_new = torch.addcmul(nu * decay, g, g, value=1 - decay)
            mu_new = mu.lerp(g, 1 - decay)
            return _scale(g, torch.addcmul(nu_new, mu_new, mu_new, value=-1), eps, eps_in_sqrt), mu_new, nu_new

        new_updates, (new_mus, new_nus) = map_moments(leaf, grads, mus, nus)
        return spec.unflatten(new_updates), ScaleByRStdDevState(spec.unflatten(new_mus), spec.unflatten(new_nus))

    return GradientTransformation(init, update)


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

    def update(
        updates: PyTree, state: ScaleByRssState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByRssState]:
        check_state(state, ScaleByRssState, "scale_by_rss")
        grads, sums, spec = check_leaves(updates, state.sum_of_squares, like_what="the Adagrad state (params)")

        def leaf(g: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, ...]:
            g = g.to(total.dtype)
            total_new = torch.addcmul(total, g, g)
            if eps_in_sqrt:
                u = torch.where(total_new > 0, g * torch.rsqrt(total_new + eps), torch.zeros_like(g))
            else:
                u = g / (total_new.sqrt() + eps)
            return u, total_new

        new_updates, (new_sums,) = map_moments(leaf, grads, sums)
        return spec.unflatten(new_updates), ScaleByRssState(spec.unflatten(new_sums))

    return GradientTransformation(init, update)
