"""Selecting leaves: ``masked`` and ``partition`` (the functional form of torch.optim's param groups)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from fadam._base import GradientTransformation
from fadam._program import Program, program_of, with_program
from fadam._sparse import check_sparse
from fadam._tree import PyTree, check_leaves, first_difference, path_str, tree_flatten
from fadam.transforms._validation import check_state


class MaskedNode(NamedTuple):
    """Stands in for an unselected leaf: a pytree node with no leaves, so the inner transform allocates nothing."""


class MaskedState(NamedTuple):
    inner_state: PyTree


class PartitionState(NamedTuple):
    inner_states: dict[Hashable, MaskedState]


def _full_tree(
    prefix_or_fn: PyTree | Callable[[PyTree], PyTree],
    tree: PyTree,
    what: str,
    is_leaf: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """Leaves of ``prefix_or_fn`` (a callable of ``tree``, or a prefix tree of it) broadcast to ``tree``'s leaves
    (with optree's ``is_leaf``). A prefix whose mappings are of other kinds than the tree's (a dict prefix of an
    OrderedDict of params) is matched key by key."""
    prefix = prefix_or_fn(tree) if callable(prefix_or_fn) else prefix_or_fn
    if torch.compiler.is_compiling():
        return _leaves_by_path(prefix, tree, what, is_leaf)
    spec = optree.tree_structure(tree, is_leaf=is_leaf, none_is_leaf=True)
    try:
        full = optree.tree_broadcast_prefix(prefix, tree, is_leaf=is_leaf, none_is_leaf=True)
        full_leaves, full_spec = optree.tree_flatten(full, is_leaf=is_leaf, none_is_leaf=True)
    except ValueError:
        prefix_spec = optree.tree_structure(prefix, is_leaf=is_leaf, none_is_leaf=True)
        found = first_difference(prefix_spec, spec, prefix=True)
        if found is not None:
            path, node, tree_node = found
            raise ValueError(
                f"{what} is not a prefix of the params tree: at {path_str(path)} it has {node} where the params have "
                f"{tree_node}"
            ) from None
        full_spec = None
    if full_spec != spec:
        # the broadcast took the prefix's mappings, whose leaves flatten in another order than the tree's: each leaf's
        # value is looked up by its path
        return _leaves_by_path(prefix, tree, what, is_leaf)
    return full_leaves


def _leaves_by_path(prefix: PyTree, tree: PyTree, what: str, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """``_full_tree`` by lookups: each of ``tree``'s leaves looks its value up in ``prefix`` along its path. Also what
    runs under torch.compile, which cannot flatten a tree of constants (a mask) with optree. Prefix containers are
    dicts, lists and tuples (named or not); an eager ``init`` checks the prefix with optree."""
    values = []
    for path in optree.tree_paths(tree, is_leaf=is_leaf, none_is_leaf=True):
        node = prefix
        for key in path:
            if not isinstance(node, (dict, list, tuple)):
                break
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                raise ValueError(
                    f"{what} has no entry for {path_str(path)} (while torch.compile traces, its containers must be "
                    "dicts, lists or tuples shaped like a prefix of the params tree)"
                ) from None
        values.append(node)
    return values


def _select(tree: PyTree, selected: list[bool]) -> PyTree:
    leaves, spec = tree_flatten(tree)
    return spec.unflatten([leaf if keep else MaskedNode() for leaf, keep in zip(leaves, selected)])


def masked(
    inner: GradientTransformation,
    mask: PyTree | Callable[[PyTree], PyTree],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformation:
    """Applies ``inner`` to the selected leaves only; the others pass through unchanged.

    The inner transform sees a tree in which unselected leaves are replaced by an empty ``MaskedNode``, so its state
    exists only for selected leaves.

    Args:
        inner: the transform for the selected leaves.
        mask: a tree of bools shaped like the params, a prefix of one (``{"encoder": False, "head": True}``), or a
            callable ``params -> mask``.
        mask_compatible_extra_args: mask the extra arguments of ``update`` that have the updates' tree structure
            too (optax's option); the others reach ``inner`` whole.

    Example:
        >>> import torch, fadam
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx = fadam.masked(fadam.scale(0.0), {"w": True, "b": False})
        >>> updates, _ = tx.update(params, tx.init(params))
        >>> updates["w"], updates["b"]
        (tensor([0., 0.]), tensor([1.]))
    """

    def selection(tree: PyTree) -> list[bool]:
        flags = _full_tree(mask, tree, "mask")
        for index, flag in enumerate(flags):
            if not isinstance(flag, bool):
                path = path_str(optree.tree_paths(tree, none_is_leaf=True)[index])
                raise TypeError(f"mask leaf for {path} is {flag!r}; expected a bool")
        return flags

    return _masked_by(inner, selection, mask_compatible_extra_args)


def _masked_by(
    inner: GradientTransformation, selection: Callable[[PyTree], list[bool]], mask_extra_args: bool = False
) -> GradientTransformation:
    """``masked`` with the selection given as a function ``tree -> one bool per leaf``."""

    def init(params: PyTree) -> MaskedState:
        return MaskedState(inner.init(_select(params, selection(params))))

    def update(
        updates: PyTree, state: MaskedState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, MaskedState]:
        check_state(state, MaskedState, "masked")
        if params is not None:
            # before the mask is applied, so that errors name the params' paths
            check_leaves(updates, params, sparse=True)
        check_sparse(program, *tree_flatten(updates), params, state)  # each inner stage's rule for sparse gradients
        selected = selection(params if params is not None else updates)
        leaves, spec = tree_flatten(updates)
        inner_params = None if params is None else _select(params, selected)
        if mask_extra_args:
            like = optree.tree_structure(updates, none_is_leaf=True)
            extra_args = {
                name: _select(value, selected) if optree.tree_structure(value, none_is_leaf=True) == like else value
                for name, value in extra_args.items()
            }
        inner_updates, inner_state = inner.update(
            _select(updates, selected), state.inner_state, inner_params, **extra_args
        )
        new_inner = iter(tree_flatten(inner_updates)[0])
        merged = [next(new_inner) if keep else leaf for leaf, keep in zip(leaves, selected)]
        return spec.unflatten(merged), MaskedState(inner_state)

    program = program_of(inner).masked(selection, "inner_state")
    return with_program(init, update, program)


def partition(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: PyTree | Callable[[PyTree], PyTree],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformation:
    """Applies a different transform to each group of leaves, like torch.optim's param groups.

    Args:
        transforms: label -> transform.
        param_labels: a tree of labels shaped like the params, a prefix of one, or a callable ``params -> labels``.
        mask_compatible_extra_args: give each group's transform the leaves of its group of the extra arguments of
            ``update`` that have the updates' tree structure (optax's option); the others reach it whole.

    Example:
        >>> import torch, fadam
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> labels = {"w": "train", "b": "frozen"}
        >>> tx = fadam.partition({"train": fadam.sgd(0.1), "frozen": fadam.set_to_zero()}, labels)
        >>> updates, _ = tx.update(params, tx.init(params), params)
        >>> updates["b"]
        tensor([0.])
    """

    def labels_of(tree: PyTree) -> list[Hashable]:
        labels = _full_tree(param_labels, tree, "param_labels")
        for index, leaf_label in enumerate(labels):
            if leaf_label not in transforms:
                path = path_str(optree.tree_paths(tree, none_is_leaf=True)[index])
                raise ValueError(f"label {leaf_label!r} of {path} has no transform; known: {list(transforms)}")
        return labels

    def label_selection(label: Hashable) -> Callable[[PyTree], list[bool]]:
        return lambda tree: [leaf_label == label for leaf_label in labels_of(tree)]

    masked_transforms = {
        label: _masked_by(tx, label_selection(label), mask_compatible_extra_args) for label, tx in transforms.items()
    }

    def init(params: PyTree) -> PartitionState:
        return PartitionState({label: tx.init(params) for label, tx in masked_transforms.items()})

    def update(
        updates: PyTree, state: PartitionState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, PartitionState]:
        check_state(state, PartitionState, "partition")
        new_states = {}
        for label, tx in masked_transforms.items():
            updates, new_states[label] = tx.update(updates, state.inner_states[label], params, **extra_args)
        return updates, PartitionState(new_states)

    stages = [s for label, tx in masked_transforms.items() for s in program_of(tx).prefixed(label).stages]
    return with_program(init, update, Program(tuple(stages)).prefixed("inner_states"))
