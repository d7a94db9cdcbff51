"""Sparse gradients: the sparse COO tensors that ``nn.Embedding(sparse=True)`` gives, stepped as torch.optim steps them.

torch.optim takes them in SGD (the update is added as it is; a momentum buffer, which it keeps sparse, holds the
same values as a dense one), Adagrad (its sparse path: the gradient coalesced, the sum and the param changed at the
stored elements only) and SparseAdam (Adam on the stored elements only); its other optimizers refuse them. A declared
transform says how it takes them with a ``SparseRule`` (``Elementwise.sparse``):

- *lazy* (``scale``, ``scale_by_learning_rate``, ``scale_by_rss``, ``scale_by_sparse_adam``): the update is coalesced
  (repeated indices summed), the body runs on its stored values and on its slots' values at those indices, the new
  slot values are written there, and the update stays sparse, with the same indices;
- *densified* (``trace``): the body runs on the densified update, and gives a dense one;
- no rule (every other transform, and opaque ones): a sparse gradient is refused, naming the leaf and the transform,
  before anything is computed. ``scale_by_sparse_adam`` refuses dense gradients alike, as SparseAdam does.

Sparse updates run eagerly (``fadam._program.eager_stage``), leaf by leaf: no kernel walks them. A sparse update added
to its param (``fadam.apply_updates``) changes the stored elements only.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from fadam._program import EAGER, Elementwise, Program, SparseRule, Stage, leaf_selection
from fadam._tree import PyTree, UnsupportedGradientError, path_str

__all__ = ["check_sparse", "sparse_body"]

# where a gradient is refused: what takes sparse ones instead
_TAKERS = (
    "densify it (grad.to_dense()), or use fadam.sgd, fadam.adagrad (both without weight decay) or fadam.sparse_adam"
)


def sparse_body(decl: Elementwise, s: Any, u: torch.Tensor, p: torch.Tensor | None, slots: list[Any]) -> tuple:
    """``decl``'s body on the sparse COO update ``u`` of one leaf, by its rule (see the module's docstring): the
    update and the new slot leaves, as the body gives them."""
    rule = decl.sparse
    if not isinstance(rule, SparseRule):  # made sparse by an opaque stage before it, which check_sparse cannot see
        raise UnsupportedGradientError(f"sparse updates are not supported by {decl.name}; {_TAKERS}")
    if not rule.lazy:
        return decl.body(EAGER, s, u.to_dense(), p, *slots)
    u = u.coalesce()  # the body is not linear in general: each element once, its repeated entries summed
    rows = _stored_rows(u)
    shape = (-1, *u.shape[u.sparse_dim() :])  # a leaf as rows over the sparse dims, like the update's values
    flat = [slot.reshape(shape) for slot in slots]
    p_rows = None if p is None else p.reshape(shape)[rows]
    result = decl.body(EAGER, s, u.values(), p_rows, *(leaf[rows] for leaf in flat))
    update = torch.sparse_coo_tensor(u.indices(), result[0], u.shape, is_coalesced=True, check_invariants=False)
    written = (leaf.index_put((rows,), new.to(leaf.dtype)) for leaf, new in zip(flat, result[1:]))
    return (update, *(leaf.reshape(slot.shape) for leaf, slot in zip(written, slots)))


def _stored_rows(u: torch.Tensor) -> torch.Tensor:
    """The index of each element the coalesced ``u`` stores, over its sparse dims flattened into one (none: a 0-d
    update's one element, index 0)."""
    sizes = u.shape[: u.sparse_dim()]
    strides = torch.tensor([math.prod(sizes[i + 1 :]) for i in range(len(sizes))], dtype=torch.int64, device=u.device)
    return (u.indices() * strides.unsqueeze(1)).sum(0)


def check_sparse(
    program: Program,
    updates: list[Any],
    spec: optree.PyTreeSpec,
    params: PyTree | None = None,
    state: Any = None,
    what: str = "updates",
) -> None:
    """Raises ``UnsupportedGradientError``, naming the leaf and the transform, where a sparse update would reach a
    stage that does not take it, or a dense one a stage that takes sparse ones only; ``updates`` are the leaves of
    the tree ``spec`` describes, ``params`` select the leaves of masked stages (the updates where ``None``), and
    ``state`` expands the stages that build their program at each step (``inject_hyperparams``)."""
    sparse = [isinstance(u, torch.Tensor) and u.is_sparse for u in updates]  # is_sparse, inlined: a leaf a step
    if not any(sparse) and not any(_sparse_only(stage) for stage in program.stages):
        return
    if state is not None and any(stage.expand is not None for stage in program.stages):
        try:
            program = program.expanded(state)[0]
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            return  # a state of another layout: the transforms' own updates name what they expected
    tree = spec.unflatten(updates) if params is None else params
    paths = spec.paths()
    for stage in program.stages:
        rule = None if stage.decl is None else stage.decl.sparse
        selected = leaf_selection(stage, tree) if stage.selections else None
        for i, u in enumerate(updates):
            if u is None or (selected is not None and not selected[i]):
                continue
            where = f"{what} leaf at {path_str(paths[i])}"
            if sparse[i] and not isinstance(rule, SparseRule):
                reason = f" ({rule})" if isinstance(rule, str) else ""
                raise UnsupportedGradientError(
                    f"{where}: sparse gradients are not supported by {_name(stage)}{reason}; {_TAKERS}"
                )
            if sparse[i]:
                sparse[i] = rule.lazy  # a densified update is dense for the stages after it
            elif _sparse_only(stage):
                raise UnsupportedGradientError(f"{where}: {_name(stage)} takes sparse gradients only ({rule.dense})")


def _sparse_only(stage: Stage) -> bool:
    rule = None if stage.decl is None else stage.decl.sparse
    return isinstance(rule, SparseRule) and rule.dense is not None


def _name(stage: Stage) -> str:
    if stage.decl is not None:
        return stage.decl.name
    from fadam._execute import _opaque_name  # the executor builds on this module

    return _opaque_name(stage)
