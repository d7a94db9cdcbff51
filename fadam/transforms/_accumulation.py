"""Gradient accumulation inside a chain: ``apply_every`` (sum ``k`` steps' updates, emit them on the ``k``-th)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, tree_map
from fadam.transforms._validation import check_state


class ApplyEvery(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken since the last emission, modulo k
    grad_acc: PyTree  # the updates summed since the last emission


def apply_every(k: int = 1) -> GradientTransformation:
    r"""Accumulates updates over ``k`` steps and applies their sum every ``k``-th step, zeros in between.

    .. math::
        a_t = \begin{cases} g_t & t \equiv 1 \pmod k \\ a_{t-1} + g_t & \text{otherwise} \end{cases},\qquad
        u_t = \begin{cases} a_t & t \equiv 0 \pmod k \\ 0 & \text{otherwise} \end{cases}

    Stateful transforms before it in a chain still step every time (``MultiSteps`` wraps a whole optimizer
    instead). optax's ``apply_every``.

    Args:
        k: the number of steps summed (1: every update passes through).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.apply_every(2)
        >>> state = tx.init([torch.zeros(1)])
        >>> u1, state = tx.update([torch.ones(1)], state)
        >>> u2, state = tx.update([torch.full((1,), 2.0)], state)
        >>> u1, u2
        ([tensor([0.])], [tensor([3.])])

    References:
        optax's ``optax.apply_every`` (0.2.8), whose semantics these are.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"Invalid k: {k} (expected an int >= 1)")

    def init(params: PyTree) -> ApplyEvery:
        return ApplyEvery(zero_count(), tree_map(lambda p: None if p is None else torch.zeros_like(p), params))

    def update(updates: PyTree, state: ApplyEvery, params: PyTree | None = None, **_: object) -> tuple:
        check_state(state, ApplyEvery, "apply_every")
        grads, accumulated, spec = check_leaves(updates, state.grad_acc, like_what="the apply_every state (params)")
        phase = state.count % k
        keeps, emits = phase != 0, phase == k - 1
        new_acc, out = [], []
        for g, acc in zip(grads, accumulated):
            if g is None:
                new_acc.append(acc)
                out.append(None)
                continue
            acc = torch.where(keeps.to(g.device), acc + g, g)
            new_acc.append(acc)
            out.append(torch.where(emits.to(g.device), acc, torch.zeros((), dtype=acc.dtype, device=acc.device)))
        return spec.unflatten(out), ApplyEvery(safe_increment(state.count) % k, spec.unflatten(new_acc))

    return GradientTransformation(init, update)
