"""Tree math on optree shared by every transform, and path-aware input checks.

Params, updates and state are pytrees of tensors. ``None`` is treated as a leaf here (``none_is_leaf=True``) so that a
missing gradient keeps its place in the tree: torch.optim skips a param whose ``.grad`` is ``None``, and fadam does the
same leaf by leaf.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch._C import _functorch

from fadam._compiled_checks import compiled_checks
from fadam._dispatch import PLAIN_TYPES, is_dtensor, is_tensor_leaf, real_view
from fadam._numerics import dtype_for, safe_sqrt

PyTree = Any

__all__ = [
    "PyTree",
    "tree_add",
    "tree_cast",
    "tree_flatten",
    "tree_global_norm",
    "tree_leaves",
    "tree_map",
    "tree_paths",
    "tree_scale",
    "tree_sub",
    "tree_zeros_like",
    "path_str",
]


class UnsupportedGradientError(ValueError, RuntimeError):
    """A gradient a transform cannot take (a sparse one for Adam, a dense one for SparseAdam): a ``ValueError``, as
    fadam refuses bad input, and a ``RuntimeError``, as torch.optim refuses it at its step."""


def tree_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` keeping ``None`` leaves in place."""
    return optree.tree_flatten(tree, is_leaf=is_tensor_leaf, none_is_leaf=True)


def tree_leaves(tree: PyTree) -> list[Any]:
    return optree.tree_leaves(tree, is_leaf=is_tensor_leaf, none_is_leaf=True)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``optree.tree_map`` with ``None`` as a leaf; ``fn`` receives ``None`` for a missing gradient."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=True)


def tree_paths(tree: PyTree) -> list[str]:
    """Readable path of every leaf, e.g. ``['fc1.weight']`` or ``[0].mu['w']``."""
    return [path_str(p) for p in optree.tree_paths(tree, none_is_leaf=True)]


def path_str(path: Sequence[Any]) -> str:
    if not path:
        return "<root>"
    return "".join(f"[{key!r}]" for key in path)


def _skip_none(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor | None]:
    def apply(x: torch.Tensor | None, *rest: Any) -> torch.Tensor | None:
        return None if x is None else fn(x, *rest)

    return apply


def tree_add(a: PyTree, b: PyTree, alpha: float = 1.0) -> PyTree:
    """``a + alpha * b`` leaf by leaf."""
    return tree_map(_skip_none(lambda x, y: x + y if alpha == 1.0 else x + alpha * y), a, b)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    return tree_map(_skip_none(lambda x, y: x - y), a, b)


def tree_scale(tree: PyTree, factor: float | torch.Tensor) -> PyTree:
    return tree_map(_skip_none(lambda x: x * factor), tree)


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    return tree_map(_skip_none(lambda x: torch.zeros_like(x, dtype=dtype_for(x, dtype))), tree)


