"""Optimizer state as plain nested dicts, for ``torch.save``/``torch.load(weights_only=True)`` and
``torch.distributed.checkpoint``.

fadam state is made of NamedTuples, tuples and dicts. ``torch.load(weights_only=True)`` refuses NamedTuple classes, and
``torch.distributed.checkpoint`` traverses only dicts and lists (a DTensor inside a tuple is pickled and comes back
wrong without an error), so checkpoints hold the state as nested dicts keyed by each node's field name, index or
key, and are rebuilt against a freshly initialised state that fixes the structure.

Quantized state (``QuantizedArray``) is stored as its tensors, ``like`` included: an empty tensor whose shape records
the shape the codes stand for, so that loading refuses state made for another shape even where the element counts
agree (a checkpoint that lacks it is checked by the sizes of its codes and scales only).
Quantized state of DTensor params (``fadam.quantization._sharded``) has per-block scales tied to one shard layout; it
is stored dequantized, as a float32 DTensor sharded like its param under the key ``"values"``, so that it reshards
like any other state, and it is requantized into the template's layout on load.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fadam._dispatch import is_dtensor
from fadam._tree import PyTree, path_str
from fadam.quantization._codec import QuantizedArray
from fadam.quantization._sharded import (
    dequantize_sharded,
    is_sharded,
    quantize_sharded,
    sharded_bits,
    sharded_block_size,
)

__all__ = ["state_from_dict", "state_to_dict"]


def _leaves_with_paths(tree: PyTree) -> tuple[list[tuple[Any, ...]], list[Any], optree.PyTreeSpec, list[bool]]:
    """Leaves with their paths, NamedTuple fields named (``("0", "mu", "w")``) rather than numbered, and for each
    whether it is the ``like`` of a quantized leaf."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, is_leaf=is_sharded, none_is_leaf=True)
    paths = [tuple(getattr(entry, "field", entry.entry) for entry in accessor) for accessor in accessors]
    # a sharded quantized leaf is one entry, its dequantized values
    paths = [(*path, "values") if is_sharded(leaf) else path for path, leaf in zip(paths, leaves)]
    likes = [
        bool(accessor) and accessor[-1].type is QuantizedArray and getattr(accessor[-1], "field", None) == "like"
        for accessor in accessors
    ]
    return paths, leaves, spec, likes


def state_to_dict(state: PyTree) -> dict[str, Any]:
    """Converts a state into nested dicts of its leaves, keyed by ``str`` of each path entry.

    NamedTuple fields become their names, tuple and list positions ``"0"``, ``"1"``, ...; empty nodes (``EmptyState``,
    masked-out leaves) hold nothing and are rebuilt from the template by ``state_from_dict``. Leaves are not copied,
    except quantized state of DTensor params, stored dequantized (float32, sharded like the param) so that it reshards.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adam()
        >>> d = fadam.state_to_dict(tx.init({"w": torch.zeros(2)}))
        >>> sorted(d["0"]), d["0"]["mu"]["w"]
        (['count', 'mu', 'nu'], tensor([0., 0.]))
    """
    paths, leaves, _, _ = _leaves_with_paths(state)
    out: dict[str, Any] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if not path:
            raise ValueError("state_to_dict needs a container state, got a single leaf")
        node = out
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
            if not isinstance(node, dict):
                raise ValueError(f"state path {path_str(path)} collides with another leaf after converting keys to str")
        if str(path[-1]) in node:
            raise ValueError(f"state path {path_str(path)} collides with another entry after converting keys to str")
        node[str(path[-1])] = (
            dequantize_sharded(leaf, sharded_bits(leaf), sharded_block_size(leaf)) if is_sharded(leaf) else leaf
        )
    return out


def _count_leaves(node: Any) -> list[tuple[str, ...]]:
    if isinstance(node, dict):
        return [(key, *rest) for key, value in node.items() for rest in _count_leaves(value)]
    return [()]


