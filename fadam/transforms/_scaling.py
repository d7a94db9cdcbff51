"""Scaling by constants, learning rates and schedules."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import EmptyState, GradientTransformation, ScalarOrSchedule, Schedule, stateless_with_tree_map
from fadam._numerics import for_leaf, safe_increment, zero_count
from fadam._tree import PyTree, tree_map
from fadam.transforms._validation import check_non_negative, check_state


def _scale_leaves(updates: PyTree, factor: float | torch.Tensor) -> PyTree:
    if not isinstance(factor, torch.Tensor):  # a Python number never changes the update's dtype
        return tree_map(lambda g: None if g is None else g * factor, updates)
    # a 0-d tensor factor (a schedule's float64 value) would promote a 0-d update: keep the update's dtype
    return tree_map(lambda g: None if g is None else (g * for_leaf(factor, g)).to(g.dtype), updates)


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    r"""Multiplies every update by a constant: :math:`u = \alpha g`.

    Args:
        step_size: the factor :math:`\alpha` (a float or a 0-d tensor, which may require grad).

    Example:
        >>> import torch, fadam
        >>> fadam.scale(-2.0).update([torch.ones(2)], fadam.EmptyState())[0]
        [tensor([-2., -2.])]
    """

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, EmptyState]:
        return _scale_leaves(updates, step_size), state

    return GradientTransformation(lambda params: EmptyState(), update)


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

    def init(params: PyTree) -> ScaleByScheduleState:
        return ScaleByScheduleState(zero_count())

    def update(
        updates: PyTree, state: ScaleByScheduleState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByScheduleState]:
        check_state(state, ScaleByScheduleState, "scale_by_schedule")
        return _scale_leaves(updates, step_size_fn(state.count)), ScaleByScheduleState(safe_increment(state.count))

    return GradientTransformation(init, update)


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
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    check_non_negative("learning rate", learning_rate)
    if isinstance(learning_rate, torch.Tensor):
        # negated at each update: a negated tensor built here would be one graph node shared by every use of the
        # transform, freed by the first backward (a learned lr reused across outer iterations would then fail)
        return stateless_with_tree_map(lambda g, p: g * (sign * learning_rate))
    return scale(sign * learning_rate)
