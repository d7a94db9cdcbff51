"""Momentum: ``trace`` (heavy-ball and Nesterov, with torch.optim.SGD's dampening)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, is_first_step, safe_increment
from fadam._program import Elementwise, Slot, SparseRule, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, known_value


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

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        # the first step copies the gradient into the trace (torch.optim.SGD): t = 0 * t + 1 * g
        first = is_first_step(count)
        if isinstance(first, torch.Tensor):  # a count that is traced or batched
            return {
                "decay_now": torch.where(first, 0.0, torch.as_tensor(decay, dtype=torch.float64)),
                "damping_now": torch.where(first, 1.0, 1 - torch.as_tensor(dampening, dtype=torch.float64)),
                "decay": decay,
            }
        return {"decay_now": 0.0 if first else decay, "damping_now": 1.0 if first else 1 - dampening, "decay": decay}

    def body(o: Any, s: Any, g: Any, p: Any, t: Any) -> tuple:
        g = o.cast(g, t)
        # torch.optim.SGD: buf.mul_(momentum).add_(grad, alpha=1 - dampening); grad.add(buf, alpha=momentum)
        # undamped, the first step's g + decay * 0 is the copy already, and keeps the initial trace in a graph
        t = o.add_scaled(g, t, s.decay) if undamped else t * s.decay_now + g * s.damping_now
        return (o.add_scaled(g, t, s.decay) if nesterov else t), t

    slot = Slot("trace", accumulator_dtype, moment_requires_grad)
    options = (("decay", decay), ("nesterov", nesterov), ("dampening", dampening))
    # a sparse gradient is densified: torch.optim.SGD keeps its momentum buffer sparse, with the values of a dense one
    decl = Elementwise(
        "trace", TraceState, (slot,), True, prologue, body, options=options, sparse=SparseRule(lazy=False)
    )
    return elementwise(decl)


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

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        scalars = {"one_minus_decay": 1 - decay}
        if debias:
            scalars["correction"] = host_number(bias_correction(decay, safe_increment(count)))
        return scalars

    def body(o: Any, s: Any, g: Any, p: Any, e: Any) -> tuple:
        e = o.lerp(e, o.cast(g, e), s.one_minus_decay)
        return (e / s.correction if debias else e), e

    slot = Slot("ema", accumulator_dtype)
    return elementwise(Elementwise("ema", EmaState, (slot,), True, prologue, body))
