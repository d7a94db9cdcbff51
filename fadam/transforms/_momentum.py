"""Momentum: ``trace`` (heavy-ball and Nesterov, with torch.optim.SGD's dampening)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import for_leaf, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, tree_map
from fadam.transforms._validation import check_non_negative


class TraceState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (the first step initialises the trace, as torch.optim.SGD does)
    trace: PyTree


def trace(
    decay: float, nesterov: bool = False, *, dampening: float = 0.0, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    r"""Accumulates a momentum trace of the updates.

    .. math::
        t_1 = g_1,\qquad t_k = \mu\, t_{k-1} + (1-d)\, g_k,\qquad
        u_k = \begin{cases} g_k + \mu\, t_k & \text{nesterov} \\ t_k & \text{otherwise}\end{cases}

    This is ``torch.optim.SGD``'s momentum buffer: on the first step the buffer is a copy of the gradient (no
    dampening); with ``dampening = 0`` it equals optax's ``trace``.

    Args:
        decay: the momentum :math:`\mu`.
        nesterov: Nesterov momentum.
        dampening: the dampening :math:`d` of torch.optim.SGD.
        accumulator_dtype: dtype of the trace (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.trace(0.9)
        >>> state = tx.init([torch.zeros(1)])
        >>> u, state = tx.update([torch.ones(1)], state)
        >>> tx.update([torch.ones(1)], state)[0]
        [tensor([1.9000])]
    """
    check_non_negative("momentum", decay)
    check_non_negative("dampening", dampening)
    if nesterov and (decay <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def init(params: PyTree) -> TraceState:
        return TraceState(zero_count(), tree_map(lambda p: torch.zeros_like(p, dtype=accumulator_dtype), params))

    def update(updates: PyTree, state: TraceState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, TraceState]:
        grads, traces, spec = check_leaves(updates, state.trace, like_what="the trace state (params)")
        first_step = state.count == 0
        new_updates, new_traces = [], []
        for g, t in zip(grads, traces):
            if g is None:
                new_updates.append(None)
                new_traces.append(t)
                continue
            g_acc = g.to(t.dtype)
            if dampening == 0.0:
                t_new = torch.add(g_acc, t, alpha=decay) if not isinstance(decay, torch.Tensor) else g_acc + decay * t
            else:
                t_new = torch.where(for_leaf(first_step, g_acc), g_acc, t * decay + (1 - dampening) * g_acc)
            u = g_acc + decay * t_new if nesterov else t_new
            new_updates.append(u.to(g.dtype))
            new_traces.append(t_new)
        return spec.unflatten(new_updates), TraceState(safe_increment(state.count), spec.unflatten(new_traces))

    return GradientTransformation(init, update)
