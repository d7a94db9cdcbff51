"""SM3's scaling: ``scale_by_sm3`` (an Adagrad-like accumulator kept as one vector per axis of each leaf)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._tree import PyTree, check_leaves, check_params, tree_leaves, tree_map
from fadam.transforms._validation import check_non_negative, check_state, check_unit_interval


class ScaleBySM3State(NamedTuple):
    mu: PyTree  # per leaf, a list of one vector per axis (the accumulator's cover); a vector or 0-d leaf: [itself]
    nu: PyTree  # momentum of the scaled gradients


def _expanded(vector: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    """``vector`` shaped to broadcast along ``axis`` of an ``ndim``-dimensional leaf (``[1, N, 1]`` for axis 1)."""
    return vector.reshape([1] * axis + [vector.numel()] + [1] * (ndim - axis - 1))


def scale_by_sm3(
    b1: float | torch.Tensor = 0.9, b2: float | torch.Tensor = 1.0, eps: float | torch.Tensor = 1e-8
) -> GradientTransformation:
    r"""Rescales updates by SM3's accumulator: per axis of each leaf, the maxima of the accumulated squares
    (optax's ``scale_by_sm3``, SM3-II).

    For a leaf of rank :math:`k \ge 2` with accumulators :math:`\mu^{(r)}` along each axis :math:`r`:

    .. math::
        \nu_t = c\, g_t^2 + \beta_2 \min_r \mu^{(r)}_{t-1},\quad
        \mu^{(r)}_t = \max_{\text{axes} \ne r} \nu_t,\quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1)\, \frac{g_t}{\sqrt{\nu_t + \epsilon}}\ (0 \text{ where } \nu_t = 0),
        \quad u_t = m_t

    with :math:`c = 1-\beta_2`, or 1 when :math:`\beta_2 = 1` (Adagrad's sum, the default). A vector (or a 0-d
    leaf) keeps its whole accumulator, :math:`\mu_t = \nu_t`. Memory is the sum of the leaf's dimensions, not
    their product. Real leaves only, as optax.

    Args:
        b1: decay of the momentum.
        b2: decay of the accumulator (1: a sum, SM3's).
        eps: added inside the inverse square root.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_sm3(b1=0.0, eps=0.0)
        >>> u, state = tx.update([torch.tensor([[3.0, -1.0], [0.5, 2.0]])], tx.init([torch.zeros(2, 2)]))
        >>> u  # the first step: g / |g|
        [tensor([[ 1., -1.],
                [ 1.,  1.]])]
        >>> state.mu  # the row and column maxima of g^2
        [[tensor([9., 4.]), tensor([9., 4.])]]

    References:
        Anil et al., "Memory-Efficient Adaptive Optimization", NeurIPS 2019. optax's ``optax.scale_by_sm3``
        (0.2.8), whose semantics these are.
    """
    check_unit_interval("b1", b1)
    check_non_negative("b2", b2)
    check_non_negative("eps", eps)
    coefficient = 1.0 if not isinstance(b2, torch.Tensor) and b2 == 1.0 else 1 - b2

    def cover(p: torch.Tensor) -> list[torch.Tensor]:
        if p.dim() < 2:
            return [torch.zeros_like(p)]
        return [torch.zeros(size, dtype=p.dtype, device=p.device) for size in p.shape]

    def init(params: PyTree) -> ScaleBySM3State:
        check_params(params)
        if any(p.is_complex() for p in tree_leaves(params) if p is not None):
            raise ValueError("scale_by_sm3 does not support complex params (its maxima need an order), as optax")
        mu = tree_map(lambda p: None if p is None else cover(p), params)
        nu = tree_map(lambda p: None if p is None else torch.zeros_like(p), params)
        return ScaleBySM3State(mu, nu)

    def accumulated(g: torch.Tensor, mu: list[torch.Tensor]) -> torch.Tensor:
        if g.dim() < 2:
            previous = mu[0]
        else:
            previous = functools.reduce(torch.minimum, [_expanded(v, g.dim(), axis) for axis, v in enumerate(mu)])
        return coefficient * g**2 + b2 * previous

    def new_cover(accum: torch.Tensor) -> list[torch.Tensor]:
        if accum.dim() < 2:
            return [accum]
        others = lambda axis: [a for a in range(accum.dim()) if a != axis]  # noqa: E731
        return [torch.amax(accum, dim=others(axis)) for axis in range(accum.dim())]

    def update(
        updates: PyTree, state: ScaleBySM3State, params: PyTree | None = None, **_: object
    ) -> tuple[PyTree, ScaleBySM3State]:
        check_state(state, ScaleBySM3State, "scale_by_sm3")
        grads, nus, spec = check_leaves(updates, state.nu, like_what="the scale_by_sm3 state (params)")
        mus = spec.flatten_up_to(state.mu)
        new_nu, new_mu = [], []
        for g, nu, mu in zip(grads, nus, mus):
            if g is None:
                new_nu.append(nu)
                new_mu.append(mu)
                continue
            accum = accumulated(g, mu)
            inv_sqrt = torch.where(accum > 0, torch.rsqrt(accum + eps), 0.0)
            new_nu.append((1 - b1) * (g * inv_sqrt) + b1 * nu)
            new_mu.append(new_cover(accum))
        nu_tree = spec.unflatten(new_nu)
        return nu_tree, ScaleBySM3State(spec.unflatten(new_mu), nu_tree)

    return GradientTransformation(init, update)
