"""One place that decides how leaf math runs.

Transforms describe their math per leaf; this module says when a faster execution strategy may be used instead:

- *per leaf* (always valid): plain torch ops, one leaf at a time. Required under ``torch.func`` transforms (vmap,
  grad), when autograd must record the step (meta-learning), and for tensor subclasses such as DTensor.
- *DTensor* (FSDP2 shards): per-leaf pointwise math runs shard-local; reductions over a whole tensor (norms) give a
  partial result that ``fadam._tree.tree_global_norm`` reduces across ranks explicitly. DTensors are never fused.
- *fused kernels* (``torch._fused_adam_`` and friends): in-place multi-tensor kernels that exist on CPU and CUDA in
  torch 2.13. They have no autograd and no vmap batching rule, so they are used only for plain tensors that need no
  graph. They walk a leaf's param, gradient and state as flat arrays of one layout, so every tensor must be
  contiguous (a strided view would be written past its elements, a transposed param read against a contiguous
  gradient). ``fadam._torch_kernels`` recognizes the chains they compute; ``fadam._execute.torch_ready`` is their
  per-leaf precondition.
- *generated kernels* (``fadam._execute``, ``fadam._cpu_kernel``): C++ compiled from a chain's declared
  per-element math, for any chain, on plain contiguous float32/float64 CPU tensors; ``fadam._execute.ready`` is
  their precondition; ``fadam._execute`` picks torch's fused kernels first, then them, group by group.
- *sparse gradients* (COO, as ``nn.Embedding(sparse=True)`` gives): per leaf, by the rule each transform declares
  for them (``fadam._sparse``); no kernel walks them, since they are not strided.

Measured on a 2-core CPU with torch 2.13 (benchmarks/bench_adam.py): the out-of-place ``torch._foreach_*`` ops are
slower than a per-leaf loop on CPU (93 ms vs 40 ms for a pure Adam step over 200 tensors of 84k elements), so the pure
path loops over leaves; the fused kernel is 4x faster than either.
"""

from __future__ import annotations

import sys
from typing import Any

import optree
import torch
from torch._C import _functorch

from fadam._compiled_checks import compiled_checks

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_TENSOR = torch.Tensor


def is_tensor_leaf(node: Any) -> bool:
    """Marks tensors as leaves (as optree treats them anyway) for optree's ``is_leaf``: it then skips its look-up of
    each leaf's type among the registered node types, about a third of the time of flattening a tree of tensors
    (optree 0.20)."""
    return isinstance(node, _TENSOR)


def functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether a ``torch.func`` transform (vmap, grad) wraps ``tensor``. torch.compile cannot trace that check (a graph
    break), nor tell reliably whether a transform is active, so while it traces the answer is ``True``: callers take the
    per-leaf path, valid for any tensor, which the compiled graph fuses. (Answering from what it can trace, a vmap
    batch or ``requires_grad``, sent the fused kernels into compiled graphs, where inductor refused them, and gave
    wrong gradients through a compiled ``torch.func.grad`` of ``fadam.step``.)"""
    return torch.compiler.is_compiling() or _functorch.is_functorch_wrapped_tensor(tensor)


def is_plain_type(tensor: torch.Tensor) -> bool:
    """A dense ``torch.Tensor`` or ``nn.Parameter``: no other subclass, no functorch wrapper (autograd may track it)."""
    return type(tensor) in PLAIN_TYPES and tensor.layout == torch.strided and not functorch_wrapped(tensor)


def is_plain(tensor: torch.Tensor) -> bool:
    """A plain-type tensor (``is_plain_type``) that autograd does not need to track."""
    return is_plain_type(tensor) and not (tensor.requires_grad and torch.is_grad_enabled())


def is_sparse(tensor: object) -> bool:
    """A sparse COO tensor: a gradient of ``nn.Embedding(sparse=True)``, which only some transforms take."""
    return isinstance(tensor, torch.Tensor) and tensor.is_sparse


def is_dtensor(tensor: object) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (sharded or replicated across a device mesh, as FSDP2 makes params)."""
    # No DTensor exists unless its module was imported; importing it here would add ~0.4 s to ``import fadam``.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def can_write_in_place(tensor: torch.Tensor) -> bool:
    """Whether a donated buffer may be updated in place: a plain tensor, or a DTensor (its local shard is written)
    that autograd does not need to track."""
    return is_plain(tensor) or (is_dtensor(tensor) and not (tensor.requires_grad and torch.is_grad_enabled()))


