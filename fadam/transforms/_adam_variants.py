"""Adam's relatives: NAdam (``scale_by_nadam``), RAdam (``scale_by_radam``) and Adamax (``scale_by_adamax``).

Each follows the matching ``torch.optim`` class's arithmetic: bias corrections in float64 from the step count, moments
in the param's dtype, complex leaves per real and imaginary component.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, safe_increment
from fadam._program import Carried, Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, check_unit_interval


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives its 0-d state scalars (``mu_product``): float64 only under a float64 default."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class ScaleByNadamState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu_product: torch.Tensor  # 0-d: product of the momentum schedule so far (torch.optim.NAdam's ``mu_product``)
    mu: PyTree  # first moment
    nu: PyTree  # second moment


def scale_by_nadam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, momentum_decay: float = 4e-3
) -> GradientTransformation:
    r"""Rescales updates by NAdam's Nesterov-accelerated moments, as ``torch.optim.NAdam``.

    .. math::
        \mu_t = \beta_1\left(1 - \tfrac12\, 0.96^{t\psi}\right),\quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\\
        u_t = \frac{1}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}\left(
            \frac{(1-\mu_t)\, g_t}{1-\prod_{i\le t}\mu_i} + \frac{\mu_{t+1}\, m_t}{1-\prod_{i\le t+1}\mu_i}\right)

    where :math:`\psi` is ``momentum_decay``. The running product of :math:`\mu_i` is kept in the state as a 0-d tensor
    of torch.optim's scalar dtype, so it rounds exactly as torch's does.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
        momentum_decay: :math:`\psi`, the decay of the momentum schedule.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_nadam()
        >>> u, state = tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))
        >>> u[0].round(decimals=4)
        tensor([1.0565])

    References:
        Dozat, "Incorporating Nesterov Momentum into Adam", 2016.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("momentum_decay", momentum_decay)

    def prologue(count: torch.Tensor, mu_product: torch.Tensor) -> dict[str, float | torch.Tensor]:
        count = safe_increment(count)
        step = count.to(torch.float64)
        mu_t = b1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))
        mu_next = b1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * momentum_decay))
        # torch's in-place ``mu_product *= mu`` rounds mu to the state's dtype first, then multiplies in that dtype
        mu_product = mu_product * mu_t.to(mu_product.dtype)
        product = mu_product.to(torch.float64)
        return {
            "one_minus_b1": 1 - b1,
            "b2": b2,
            "one_minus_b2": 1 - b2,
            "eps": eps,
            "bc2": bias_correction(b2, count),
            "grad_coef": (1.0 - mu_t) / (1.0 - product),
            "momentum_coef": mu_next / (1.0 - product * mu_next),
            "mu_product": mu_product,  # the next state's
        }

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g = o.cast(g, mu)
        mu = o.lerp(mu, g, s.one_minus_b1)
        nu = o.addcmul(nu * s.b2, g, g, s.one_minus_b2)
        denom = o.sqrt(nu / s.bc2) + s.eps  # torch.optim.NAdam divides before the square root
        return g / denom * s.grad_coef + mu / denom * s.momentum_coef, mu, nu

    product = Carried("mu_product", lambda: torch.ones([], dtype=_scalar_dtype()))
    slots = (Slot("mu"), Slot("nu", nonnegative=True))
    decl = Elementwise("scale_by_nadam", ScaleByNadamState, slots, True, prologue, body, carried=(product,))
    return elementwise(decl)


class ScaleByRadamState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree
    nu: PyTree


def scale_by_radam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, threshold: float = 5.0
) -> GradientTransformation:
    r"""Rescales updates by Rectified Adam, as ``torch.optim.RAdam``.

    .. math::
        \rho_\infty = \frac{2}{1-\beta_2} - 1,\quad \rho_t = \rho_\infty - \frac{2t\beta_2^t}{1-\beta_2^t},\quad
        \hat m_t = \frac{m_t}{1-\beta_1^t},\\
        u_t = \begin{cases}
            \hat m_t\, r_t \frac{\sqrt{1-\beta_2^t}}{\sqrt{v_t} + \epsilon},\quad
            r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}{(\rho_\infty-4)(\rho_\infty-2)\rho_t}}
            & \rho_t > \text{threshold} \\
            \hat m_t & \text{otherwise}\end{cases}

    The branch is decided once per step from the count and taken by a select in the update, so the transform runs
    under vmap and compile.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
        threshold: the :math:`\rho_t` above which the adaptive step is used (5 in torch.optim and the paper).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_radam()
        >>> tx.update([torch.tensor([3.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([3.])]

    References:
        Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", 2020.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    rho_inf = 2.0 / (1.0 - b2) - 1.0

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        count = safe_increment(count)
        step = count.to(torch.float64)
        bc2 = bias_correction(b2, count)
        rho_t = rho_inf - 2.0 * step * torch.pow(b2, step) / bc2
        ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        return {
            "one_minus_b1": 1 - b1,
            "b2": b2,
            "one_minus_b2": 1 - b2,
            "eps": eps,
            "bc1": host_number(bias_correction(b1, count)),
            # a tensor, not a float: ``float / tensor`` is torch's reciprocal times the float, rounded twice
            "bc2_sqrt": bc2.sqrt(),
            # only read where rho_t > threshold, where the ratio is positive
            "rect": host_number(torch.sqrt(ratio.clamp(min=0.0))),
            "rectify": rho_t > threshold,  # a 0-d bool tensor: the branch of this step
        }

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g = o.cast(g, mu)
        mu = o.lerp(mu, g, s.one_minus_b1)
        nu = o.addcmul(nu * s.b2, g, g, s.one_minus_b2)
        mu_hat = mu / s.bc1
        adaptive = s.bc2_sqrt / (o.sqrt(nu) + s.eps)
        return o.where(s.rectify, mu_hat * adaptive * s.rect, mu_hat), mu, nu

    slots = (Slot("mu"), Slot("nu", nonnegative=True))
    return elementwise(Elementwise("scale_by_radam", ScaleByRadamState, slots, True, prologue, body))


class ScaleByAdamaxState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # first moment
    nu: PyTree  # exponentially weighted infinity norm (torch.optim.Adamax's ``exp_inf``)


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    r"""Rescales updates by Adamax's infinity-norm estimate, as ``torch.optim.Adamax``.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad u^\infty_t = \max(\beta_2 u^\infty_{t-1}, |g_t| + \epsilon),\quad
        u_t = \frac{m_t}{(1-\beta_1^t)\, u^\infty_t}

    Args:
        b1: decay of the first moment.
        b2: decay of the infinity norm.
        eps: added to :math:`|g_t|` (inside the maximum, as torch.optim does).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_adamax()
        >>> tx.update([torch.tensor([-4.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([-1.])]

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015, section 7.1.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        bc1 = host_number(bias_correction(b1, safe_increment(count)))
        return {"one_minus_b1": 1 - b1, "b2": b2, "eps": eps, "bc1": bc1}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g = o.cast(g, mu)
        mu = o.lerp(mu, g, s.one_minus_b1)
        nu = o.maximum(nu * s.b2, o.abs(g) + s.eps)
        return mu / nu / s.bc1, mu, nu

    slots = (Slot("mu"), Slot("nu", nonnegative=True))
    return elementwise(Elementwise("scale_by_adamax", ScaleByAdamaxState, slots, True, prologue, body))
