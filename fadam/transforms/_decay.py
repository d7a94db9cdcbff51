"""Weight decay added to the updates (coupled L2 before Adam, decoupled after it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fadam._base import EmptyState, GradientTransformation, ScalarOrSchedule
from fadam._numerics import for_leaf, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves
from fadam.combinators._masking import masked
from fadam.transforms._scaling import ScaleByScheduleState
from fadam.transforms._validation import check_non_negative


def add_decayed_weights(
    weight_decay: float | torch.Tensor = 0.0, mask: PyTree | Callable[[PyTree], PyTree] | None = None
) -> GradientTransformation:
    r"""Adds the params scaled by the weight decay: :math:`u = g + \lambda\, p`.

    Placed before ``scale_by_adam`` this is torch.optim.Adam's L2 penalty; placed after it, AdamW's decoupled decay.

    Args:
        weight_decay: the factor :math:`\lambda` (a float or a 0-d tensor).
        mask: a bool tree (or a prefix of one, or a callable ``params -> tree``) selecting the leaves to decay.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.add_decayed_weights(0.1)
        >>> tx.update([torch.zeros(1)], tx.init(None), [torch.full((1,), 2.0)])[0]
        [tensor([0.2000])]
    """
    check_non_negative("weight_decay", weight_decay)

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, EmptyState]:
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
        grads, param_leaves, spec = check_leaves(updates, params)
        decayed = [
            None
            if g is None
            else torch.add(g, p.to(g.dtype), alpha=weight_decay)
            if not isinstance(weight_decay, torch.Tensor)
            else g + weight_decay * p.to(g.dtype)
            for g, p in zip(grads, param_leaves)
        ]
        return spec.unflatten(decayed), state

    tx = GradientTransformation(lambda params: EmptyState(), update)
    return tx if mask is None else masked(tx, mask)


def add_decoupled_weight_decay(
    learning_rate: ScalarOrSchedule, weight_decay: float | torch.Tensor
) -> GradientTransformation:
    r"""Decoupled weight decay as ``torch.optim.AdamW`` applies it, for use after ``scale_by_learning_rate``.

        .. math::
            u = g - \left(p - p \cdot \mathrm{rnd}(1 - \eta_t \lambda)
    ight)

        so that ``p + u`` equals torch's ``p.mul_(1 - lr * weight_decay)`` followed by the step. The factor is rounded
        to the param's dtype exactly as torch's in-place multiply rounds it; that rounding is systematic (the same every
        step), which is why this matches torch.optim.AdamW to float32 precision over hundreds of steps where the
        algebraically equal ``-lr * (g + weight_decay * p)`` drifts by up to 1e-5.

        Args:
            learning_rate: the learning rate :math:`\eta_t` (float, 0-d tensor or schedule of the step count).
            weight_decay: the decay :math:`\lambda`.

        Example:
            >>> import torch, fadam
            >>> tx = fadam.add_decoupled_weight_decay(0.1, 0.5)
            >>> tx.update([torch.zeros(1)], tx.init([torch.ones(1)]), [torch.full((1,), 2.0)])[0]
            [tensor([-0.1000])]
    """
    check_non_negative("weight_decay", weight_decay)
    schedule = learning_rate if callable(learning_rate) else None

    def init(params: PyTree) -> ScaleByScheduleState | EmptyState:
        return ScaleByScheduleState(zero_count()) if schedule else EmptyState()

    def update(
        updates: PyTree, state: ScaleByScheduleState | EmptyState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByScheduleState | EmptyState]:
        if params is None:
            raise ValueError("add_decoupled_weight_decay needs params: call update(updates, state, params)")
        grads, param_leaves, spec = check_leaves(updates, params)
        if schedule:
            lr, state = schedule(state.count), ScaleByScheduleState(safe_increment(state.count))
        else:
            lr = learning_rate
        factor = 1 - lr * weight_decay
        new = []
        for g, p in zip(grads, param_leaves):
            if g is None:
                new.append(None)
                continue
            p_real = p.real if p.is_complex() else p
            rounded = for_leaf(factor, p).to(p_real.dtype) if isinstance(factor, torch.Tensor) else factor
            new.append(g - (p - p * rounded).to(g.dtype))
        return spec.unflatten(new), state

    return GradientTransformation(init, update)