def tree_cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Casts floating leaves to ``dtype`` (``None`` keeps them; complex leaves get the complex dtype of that precision);
    integer and bool leaves are left alone."""
    if dtype is None:
        return tree
    return tree_map(
        _skip_none(lambda x: x.to(dtype_for(x, dtype)) if x.is_floating_point() or x.is_complex() else x), tree
    )


def tree_global_norm(tree: PyTree) -> torch.Tensor:
    """L2 norm over all elements of all leaves (complex leaves by modulus), as a 0-d tensor.

    When autograd records it, the squares are summed with ``dot`` and the root is ``safe_sqrt``: the second derivative
    of ``vector_norm`` is NaN at a zero leaf, which would poison meta-gradients through ``clip_by_global_norm``.

    Otherwise, for leaves that are no DTensors, it is the norm of the leaves' norms (for leaves of one dtype and device,
    ``clip_grad_norm_(foreach=True)``'s total norm bit for bit). Leaves may live on several devices (model parallel):
    each leaf's norm is taken on its own device and the norms are stacked on the first leaf's device. DTensor leaves
    (FSDP2) sharded or replicated over a mesh add their local shards' squares on each rank, and those sums are reduced
    across the mesh's sharded dimensions in one collective per mesh and layout (not one per leaf): every rank must
    call this with the same tree. The result is then a plain tensor, equal on every rank. Under ``torch.func.vmap``
    the norm is per batch member.
    """
    leaves = [x for x in tree_leaves(tree) if x is not None]
    if not leaves:
        return torch.zeros([])
    # autograd or torch.func.grad records the norm: the formulation whose higher derivatives are finite (under vmap
    # alone the plain one is kept, so that a vmapped norm equals the per-member ones bit for bit)
    # (under torch.compile, which cannot trace the functorch check, too: it is valid for any tensor)
    traced = torch.compiler.is_compiling() or any(
        _functorch.is_gradtrackingtensor(x) or (x.requires_grad and torch.is_grad_enabled()) for x in leaves
    )
    if not traced:
        plain = all(type(x) in PLAIN_TYPES for x in leaves)
        if plain or not any(is_dtensor(x) for x in leaves):
            return _norm_of_norms(leaves, plain)
    squares = []
    local_squares: dict[tuple, list[torch.Tensor]] = {}  # per mesh and layout: the local shards' squares
    for x in leaves:
        layout = _reducible_layout(x) if is_dtensor(x) else None
        if layout is not None:
            local_squares.setdefault(layout, []).append(torch.linalg.vector_norm(x.to_local()) ** 2)
        elif traced and not is_dtensor(x):
            flat = real_view(x).reshape(-1)
            squares.append(torch.dot(flat, flat))
        else:
            norm = torch.linalg.vector_norm(x)
            squares.append((norm.full_tensor() if is_dtensor(norm) else norm) ** 2)
    for layout, found in local_squares.items():
        squares.append(_reduced(sum(found[1:], found[0]), layout))
    squares = _moved(squares, squares[0].device)
    total = sum(squares[1:], squares[0])
    return safe_sqrt(total) if traced else torch.sqrt(total)


def _norm_of_norms(leaves: list[Any], plain: bool) -> torch.Tensor:
    """The norm of the leaves' norms, on the first leaf's device; ``plain``: every leaf is a plain tensor."""
    device = leaves[0].device
    if plain and _functorch.maybe_current_level() is None and all(x.device == device for x in leaves):
        norms = torch._foreach_norm(leaves)  # the common case, in one call (it takes no tensor torch.func wraps)
    else:
        norms = _moved([torch.linalg.vector_norm(x) for x in leaves], device)
    return torch.linalg.vector_norm(torch.stack(norms))


def _moved(values: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``values`` on ``device``: a copy to the CPU blocks (its value is read right away); a copy between accelerators
    needs no host sync."""
    return [v if v.device == device else v.to(device, non_blocking=device.type != "cpu") for v in values]


def _reducible_layout(x: Any) -> tuple | None:
    """A DTensor's mesh and which of its mesh dimensions shard it, where each placement is a ``Shard`` (its ranks hold
    disjoint parts) or a ``Replicate`` (each holds the same): the sum of the local squares over the sharded dimensions
    is then the whole tensor's. ``None`` for other placements (partial values), which reduce leaf by leaf."""
    from torch.distributed.tensor import Replicate, Shard

    if not all(isinstance(p, (Shard, Replicate)) for p in x.placements):
        return None
    return x.device_mesh, tuple(isinstance(p, Shard) for p in x.placements)


def _reduced(local: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The sum of every rank's ``local`` over the layout's sharded mesh dimensions (one all-reduce), as a plain
    tensor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh, sharded = layout
    placements = [Partial() if shards else Replicate() for shards in sharded]
    return DTensor.from_local(local, mesh, placements, run_check=False).full_tensor()


def _is_empty_node(x: Any) -> bool:
    if x is None or isinstance(x, torch.Tensor):
        return False
    spec = optree.tree_structure(x, none_is_leaf=True)
    return not spec.is_leaf() and spec.num_children == 0


_MAPPING_KINDS = frozenset({optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT, optree.PyTreeKind.DEFAULTDICT})
# dtypes whose tensors fadam can optimize: gradients, updates and params of any other dtype are refused
_STRIDED = torch.strided
_OPTIMIZABLE = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128}
)


def _node_name(spec: optree.PyTreeSpec) -> str:
    if spec.is_leaf():
        return "a leaf"
    return f"a {spec.type.__name__} of {spec.num_children}"


def first_difference(
    spec: optree.PyTreeSpec, like: optree.PyTreeSpec, *, prefix: bool = False, path: tuple = ()
) -> tuple[tuple, str, str] | None:
    """The first node where ``spec`` and ``like`` differ, as ``(path, node in spec, node in like)``, or ``None``.

    Mappings of different kinds (dict, OrderedDict, defaultdict) with the same keys match, child by key: a
    ``module.state_dict()`` (an OrderedDict) and a dict of the same tensors are the same tree to fadam. With
    ``prefix``, a leaf of ``spec`` matches any subtree of ``like``.
    """
    if spec.is_leaf() and (prefix or like.is_leaf()):
        return None
    if spec.is_leaf() or like.is_leaf():
        return path, _node_name(spec), _node_name(like)
    if spec.kind in _MAPPING_KINDS and like.kind in _MAPPING_KINDS:
        children = dict(zip(spec.entries(), spec.children()))
        for key, like_child in zip(like.entries(), like.children()):
            if key not in children:
                return (*path, key), "no entry", _node_name(like_child)
            found = first_difference(children.pop(key), like_child, prefix=prefix, path=(*path, key))
            if found is not None:
                return found
        if children:
            key, child = next(iter(children.items()))
            return (*path, key), _node_name(child), "no entry"
        return None
    if spec.type is not like.type or spec.num_children != like.num_children or spec.entries() != like.entries():
        return path, _node_name(spec), _node_name(like)
    for entry, child, like_child in zip(spec.entries(), spec.children(), like.children()):
        found = first_difference(child, like_child, prefix=prefix, path=(*path, entry))
        if found is not None:
            return found
    return None


