"""Adam's scaling: ``scale_by_adam`` (with torch.optim's AMSGrad and optax's Nesterov variants)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, safe_increment
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # first moment, shaped like params
    nu: PyTree  # second moment, shaped like params


class ScaleByAmsgradState(NamedTuple):
    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    nu_max: PyTree  # running maximum of nu


def scale_by_adam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    *,
    amsgrad: bool = False,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    moment_requires_grad: bool = False,
) -> GradientTransformation:
    r"""Rescales updates by Adam's bias-corrected moment estimates.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
        u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}

    With ``amsgrad``, :math:`v_t` in the denominator is replaced by :math:`\max_{s\le t} v_s` taken on the raw (not
    bias-corrected) moments, as ``torch.optim.Adam(amsgrad=True)`` does. With ``nesterov``, the numerator is
    :math:`\beta_1 m_t/(1-\beta_1^{t+1}) + (1-\beta_1) g_t/(1-\beta_1^t)` (Dozat, 2016; optax's ``nesterov``).
    Complex leaves are treated as pairs of reals (``torch.view_as_real``), exactly like torch.optim, so the second
    moment is kept per real and imaginary component. A ``None`` update skips its leaf: moments untouched, update
    ``None``.

    The update is differentiable in everything: gradients, moments and the hyperparameters, which may be 0-d tensors
    requiring grad (hypergradients). When autograd records the step, the square root is ``safe_sqrt``, whose
    derivatives stay finite where the second moment is exactly zero (a gradient entry that is zero but depends on
    the params), so meta-gradients through many steps are finite even with ``eps_root = 0``; the values are the same.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (optax's ``eps_root``): smooths meta-gradients where the second
            moment is tiny.
        amsgrad: use the running maximum of the second moment (torch.optim's AMSGrad).
        nesterov: Nesterov momentum in the first moment.
        mu_dtype: dtype of the first moment (default: the param's).
        nu_dtype: dtype of the second moment (default: the param's).
        moment_requires_grad: ``init`` creates the moments as leaf tensors requiring grad, so meta-gradients flow
            into the initial state (torchopt's ``moment_requires_grad``).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_adam()
        >>> params = {"w": torch.zeros(3)}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -2.0, 0.0])}, tx.init(params))
        >>> updates["w"].round(decimals=4)
        tensor([ 1., -1.,  0.])

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.
        Reddi et al., "On the Convergence of Adam and Beyond", 2018.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)

    # Bias corrections of recent plain step counts: an inner loop of K steps meets the same counts in every outer
    # iteration, and computing them takes a dozen 0-d ops.
    recent: dict[int, dict[str, float | torch.Tensor]] = {}
    plain_decays = not isinstance(b1, torch.Tensor) and not isinstance(b2, torch.Tensor)

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        count = safe_increment(count)
        key = host_number(count) if plain_decays else None
        cacheable = isinstance(key, int)  # a plain count: not traced, batched or compiled
        if cacheable and key in recent:
            return recent[key]
        bc1 = bias_correction(b1, count)
        bc2_sqrt = torch.sqrt(bias_correction(b2, count))
        scalars = {"one_minus_b1": 1 - b1, "b2": b2, "one_minus_b2": 1 - b2, "eps": eps}
        if nesterov:  # numerator b1 m_t / (1 - b1^(t+1)) + (1 - b1) g_t / (1 - b1^t)
            bc1_next = bias_correction(b1, safe_increment(count))
            scalars |= {"mu_weight": b1 / bc1_next, "g_weight": (1 - b1) / bc1}
        else:
            scalars["bc1"] = bc1
        if rooted:
            scalars |= {"bc2": bc2_sqrt * bc2_sqrt, "eps_root": eps_root}
        else:
            scalars["bc2_sqrt"] = bc2_sqrt
        scalars = {name: host_number(value) for name, value in scalars.items()}
        if cacheable:
            if len(recent) >= 64:
                recent.clear()
            recent[key] = scalars
        return scalars

    rooted = isinstance(eps_root, torch.Tensor) or eps_root != 0.0

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any, *nu_max: Any) -> tuple:
        g_mu, g_nu = o.cast(g, mu), o.cast(g, nu)
        mu = o.lerp(mu, g_mu, s.one_minus_b1)  # torch.optim's exp_avg.lerp_(grad, 1 - beta1)
        nu = o.addcmul(nu * s.b2, g_nu, g_nu, s.one_minus_b2)
        source = nu
        if amsgrad:  # the running maximum of the raw second moment (torch.optim)
            nu_max = (o.maximum(nu_max[0], nu),)
            source = nu_max[0]
        if rooted:  # the argument is >= eps_root > 0: the square root is smooth
            denom = o.sqrt(source / s.bc2 + s.eps_root) + s.eps
        else:
            denom = o.sqrt(source) / s.bc2_sqrt + s.eps  # torch.optim's order of operations
        numer = mu * s.mu_weight + g_mu * s.g_weight if nesterov else mu / s.bc1
        return (numer / denom, mu, nu, *nu_max)

    slots = (Slot("mu", mu_dtype, moment_requires_grad), Slot("nu", nu_dtype, moment_requires_grad, nonnegative=True))
    if amsgrad:
        slots += (Slot("nu_max", nu_dtype, moment_requires_grad, nonnegative=True),)
    state_type = ScaleByAmsgradState if amsgrad else ScaleByAdamState
    options = (
        ("b1", b1),
        ("b2", b2),
        ("eps", eps),
        ("eps_root", eps_root),
        ("amsgrad", amsgrad),
        ("nesterov", nesterov),
    )
    return elementwise(Elementwise("scale_by_adam", state_type, slots, True, prologue, body, options=options))
