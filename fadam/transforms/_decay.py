"""Weight decay added to the updates (coupled L2 before Adam, decoupled after it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fadam._base import EmptyState, GradientTransformation, ScalarOrSchedule
from fadam._program import Elementwise, elementwise
from fadam._tree import PyTree
from fadam.combinators._masking import masked
from fadam.transforms._scaling import ScaleByScheduleState
from fadam.transforms._validation import check_non_negative

# why a sparse gradient is refused, with torch.optim.Adagrad's words and those torch.optim.SGD fails with
_SPARSE_REFUSAL = (
    "weight_decay option is not compatible with sparse gradients: the decay would make the update dense; torch.optim "
    'refuses it too, its SGD with "add(sparse, dense) is not supported. Use add(dense, sparse) instead."'
)


def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0, mask: PyTree | Callable[[PyTree], PyTree] | None = None
) -> GradientTransformation:
    r"""Adds the params scaled by the weight decay: :math:`u = g + \lambda_t\, p`.

    Placed before ``scale_by_adam`` this is torch.optim.Adam's L2 penalty; placed after it, AdamW's decoupled decay.

    Args:
        weight_decay: the factor :math:`\lambda` (a float, a 0-d tensor, or a schedule of the step count, which then
            lives in the state as ``ScaleByScheduleState(count)``).
        mask: a bool tree (or a prefix of one, or a callable ``params -> tree``) selecting the leaves to decay.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.add_decayed_weights(0.1)
        >>> tx.update([torch.zeros(1)], tx.init(None), [torch.full((1,), 2.0)])[0]
        [tensor([0.2000])]
    """
    schedule = weight_decay if callable(weight_decay) else None
    if schedule is None:
        check_non_negative("weight_decay", weight_decay)

    def prologue(count: torch.Tensor | None) -> dict[str, float | torch.Tensor]:
        return {"weight_decay": schedule(count) if schedule else weight_decay}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (o.add_scaled(g, o.cast(p, g), s.weight_decay),)  # torch.optim's grad.add(param, alpha=decay)

    state_type = ScaleByScheduleState if schedule else EmptyState
    tx = elementwise(
        Elementwise(
            "add_decayed_weights",
            state_type,
            (),
            schedule is not None,
            prologue,
            body,
            uses_params=True,
            options=(("weight_decay", weight_decay),),
            sparse=_SPARSE_REFUSAL,
        )
    )
    return tx if mask is None else masked(tx, mask)


def add_decoupled_weight_decay(
    learning_rate: ScalarOrSchedule, weight_decay: ScalarOrSchedule
) -> GradientTransformation:
    r"""Decoupled weight decay as ``torch.optim.AdamW`` applies it, for use after ``scale_by_learning_rate``.

    .. math::
        u = g - \left(p - p \cdot \mathrm{rnd}(1 - \eta_t \lambda_t)\right)

    so that ``p + u`` equals torch's ``p.mul_(1 - lr * weight_decay)`` followed by the step. The factor is rounded
    to the param's dtype exactly as torch's in-place multiply rounds it; that rounding is systematic (the same every
    step), which is why this matches torch.optim.AdamW to float32 precision over hundreds of steps where the
    algebraically equal ``-lr * (g + weight_decay * p)`` drifts by up to 1e-5.

    Args:
        learning_rate: the learning rate :math:`\eta_t` (float, 0-d tensor or schedule of the step count).
        weight_decay: the decay :math:`\lambda_t` (float, 0-d tensor or schedule of the step count). With a schedule
            in either argument the state is ``ScaleByScheduleState(count)``, shared by both.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.add_decoupled_weight_decay(0.1, 0.5)
        >>> tx.update([torch.zeros(1)], tx.init([torch.ones(1)]), [torch.full((1,), 2.0)])[0]
        [tensor([-0.1000])]
    """
    lr_schedule = learning_rate if callable(learning_rate) else None
    wd_schedule = weight_decay if callable(weight_decay) else None
    if wd_schedule is None:
        check_non_negative("weight_decay", weight_decay)
    counted = lr_schedule is not None or wd_schedule is not None

    def prologue(count: torch.Tensor | None) -> dict[str, float | torch.Tensor]:
        lr = lr_schedule(count) if lr_schedule else learning_rate
        decay = wd_schedule(count) if wd_schedule else weight_decay
        return {"factor": 1 - lr * decay}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        # torch.optim's p.mul_(1 - lr * weight_decay), as an update: p's dtype multiplies by the factor
        return (g - o.cast(p - p * s.factor, g),)

    state_type = ScaleByScheduleState if counted else EmptyState
    return elementwise(
        Elementwise(
            "add_decoupled_weight_decay",
            state_type,
            (),
            counted,
            prologue,
            body,
            uses_params=True,
            options=(("learning_rate", learning_rate), ("weight_decay", weight_decay)),
        )
    )
