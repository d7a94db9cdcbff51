"""Lion's sign update: ``scale_by_lion``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import dtype_for, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._leafwise import map_moments
from fadam.transforms._validation import check_state, check_unit_interval


class ScaleByLionState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # momentum


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Replaces updates by the sign of an interpolation between momentum and gradient (Lion).

    .. math::
        u_t = \operatorname{sign}\left(\beta_1 m_{t-1} + (1-\beta_1) g_t\right),\qquad
        m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

    Complex leaves take the sign of the real and imaginary parts separately.

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
        Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023 (Algorithm 2).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)

    def init(params: PyTree) -> ScaleByLionState:
        check_params(params)
        return ScaleByLionState(
            zero_count(),
            tree_map(lambda p: None if p is None else torch.zeros_like(p, dtype=dtype_for(p, mu_dtype)), params),
        )

    def update(
        updates: PyTree, state: ScaleByLionState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByLionState]:
        check_state(state, ScaleByLionState, "scale_by_lion")
        grads, mus, spec = check_leaves(updates, state.mu, like_what="the Lion state (params)")

        def leaf(g: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            g = g.to(mu.dtype)
            return mu.lerp(g, 1 - b1).sign(), mu.lerp(g, 1 - b2)

        new_updates, (new_mus,) = map_moments(leaf, grads, mus)
        return spec.unflatten(new_updates), ScaleByLionState(safe_increment(state.count), spec.unflatten(new_mus))

    return GradientTransformation(init, update)
