"""NovoGrad's scaling: ``scale_by_novograd`` (a second moment per leaf, of the gradient's squared norm, and a
momentum of the normalized gradients plus weight decay)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import dtype_for, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, tree_map
from fadam.transforms._validation import check_non_negative, check_state, check_unit_interval, known_value


class ScaleByNovogradState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # momentum of the normalized gradients
    nu: PyTree  # per leaf, a 0-d moment of the gradient's squared L2 norm (in the leaf's real dtype)


def scale_by_novograd(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.25,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Rescales updates by NovoGrad's layer-wise second moment (optax's ``scale_by_novograd``).

    Per leaf (a layer), with :math:`\|g_t\|` its L2 norm:

    .. math::
        v_t = \beta_2 v_{t-1} + (1-\beta_2)\|g_t\|^2,\quad
        m_t = \beta_1 m_{t-1} + \frac{g_t}{\sqrt{v_t + \epsilon_{root}} + \epsilon} + \lambda p_t,\quad u_t = m_t

    The first step sets :math:`v_1 = \|g_1\|^2` and :math:`m_1` to its increment alone. No bias correction; the
    momentum is not damped (the paper's :math:`\beta_1` multiplies only the past).

    Args:
        b1: decay of the momentum.
        b2: decay of the per-leaf second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (meta-gradients).
        weight_decay: the factor :math:`\lambda` of the params added to the normalized gradient (needs params
            when nonzero).
        mu_dtype: dtype of the momentum (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_novograd(eps=0.0)
        >>> u, state = tx.update([torch.tensor([3.0, 4.0])], tx.init([torch.zeros(2)]))
        >>> u, state.nu  # g / ||g||, and ||g||^2
        ([tensor([0.6000, 0.8000])], [tensor(25.)])

    References:
        Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of Deep
        Networks", 2019. optax's ``optax.scale_by_novograd`` (0.2.8), whose semantics these are.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)
    decays = isinstance(weight_decay, torch.Tensor) or known_value(weight_decay, 1.0, "weight_decay") != 0.0

    def init(params: PyTree) -> ScaleByNovogradState:
        mu = tree_map(lambda p: None if p is None else torch.zeros_like(p, dtype=dtype_for(p, mu_dtype)), params)
        nu = tree_map(lambda p: None if p is None else torch.zeros([], dtype=p.real.dtype, device=p.device), params)
        return ScaleByNovogradState(zero_count(), mu, nu)

    def update(
        updates: PyTree, state: ScaleByNovogradState, params: PyTree | None = None, **_: object
    ) -> tuple[PyTree, ScaleByNovogradState]:
        check_state(state, ScaleByNovogradState, "scale_by_novograd")
        if decays and params is None:
            raise ValueError("scale_by_novograd with weight_decay needs params: call update(updates, state, params)")
        grads, mus, spec = check_leaves(updates, state.mu, like_what="the scale_by_novograd state (params)")
        nus = spec.flatten_up_to(state.nu)
        param_leaves = spec.flatten_up_to(params) if decays else [None] * len(grads)
        first = state.count == 0
        new_mu, new_nu = [], []
        for g, mu, nu, p in zip(grads, mus, nus, param_leaves):
            if g is None:  # no gradient: the leaf is skipped, its state kept
                new_mu.append(mu)
                new_nu.append(nu)
                continue
            squared = (torch.linalg.vector_norm(g) ** 2).to(nu.dtype)
            first_here = first.to(g.device)
            nu = torch.where(first_here, squared, (1 - b2) * squared + b2 * nu)
            increment = g / (torch.sqrt(nu + eps_root) + eps)
            if decays:
                increment = increment + weight_decay * p
            mu = torch.where(first_here, increment, b1 * mu + increment).to(mu.dtype)
            new_mu.append(mu)
            new_nu.append(nu)
        new_state = ScaleByNovogradState(safe_increment(state.count), spec.unflatten(new_mu), spec.unflatten(new_nu))
        return spec.unflatten(new_mu), new_state

    return GradientTransformation(init, update)