@functools.lru_cache(maxsize=64)
def _order_like(spec: optree.PyTreeSpec, like: optree.PyTreeSpec) -> tuple[int, ...] | None:
    """For trees that differ only in their kinds of mapping: the index in ``spec``'s leaves of each of ``like``'s
    leaves (dict flattens in sorted key order, OrderedDict in insertion order). ``None`` if they differ otherwise."""
    if first_difference(spec, like) is not None:
        return None
    index = {path: i for i, path in enumerate(spec.paths())}
    return tuple(index[path] for path in like.paths())


def describe_mismatch(tree: PyTree, like: PyTree, what: str, like_what: str) -> str:
    """Names the first place where ``tree`` and ``like`` differ: a leaf path one has and the other lacks, or the
    first node whose type differs. Short whatever the trees' size."""
    # empty nodes (MaskedNode() for a leaf that masked() left out) get a path too, so that their mismatch is named
    paths = optree.tree_paths(tree, is_leaf=_is_empty_node, none_is_leaf=True)
    like_paths = optree.tree_paths(like, is_leaf=_is_empty_node, none_is_leaf=True)
    known, like_known = set(paths), set(like_paths)
    problems = []
    missing = next((path for path in like_paths if path not in known), None)
    if missing is not None:
        problems.append(f"no leaf at {path_str(missing)} in {what}, but {like_what} has one")
    extra = next((path for path in paths if path not in like_known), None)
    if extra is not None:
        problems.append(f"extra leaf at {path_str(extra)} in {what}, not in {like_what}")
    if problems:
        return f"{'; '.join(problems)} ({len(paths)} leaves vs {len(like_paths)})"
    spec, like_spec = optree.tree_structure(tree, none_is_leaf=True), optree.tree_structure(like, none_is_leaf=True)
    # the same leaf paths: check_leaves calls this only for trees that differ beyond their kinds of mapping
    path, node, like_node = first_difference(spec, like_spec)
    return f"at {path_str(path)}, {what} has {node} where {like_what} has {like_node}"


def check_leaves(
    updates: PyTree, like: PyTree, *, what: str = "updates", like_what: str = "params", sparse: bool = False
) -> tuple[list[Any], list[Any], optree.PyTreeSpec]:
    """Flattens ``updates`` and ``like`` together, raising before any math if they cannot be used together.

    Checks, naming the leaf's path: equal tree structure (mappings of different kinds with the same keys count as
    equal: the leaves of ``updates`` are then returned in ``like``'s order, with ``like``'s spec), every update a dense
    floating-point or complex ``torch.Tensor`` or ``None``, with the same shape and device as the corresponding leaf of
    ``like``, which must be floating-point or complex too. Returns both leaf lists and the tree spec.

    With ``sparse``, an update may also be a real floating-point sparse COO tensor (coalesced or not) of a dense leaf
    of ``like``: the caller then routes it by its transforms' sparse rules (``fadam._sparse``), which refuse it where
    a transform does not take it. Without, it is refused here.
    """
    leaves, like_leaves, spec, _ = _checked(updates, like, what, like_what, sparse)
    return leaves, like_leaves, spec


def _checked(
    updates: PyTree, like: PyTree, what: str, like_what: str, sparse: bool = False
) -> tuple[list[Any], list[Any], optree.PyTreeSpec, bool]:
    """``check_leaves``, also saying whether the leaves of ``updates`` were put in ``like``'s order."""
    leaves, spec = tree_flatten(updates)
    like_leaves, like_spec = tree_flatten(like)
    reordered = spec != like_spec
    if reordered:
        order = _order_like(spec, like_spec)
        if order is None:
            raise ValueError(f"{what} do not match {like_what}: {describe_mismatch(updates, like, what, like_what)}")
        leaves, spec = [leaves[i] for i in order], like_spec
    # the pairs ``_dense_alike`` accepts are skipped in C++ where the extension is loaded; the others are looked at here
    checks = compiled_checks()
    index = checks.first_unlike(leaves, like_leaves, 0) if checks is not None else 0
    while index < len(leaves):
        leaf, ref = leaves[index], like_leaves[index]
        if not (leaf is None or _dense_alike(leaf, ref)):
            problem = _leaf_problem(leaf, ref, like_what, sparse)
            if problem:
                raise ValueError(f"{what} leaf at {path_str(spec.paths()[index])}: {problem}")
        index = checks.first_unlike(leaves, like_leaves, index + 1) if checks is not None else index + 1
    return leaves, like_leaves, spec, reordered


