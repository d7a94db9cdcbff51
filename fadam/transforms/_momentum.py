"""Momentum: ``trace`` (heavy-ball and Nesterov, with torch.optim.SGD's dampening)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import dtype_for, for_leaf, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._validation import check_non_negative, check_state, known_value


class TraceState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (the first step initialises the trace, as torch.optim.SGD does)
    trace: PyTree


def trace(
    decay: float | torch.Tensor,
    nesterov: bool = False,
    *,
    dampening: float | torch.Tensor = 0.0,
    accumulator_dtype: torch.dtype | None = None,
    moment_requires_grad: bool = False,
) -> GradientTransformation:
    r"""Accumulates a momentum trace of the updates.

    .. math::
        t_1 = g_1,\qquad t_k = \mu\, t_{k-1} + (1-d)\, g_k,\qquad
        u_k = \begin{cases} g_k + \mu\, t_k & \text{nesterov} \\ t_k & \text{otherwise}\end{cases}

    This is ``torch.optim.SGD``'s momentum buffer: on the first step the buffer is a copy of the gradient (no
    dampening); with ``dampening = 0`` it equals optax's ``trace``. The update is differentiable in the gradients,
    the trace and the hyperparameters, which may be 0-d tensors requiring grad.

    Args:
        decay: the momentum :math:`\mu`.
        nesterov: Nesterov momentum.
        dampening: the dampening :math:`d` of torch.optim.SGD.
        accumulator_dtype: dtype of the trace (default: the param's).
        moment_requires_grad: ``init`` creates the trace as leaf tensors requiring grad (meta-gradients into the
            initial state).

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
    if nesterov and not (known_value(decay, 1.0, "decay") > 0 and known_value(dampening, 0.0, "dampening") == 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    undamped = known_value(dampening, 1.0, "dampening") == 0

    def init(params: PyTree) -> TraceState:
        check_params(params)

        def zeros(p: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(p, dtype=dtype_for(p, accumulator_dtype), requires_grad=moment_requires_grad)

        return TraceState(zero_count(), tree_map(zeros, params))

    def update(updates: PyTree, state: TraceState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, TraceState]:
        check_state(state, TraceState, "trace")
        grads, traces, spec = check_leaves(updates, state.trace, like_what="the trace state (params)")
        first_step = state.count == 0
        new_updates, new_traces = [], []
        for g, t in zip(grads, traces):
            if g is None:
                new_updates.append(None)
                new_traces.append(t)
                continue
            g_acc = g.to(t.dtype)
            if undamped:
                t_new = _add_scaled(g_acc, t, decay)
            else:
                t_new = torch.where(for_leaf(first_step, g_acc), g_acc, t * decay + (1 - dampening) * g_acc)
            u = _add_scaled(g_acc, t_new, decay) if nesterov else t_new  # torch.optim: grad.add(buf, alpha=momentum)
            new_updates.append(u.to(g.dtype))
            new_traces.append(t_new)
        return spec.unflatten(new_updates), TraceState(safe_increment(state.count), spec.unflatten(new_traces))

    return GradientTransformation(init, update)


def _add_scaled(x: torch.Tensor, y: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """``x + factor * y`` rounded as ``torch.add(x, y, alpha=factor)``; ``addcmul`` takes a tensor factor (which
    autograd then sees) and rounds identically."""
    if isinstance(factor, torch.Tensor):
        return torch.addcmul(x, y, factor.to(y.dtype))
    return torch.add(x, y, alpha=factor)


class EmaState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (for the debiasing)
    ema: PyTree


def ema(decay: float, debias: bool = True, accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Replaces updates by their exponential moving average (optax's ``ema``).

    .. math::
        e_t = \beta e_{t-1} + (1-\beta) g_t,\qquad u_t = e_t \text{ or, debiased, } \frac{e_t}{1-\beta^t}

    Args:
        decay: the decay :math:`\beta`.
        debias: divide by :math:`1-\beta^t`.
        accumulator_dtype: dtype of the average (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.ema(0.9, debias=False)
        >>> tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))[0]
        [tensor([0.1000])]
    """
    check_non_negative("decay", decay)

    def init(params: PyTree) -> EmaState:
        check_params(params)
        return EmaState(
            zero_count(),
            tree_map(
                lambda p: None if p is None else torch.zeros_like(p, dtype=dtype_for(p, accumulator_dtype)), params
            ),
        )

    def update(updates: PyTree, state: EmaState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, EmaState]:
        check_state(state, EmaState, "ema")
        grads, emas, spec = check_leaves(updates, state.ema, like_what="the EMA state (params)")
        count = safe_increment(state.count)
        correction = 1 - torch.pow(decay, count.to(torch.float64)) if debias else None
        new_updates, new_emas = [], []
        for g, e in zip(grads, emas):
            if g is None:
                new_updates.append(None)
                new_emas.append(e)
                continue
            e_new = e.lerp(g.to(e.dtype), 1 - decay)
            new_updates.append((e_new if correction is None else e_new / correction).to(g.dtype))
            new_emas.append(e_new)
        return spec.unflatten(new_updates), EmaState(count, spec.unflatten(new_emas))

    return GradientTransformation(init, update)