def state_from_dict(like: PyTree, d: dict[str, Any]) -> PyTree:
    """Rebuilds a state shaped like ``like`` from ``state_to_dict`` output, checking every path, shape and dtype.

    Raises ``ValueError`` naming the first path that is missing, extra, or of another shape or dtype (for quantized
    state, the shape its codes stand for); nothing is returned half-built. Loaded tensors are moved to the device of
    the matching template leaf (DTensors are kept as loaded, with their placements).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adam()
        >>> state = tx.init({"w": torch.ones(2)})
        >>> restored = fadam.state_from_dict(state, fadam.state_to_dict(state))
        >>> torch.equal(restored[0].nu["w"], state[0].nu["w"])
        True
    """
    paths, like_leaves, spec, likes = _leaves_with_paths(like)
    values = []
    for path, like_leaf, is_like in zip(paths, like_leaves, likes, strict=True):
        node: Any = d
        for depth, key in enumerate(path):
            if is_like and depth == len(path) - 1 and isinstance(node, dict) and str(key) not in node:
                node = like_leaf  # a checkpoint that records no shape: its codes and absmax were checked by size
                break
            if not isinstance(node, dict) or str(key) not in node:
                raise ValueError(f"checkpoint is missing state path {path_str(path[: depth + 1])}")
            node = node[str(key)]
        if is_sharded(like_leaf):
            values.append(_requantized(path, node, like_leaf))
        elif is_like:
            values.append(_checked_shape(path, node, like_leaf))
        else:
            values.append(_checked_leaf(path, node, like_leaf))
    expected = {tuple(str(key) for key in path) for path in paths}
    for found in _count_leaves(d):
        if found not in expected:
            raise ValueError(f"checkpoint has state path {path_str(found)} that this optimizer does not have")
    return spec.unflatten(values)


def _requantized(path: tuple[Any, ...], value: Any, like: Any) -> Any:
    """Dequantized values of a sharded quantized leaf, quantized again in the layout of ``like`` (its template)."""
    codes = like.codes
    if not isinstance(value, torch.Tensor) or value.shape != codes.shape or value.dtype != torch.float32:
        found = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"state path {path_str(path)}: expected float32 values of shape {tuple(codes.shape)}, got {found}"
        )
    if not is_dtensor(value):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(codes.device), codes.device_mesh, codes.placements)
    elif (value.device_mesh, value.placements) != (codes.device_mesh, codes.placements):
        value = value.redistribute(codes.device_mesh, codes.placements)
    return quantize_sharded(value, sharded_bits(like), sharded_block_size(like))


def _checked_shape(path: tuple[Any, ...], value: Any, like: torch.Tensor) -> torch.Tensor:
    """The template's ``like`` of a quantized leaf, once the checkpoint's (``value``) records the same shape."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[-1] != 0:
        found = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"state path {path_str(path)}: expected an empty tensor of shape (*shape, 0), got {found}")
    if value.shape != like.shape:
        raise ValueError(
            f"state path {path_str(path[:-1])}: quantized state of shape {tuple(value.shape[:-1])} does not match "
            f"the optimizer's {tuple(like.shape[:-1])}"
        )
    return like


def _checked_leaf(path: tuple[Any, ...], value: Any, like: Any) -> Any:
    if not isinstance(like, torch.Tensor):
        if isinstance(value, torch.Tensor) or type(value) is not type(like):
            raise ValueError(f"state path {path_str(path)}: expected {type(like).__name__}, got {type(value).__name__}")
        return value
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"state path {path_str(path)}: expected a tensor, got {type(value).__name__}")
    if value.is_meta and not like.is_meta:
        raise ValueError(
            f"state path {path_str(path)}: the checkpoint holds a meta tensor, which has no values (it was saved from "
            "a state made on the meta device)"
        )
    if value.shape != like.shape:
        raise ValueError(
            f"state path {path_str(path)}: shape {tuple(value.shape)} does not match the optimizer's "
            f"{tuple(like.shape)}"
        )
    if value.dtype != like.dtype:
        raise ValueError(
            f"state path {path_str(path)}: dtype {value.dtype} does not match the optimizer's {like.dtype}"
        )
    if type(value) is torch.Tensor and type(like) is torch.Tensor and value.device != like.device:
        return value.to(like.device)
    return value