def _dense_alike(leaf: Any, ref: Any) -> bool:
    """The common case that ``_leaf_problem`` finds nothing wrong with, decided in one expression (it runs for every
    leaf of every step): a dense floating or complex tensor of a tensor of the same shape and device."""
    return (
        isinstance(leaf, torch.Tensor)
        and isinstance(ref, torch.Tensor)
        and leaf.layout is _STRIDED
        and leaf.dtype in _OPTIMIZABLE
        and ref.dtype in _OPTIMIZABLE
        and leaf.shape == ref.shape
        and ((leaf.is_cpu and ref.is_cpu) or leaf.device == ref.device)
    )


def _leaf_problem(leaf: Any, ref: Any, like_what: str, sparse: bool = False) -> str | None:
    if not isinstance(leaf, torch.Tensor):
        return f"expected a torch.Tensor or None, got {type(leaf).__name__}"
    if leaf.layout is not torch.strided:
        if not (sparse and leaf.is_sparse):
            return f"sparse or non-strided tensors ({leaf.layout}) are not supported; densify the gradient first"
        problem = _sparse_problem(leaf, ref, like_what)
        if problem:
            return problem
    if leaf.dtype not in _OPTIMIZABLE:
        return f"dtype {leaf.dtype} is not supported: gradients and updates must be floating-point or complex"
    if isinstance(ref, torch.Tensor):
        if leaf.shape != ref.shape:
            return f"shape {tuple(leaf.shape)} does not match expected {tuple(ref.shape)} in {like_what}"
        if leaf.device != ref.device:
            return f"device {leaf.device} does not match expected {ref.device} in {like_what}"
        if ref.dtype not in _OPTIMIZABLE:
            return (
                f"its leaf in {like_what} has dtype {ref.dtype}; only floating-point and complex params are optimized"
            )
    return None


def _sparse_problem(leaf: torch.Tensor, ref: Any, like_what: str) -> str | None:
    """What a sparse COO update cannot be: complex (torch.optim's sparse paths compute in complex arithmetic where its
    dense ones take pairs of reals), or the update of a leaf of ``like`` that is not a dense tensor."""
    if leaf.is_complex():
        return f"a sparse gradient of dtype {leaf.dtype}: complex sparse gradients are not supported; densify it"
    if isinstance(ref, torch.Tensor) and ref.layout != torch.strided:
        return f"a sparse gradient of a {ref.layout} leaf in {like_what}: sparse gradients step dense params only"
    return None


def check_params(params: PyTree, what: str = "params") -> list[Any]:
    """The leaves of ``params`` for an ``init``, raising naming the leaf's path unless each is a floating-point or
    complex tensor or ``None`` (a generator, such as ``model.parameters()``, is refused: ``init`` could not read it
    again, and the step needs the same tree)."""
    if isinstance(params, Iterator):
        raise TypeError(
            f"{what} is a {type(params).__name__}, which can be read only once: pass a list "
            "(list(model.parameters())) or a dict (dict(model.named_parameters()))"
        )
    leaves, spec = tree_flatten(params)
    for index, leaf in enumerate(leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            problem = f"expected a torch.Tensor or None, got {type(leaf).__name__}"
        elif leaf.dtype not in _OPTIMIZABLE:
            problem = f"dtype {leaf.dtype} cannot be optimized; params must be floating-point or complex"
        else:
            continue
        raise TypeError(f"{what} leaf at {path_str(spec.paths()[index])}: {problem}")
    return leaves


def match_params(
    updates: PyTree, params: PyTree, *, sparse: bool = False
) -> tuple[PyTree, list[Any], optree.PyTreeSpec]:
    """``updates`` checked against ``params`` (``check_leaves``, sparse COO updates taken with ``sparse``), laid out as
    ``params`` (when they differ only in their kinds of mapping), each floating-point update cast to its param's dtype
    where that is wider: the step is computed in at least the param's precision, as torch.optim computes in the
    param's dtype. Returns that tree, its leaves and its spec."""
    leaves, param_leaves, spec, reordered = _checked(updates, params, "updates", "params", sparse)
    cast = [
        u
        if u is None or u.dtype is p.dtype or not (u.is_floating_point() and p.is_floating_point())
        else u.to(torch.promote_types(u.dtype, p.dtype))
        for u, p in zip(leaves, param_leaves)
    ]
    if not reordered and all(new is old for new, old in zip(cast, leaves)):
        return updates, leaves, spec
    return spec.unflatten(cast), cast, spec
