"""Transforms applied on some steps only, as a function of the step count: ``conditionally_transform`` (the
updates pass through unchanged otherwise) and ``conditionally_mask`` (zeros otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import safe_increment, zero_count
from fadam._tree import PyTree, tree_map
from fadam.combinators._wrappers import _host_bool, _select
from fadam.transforms._validation import check_state

ConditionFn = Callable[..., "bool | torch.Tensor"]  # (step, **extra_args) -> whether to run the inner transform


class ConditionallyTransformState(NamedTuple):
    inner_state: PyTree
    step: torch.Tensor  # 0-d int32: steps taken


class ConditionallyMaskState(NamedTuple):
    step: torch.Tensor  # 0-d int32: steps taken
    inner_state: PyTree


def _conditional(
    inner: GradientTransformation,
    should_transform_fn: ConditionFn,
    forward_extra_args: bool,
    rejected: Callable[[PyTree], PyTree],
    state_type: type,
    name: str,
) -> GradientTransformation:
    def init(params: PyTree) -> Any:
        return state_type(inner_state=inner.init(params), step=zero_count())

    def update(updates: PyTree, state: Any, params: PyTree | None = None, **extra_args: Any) -> tuple:
        check_state(state, state_type, name)
        flag = should_transform_fn(state.step, **(extra_args if forward_extra_args else {}))
        flag = torch.as_tensor(flag, dtype=torch.bool)
        step = safe_increment(state.step)
        known = _host_bool(flag)
        if known is False:  # the inner transform does not run: its state objects are returned as they are
            return rejected(updates), state_type(inner_state=state.inner_state, step=step)
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        if known is None:  # traced or on an accelerator: both outcomes, selected leaf by leaf
            new_updates = _select(flag, new_updates, rejected(updates))
            new_inner = _select(flag, new_inner, state.inner_state)
        return new_updates, state_type(inner_state=new_inner, step=step)

    return GradientTransformation(init, update)


def conditionally_transform(
    inner: GradientTransformation, should_transform_fn: ConditionFn, forward_extra_args: bool = False
) -> GradientTransformation:
    """Runs ``inner`` on the steps where ``should_transform_fn(step)`` is true; the updates pass through unchanged,
    and the inner state stays, on the others.

    Args:
        inner: the transform run conditionally.
        should_transform_fn: ``(step, **extra_args) -> bool`` (a bool or a 0-d bool tensor) of the steps taken so
            far, a 0-d int32 tensor.
        forward_extra_args: pass ``update``'s extra keyword arguments to ``should_transform_fn`` too.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.conditionally_transform(fadam.scale(10.0), lambda step: step >= 1)
        >>> state = tx.init([torch.zeros(1)])
        >>> u1, state = tx.update([torch.ones(1)], state)
        >>> u2, state = tx.update([torch.ones(1)], state)
        >>> u1, u2
        ([tensor([1.])], [tensor([10.])])

    References:
        optax's ``optax.transforms.conditionally_transform`` (0.2.8), whose semantics these are.
    """
    return _conditional(
        inner,
        should_transform_fn,
        forward_extra_args,
        lambda updates: updates,
        ConditionallyTransformState,
        "conditionally_transform",
    )


def conditionally_mask(
    inner: GradientTransformation, should_transform_fn: ConditionFn, forward_extra_args: bool = False
) -> GradientTransformation:
    """Runs ``inner`` on the steps where ``should_transform_fn(step)`` is true; the updates are zeros, and the inner
    state stays, on the others.

    Args:
        inner: the transform run conditionally.
        should_transform_fn: ``(step, **extra_args) -> bool`` (a bool or a 0-d bool tensor) of the steps taken so
            far, a 0-d int32 tensor.
        forward_extra_args: pass ``update``'s extra keyword arguments to ``should_transform_fn`` too.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.conditionally_mask(fadam.scale(10.0), lambda step: step % 2 == 1)
        >>> state = tx.init([torch.zeros(1)])
        >>> u1, state = tx.update([torch.ones(1)], state)
        >>> u2, state = tx.update([torch.ones(1)], state)
        >>> u1, u2
        ([tensor([0.])], [tensor([10.])])

    References:
        optax's ``optax.transforms.conditionally_mask`` (0.2.8), whose semantics these are.
    """

    def zeros(updates: PyTree) -> PyTree:
        return tree_map(lambda u: None if u is None else torch.zeros_like(u), updates)

    return _conditional(
        inner, should_transform_fn, forward_extra_args, zeros, ConditionallyMaskState, "conditionally_mask"
    )
