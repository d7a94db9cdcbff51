"""Lion's scaling: ``scale_by_lion`` (the sign of an interpolated momentum)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, tree_map
from fadam.transforms._validation import check_unit_interval


class ScaleByLionState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # momentum, shaped like params


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, *, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Rescales updates to the sign of an interpolation of the momentum and the gradient (Lion).

    .. math::
        u_t = \mathrm{sign}(\beta_1 m_{t-1} + (1-\beta_1) g_t),\qquad m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

    Complex leaves take the sign of their real and imaginary parts separately. A ``None`` update skips its leaf.

    Args:
        b1: interpolation weight of the momentum in the update.
        b2: decay of the momentum.
        mu_dtype: dtype of the momentum (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_lion()
        >>> tx.update([torch.tensor([0.3, -2.0, 0.0])], tx.init([torch.zeros(3)]))[0]
        [tensor([ 1., -1.,  0.])]

    References:
        Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)

    def init(params: PyTree) -> ScaleByLionState:
        return ScaleByLionState(zero_count(), tree_map(lambda p: torch.zeros_like(p, dtype=mu_dtype), params))

    def update(
        updates: PyTree, state: ScaleByLionState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByLionState]:
        grads, mus, spec = check_leaves(updates, state.mu, like_what="the Lion state (params)")
        new_updates, new_mus = [], []
        for g, mu in zip(grads, mus):
            if g is None:
                new_updates.append(None)
                new_mus.append(mu)
                continue
            complex_leaf = g.is_complex()
            gr = torch.view_as_real(g) if complex_leaf else g
            mur = torch.view_as_real(mu) if complex_leaf else mu
            g_acc = gr.to(mur.dtype)
            u = mur.lerp(g_acc, 1 - b1).sign().to(gr.dtype)
            mu_new = mur.lerp(g_acc, 1 - b2)
            if complex_leaf:
                u, mu_new = torch.view_as_complex(u), torch.view_as_complex(mu_new)
            new_updates.append(u)
            new_mus.append(mu_new)
        return spec.unflatten(new_updates), ScaleByLionState(safe_increment(state.count), spec.unflatten(new_mus))

    return GradientTransformation(init, update)
