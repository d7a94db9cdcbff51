"""Scaling by constants, learning rates and schedules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fadam._base import EmptyState, GradientTransformation, ScalarOrSchedule, Schedule
from fadam._program import Elementwise, SparseRule, elementwise
from fadam.transforms._validation import check_non_negative


def _scale_body(o: Any, s: Any, g: Any, p: Any) -> tuple:
    return (g * s.step_size,)


def scaling(
    name: str, factor: Callable[[], float | torch.Tensor], options: tuple[tuple[str, Any], ...] = ()
) -> GradientTransformation:
    """A stateless transform multiplying updates by ``factor()``, read at each update."""

    def prologue(count: None) -> dict[str, float | torch.Tensor]:
        return {"step_size": factor()}

    return elementwise(
        Elementwise(name, EmptyState, (), False, prologue, _scale_body, options=options, sparse=SparseRule())
    )


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    r"""Multiplies every update by a constant: :math:`u = \alpha g`.

    Args:
        step_size: the factor :math:`\alpha` (a float or a 0-d tensor, which may require grad).

    Example:
        >>> import torch, fadam
        >>> fadam.scale(-2.0).update([torch.ones(2)], fadam.EmptyState())[0]
        [tensor([-2., -2.])]
    """

    return scaling("scale", lambda: step_size, (("step_size", step_size),))


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken; the schedule is evaluated at it before it is incremented


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    r"""Multiplies updates by ``step_size_fn(count)``, the count starting at 0: :math:`u_t = \alpha(t)\, g_t`.

    Args:
        step_size_fn: a schedule, mapping the 0-d int32 step tensor to a factor.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_schedule(lambda step: 1.0 / (step + 1))
        >>> u, state = tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))
        >>> tx.update([torch.ones(1)], state)[0]
        [tensor([0.5000])]
    """

    return _scheduled_scaling("scale_by_schedule", step_size_fn)


def _scheduled_scaling(
    name: str, step_size_fn: Schedule, options: tuple[tuple[str, Any], ...] = ()
) -> GradientTransformation:
    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        return {"step_size": step_size_fn(count)}

    return elementwise(
        Elementwise(name, ScaleByScheduleState, (), True, prologue, _scale_body, options=options, sparse=SparseRule())
    )


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    r"""Scales updates by the learning rate, negated by default so that ``apply_updates`` descends: :math:`u = -\eta g`.

    Args:
        learning_rate: a float, a 0-d tensor (may require grad, for hypergradients), or a schedule ``step -> lr``.
        flip_sign: negate the learning rate (gradient descent).

    Example:
        >>> import torch, fadam
        >>> fadam.scale_by_learning_rate(0.1).update([torch.ones(1)], fadam.EmptyState())[0]
        [tensor([-0.1000])]
    """
    sign = -1.0 if flip_sign else 1.0
    options = (("learning_rate", learning_rate), ("flip_sign", flip_sign))
    if callable(learning_rate):
        return _scheduled_scaling("scale_by_learning_rate", lambda count: sign * learning_rate(count), options)
    check_non_negative("learning rate", learning_rate)
    # negated at each update: a negated tensor built here would be one graph node shared by every use of the
    # transform, freed by the first backward (a learned lr reused across outer iterations would then fail)
    return scaling("scale_by_learning_rate", lambda: sign * learning_rate, options)
