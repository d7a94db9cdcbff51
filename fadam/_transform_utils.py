"""optax's helpers of the transform protocol under their names: ``init_empty_state``, ``with_extra_args_support``
and ``tree_map_params`` (a function applied to the param-shaped trees of a state)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import optree

from fadam._base import EmptyState, GradientTransformation
from fadam._tree import PyTree

__all__ = ["init_empty_state", "tree_map_params", "with_extra_args_support"]


def init_empty_state(params: PyTree) -> EmptyState:
    """The ``init`` of a stateless transform: ``EmptyState()`` whatever the params.

    Example:
        >>> import torch, fadam
        >>> fadam.init_empty_state({"w": torch.zeros(2)})
        EmptyState()

    References:
        optax's ``optax.init_empty_state`` (0.2.8).
    """
    del params
    return EmptyState()


def _takes_extra_args(update: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): wrapped, to be safe
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` whose ``update`` accepts and ignores keyword arguments it does not take (``loss=...`` passed through a
    chain). Every fadam transform already does, and is returned as it is; a transform of one's own whose ``update``
    has no ``**kwargs`` is wrapped.

    Args:
        tx: a ``GradientTransformation``.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.GradientTransformation(lambda params: (), lambda updates, state, params=None: (updates, state))
        >>> fadam.with_extra_args_support(tx).update([torch.ones(1)], (), loss=3.0)[0]
        [tensor([1.])]

    References:
        optax's ``optax.with_extra_args_support`` (0.2.8).
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"with_extra_args_support expects a GradientTransformation, got {type(tx).__name__}")
    if _takes_extra_args(tx.update):
        return tx

    def update(updates: PyTree, state: PyTree, params: PyTree | None = None, **_: Any) -> tuple[PyTree, PyTree]:
        return tx.update(updates, state, params)

    return GradientTransformation(tx.init, update)


class _ParamsPlaceholder(NamedTuple):
    """Stands for the whole params tree in ``init``: a node without leaves, so that every tree an ``init`` builds by
    mapping over the params comes out as a placeholder too, marking where the state holds param-shaped trees."""


def tree_map_params(
    initable: Callable[[PyTree], PyTree] | GradientTransformation,
    f: Callable[..., Any],
    state: PyTree,
    /,
    *rest: PyTree,
    transform_non_params: Callable[[Any], Any] | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
) -> PyTree:
    """Applies ``f`` to every leaf of each param-shaped tree in an optimizer state (the moments, not the counts).

    The param-shaped trees are found by calling ``init`` on a placeholder for the params: a tree ``init`` maps over
    the params comes out as the placeholder. This needs an ``init`` that only maps over its params (as optax's
    does); one that reads them (their shapes, their number) fails.

    Args:
        initable: a transform, or its ``init``.
        f: ``f(leaf, *rest_leaves)``, applied to each leaf of each param-shaped tree.
        state: the state to map over.
        *rest: trees shaped like the params, whose leaves are passed to ``f`` too.
        transform_non_params: applied to every other leaf of the state (default: left as it is).
        is_leaf: passed to the map over each param-shaped tree (which subtrees ``f`` takes whole).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adam(1e-3)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> shapes = fadam.tree_map_params(tx, lambda p: tuple(p.shape), state, transform_non_params=lambda _: None)
        >>> shapes[0].mu, shapes[0].count
        ({'w': (2,)}, None)

    References:
        optax's ``optax.tree_map_params`` (0.2.8).
    """
    init = initable.init if hasattr(initable, "init") else initable
    marked = init(_ParamsPlaceholder())

    def map_params(mark: Any, value: Any) -> Any:
        if isinstance(mark, _ParamsPlaceholder):
            return optree.tree_map(f, value, *rest, is_leaf=is_leaf)
        return value if transform_non_params is None else transform_non_params(value)

    # None is an empty node here, as in JAX: a missing leaf is neither mapped nor transformed
    return optree.tree_map(map_params, marked, state, is_leaf=lambda x: isinstance(x, _ParamsPlaceholder))
