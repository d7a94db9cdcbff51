"""Quantized state as its full-precision values, and back: what converting state to and from other libraries needs
(``fadam.state_from_torch`` / ``fadam.state_to_torch``).

A ``QuantizedArray`` does not record its block size. Going in, ``full_precision`` reads it, with each slot's map,
from the ``quantize_state`` storage of the transform's declared program (exact). Going out, ``dequantized`` has the
state alone: its bits follow from its map, and its block size is the default for those bits (256 at 8 bits, 128 at 4
bits), or else the one power of two, that gives as many blocks as it has scales and for which every block with a
nonzero scale holds a code of magnitude 1 (each block's largest entry is encoded as 1); one it cannot tell is refused.
A block size that is not a power of two passes for the default only where the sizes agree and every block of the
default's holds a code of 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fadam._base import GradientTransformation
from fadam._dispatch import is_dtensor
from fadam._program import program_of, state_at, with_state_at
from fadam._tree import PyTree, path_str
from fadam.quantization._codec import (
    QuantizedArray,
    _blocks,
    dequantize_blockwise,
    quantize_blockwise,
    slot_map,
    unpack_codes,
)
from fadam.quantization._maps import code_maps
from fadam.quantization._sharded import _FOUR_BIT_MAPS
from fadam.quantization._wrapper import DEFAULT_BLOCK_SIZE

__all__ = ["dequantized", "full_precision"]


def _is_quantized(node: Any) -> bool:
    return isinstance(node, QuantizedArray)


def _map_quantized(tree: PyTree, fn: Callable[[QuantizedArray, str], Any], root: str = "state") -> PyTree:
    """``tree`` with each ``QuantizedArray`` replaced by ``fn(it, its path)``, paths spelled from ``root``."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, is_leaf=_is_quantized, none_is_leaf=True)
    return spec.unflatten(
        [fn(leaf, accessor.codify(root)) if _is_quantized(leaf) else leaf for accessor, leaf in zip(accessors, leaves)]
    )


def _refuse_sharded(q: QuantizedArray, where: str) -> None:
    if is_dtensor(q.codes):
        raise ValueError(f"{where}: quantized state of a DTensor param does not convert; gather the params first")


def full_precision(tx: GradientTransformation, state: PyTree) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """``state``, a state of ``tx``, with each ``QuantizedArray`` replaced by a float32 tensor of its values, and the
    function that quantizes a state of that layout back as ``tx`` keeps it (its bits, block size and each slot's map).

    Raises for quantized state outside a declared ``quantize_state`` stage (an opaque inner transform), whose block
    size is not known.

    Example:
        >>> import torch, fadam
        >>> from fadam.quantization._full_precision import full_precision
        >>> tx = fadam.adam8bit(min_size=4)
        >>> plain, quantized = full_precision(tx, tx.init([torch.zeros(4)]))
        >>> plain[0].inner_state.mu[0]
        tensor([0., 0., 0., 0.])
        >>> type(quantized(plain)[0].inner_state.mu[0]).__name__
        'QuantizedArray'
    """
    fields = []  # (path of a slot's tree, bits, block size, map)
    for stage in program_of(tx).expanded(state)[0].stages:
        if stage.storage is None or stage.decl is None:
            continue
        for slot in stage.decl.slots:
            map_id = slot_map(slot.nonnegative, stage.storage.bits)
            fields.append(((*stage.path, slot.name), stage.storage.bits, stage.storage.block, map_id))

    def values(q: QuantizedArray, where: str, bits: int, block: int) -> torch.Tensor:
        _refuse_sharded(q, where)
        return dequantize_blockwise(q, bits=bits, block_size=block)

    plain = state
    for path, bits, block, _ in fields:
        root = f"state{path_str(path)}"
        tree = _map_quantized(state_at(plain, path), functools.partial(values, bits=bits, block=block), root)
        plain = with_state_at(plain, path, tree)

    def refuse(q: QuantizedArray, where: str) -> None:
        raise ValueError(
            f"{where} is quantized by a transform that declares no storage (quantize_state around an opaque "
            "transform): its block size is not known, so it does not convert"
        )

    _map_quantized(plain, refuse)
    originals = {path: state_at(state, path) for path, *_ in fields}

    def quantized(new: PyTree) -> PyTree:
        for path, bits, block, map_id in fields:
            old = optree.tree_leaves(originals[path], is_leaf=_is_quantized, none_is_leaf=True)
            leaves, spec = optree.tree_flatten(state_at(new, path), is_leaf=_is_quantized, none_is_leaf=True)
            requantized = [
                quantize_blockwise(
                    leaf, bits, block, map_id=torch.tensor(map_id, dtype=torch.uint8, device=o.map_id.device)
                )
                if _is_quantized(o)
                else leaf
                for leaf, o in zip(leaves, old)
            ]
            new = with_state_at(new, path, spec.unflatten(requantized))
        return new

    return plain, quantized


def _bits(q: QuantizedArray) -> int:
    return 4 if int(q.map_id) in _FOUR_BIT_MAPS else 8


def _holds_each_block_max(q: QuantizedArray, bits: int, block: int) -> bool:
    """Whether, cut into blocks of ``block``, every block of ``q`` with a nonzero scale holds a code of magnitude 1."""
    n = q.shape.numel()
    codes = unpack_codes(q.codes.reshape(-1), bits)[:n]
    top = code_maps(codes.device)[int(q.map_id)][codes].abs() == 1
    found = _blocks(top.to(torch.uint8), block).amax(dim=-1).bool()
    return bool((found | (q.absmax == 0)).all())


def _block_size(q: QuantizedArray, bits: int, where: str) -> int:
    """The block size ``q`` was quantized with (see the module docstring)."""
    n, blocks = q.shape.numel(), q.absmax.numel()
    default = DEFAULT_BLOCK_SIZE[bits]
    if blocks <= 1:  # one block: every block size of at least n cuts it the same way
        return max(default, n + n % 2)
    powers = [1 << k for k in range(1, max(n, 2).bit_length() + 1) if 1 << k != default]
    for block in (default, *powers):
        if -(-n // block) == blocks and _holds_each_block_max(q, bits, block):
            return block
    raise ValueError(f"{where}: cannot tell the block size of quantized state of {n} elements in {blocks} blocks")


def dequantized(state: PyTree) -> PyTree:
    """``state`` with each ``QuantizedArray`` replaced by a float32 tensor of its values (its block size read as the
    module docstring says).

    Example:
        >>> import torch, fadam
        >>> from fadam.quantization import quantize_blockwise
        >>> from fadam.quantization._full_precision import dequantized
        >>> dequantized({"mu": quantize_blockwise(torch.tensor([0.5, -1.0]))})["mu"]
        tensor([ 0.5015, -1.0000])
    """

    def values(q: QuantizedArray, where: str) -> torch.Tensor:
        _refuse_sharded(q, where)
        bits = _bits(q)
        return dequantize_blockwise(q, bits=bits, block_size=_block_size(q, bits, where))

    return _map_quantized(state, values)