def first_overlap(params: Any, grads: Any, state: Any) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Two tensor leaves whose memory overlaps where a donated step would write one of them, as ``(tree, index)``
    pairs (tree 0 for ``params``, 1 for ``grads``, 2 for ``state``; the index counts that tree's leaves, ``None``
    leaves included), or ``None`` where there are none. Params and state are written, gradients only read, so two
    gradients may share memory; anything else may not (tied weights, views of one buffer, a gradient that is a
    param). Each leaf costs one storage pointer; only leaves of a storage that several use have their byte ranges
    compared, and ranges that meet count as overlapping even where strides interleave their elements. Tensors without
    memory (meta, empty), sparse ones and ``torch.func``-wrapped ones, which no step writes in place, are skipped."""
    return overlap_in_leaves(
        [optree.tree_leaves(tree, is_leaf=is_tensor_leaf, none_is_leaf=True) for tree in (params, grads, state)]
    )


def overlap_in_leaves(trees: list[list[Any]]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``first_overlap`` of the leaves of the params, the gradients and the state, flattened with ``None`` leaves."""
    checks = compiled_checks()
    if checks is not None and checks.distinct_storages(trees):
        return None
    pointers = storage_pointers(trees)
    distinct = set(pointers)
    distinct.discard(0)
    if len(distinct) == len(pointers) - pointers.count(0):
        return None
    users: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    flat = iter(pointers)
    for which, leaves in enumerate(trees):
        for index, leaf in enumerate(leaves):
            pointer = next(flat)
            if pointer:
                users.setdefault(pointer, []).append((which, index, leaf.to_local() if is_dtensor(leaf) else leaf))
    for shared in users.values():
        found = _overlap_in_storage(shared) if len(shared) > 1 else None
        if found is not None:
            return found
    return None


def storage_pointers(trees: list[list[Any]]) -> list[int]:
    """The storage pointer of each leaf of ``trees`` in turn (``_storage_pointer``'s: 0 where none is written)."""
    if _functorch.maybe_current_level() is not None:
        return [_storage_pointer(leaf) for leaves in trees for leaf in leaves]
    strided = torch.strided  # one comprehension for the common case, plain tensors
    return [
        leaf.untyped_storage().data_ptr()
        if type(leaf) in PLAIN_TYPES and leaf.layout is strided
        else _storage_pointer(leaf)
        for leaves in trees
        for leaf in leaves
    ]


def _storage_pointer(leaf: Any) -> int:
    """The storage pointer of a leaf that the comprehension in ``first_overlap`` does not read: a DTensor's local
    shard's (what its in-place update writes), 0 for a ``torch.func``-wrapped tensor or a leaf that is no tensor."""
    if is_dtensor(leaf):
        leaf = leaf.to_local()
    elif type(leaf) not in PLAIN_TYPES or leaf.layout != torch.strided:  # a sparse gradient has no one storage
        return 0
    return 0 if _functorch.is_functorch_wrapped_tensor(leaf) else leaf.untyped_storage().data_ptr()


def _overlap_in_storage(users: list[tuple[int, int, torch.Tensor]]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``first_overlap`` among the leaves of one storage: a sweep over their byte ranges in order of start, keeping the
    range that reaches furthest so far, of any leaf and of a written one (a leaf of tree 0 or 2)."""
    spans = []
    for which, index, tensor in users:
        if not tensor.numel():
            continue
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        reach = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
        spans.append((start, start + reach * size, which != 1, (which, index)))
    spans.sort(key=lambda span: span[0])
    furthest: tuple[int, tuple[int, int]] | None = None  # (end, leaf) of any leaf
    furthest_written: tuple[int, tuple[int, int]] | None = None
    for start, end, written, leaf in spans:
        other = furthest if written else furthest_written
        if other is not None and other[0] > start:
            return other[1], leaf
        if furthest is None or end > furthest[0]:
            furthest = (end, leaf)
        if written and (furthest_written is None or end > furthest_written[0]):
            furthest_written = (end, leaf)
    return None


def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """``view_as_real`` for complex tensors, the tensor itself otherwise (torch.optim's treatment of complex params)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor
