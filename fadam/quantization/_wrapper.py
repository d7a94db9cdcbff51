"""``quantize_state``: keep any transform's large floating-point state blockwise-quantized between steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from fadam._base import GradientTransformation
from fadam._dispatch import is_dtensor
from fadam._program import Program, Storage, program_of, state_at, with_program
from fadam._tree import PyTree, path_str
from fadam.combinators._masking import MaskedNode, _full_tree
from fadam.quantization._codec import (
    QuantizedArray,
    dequantize_blockwise,
    expected_sizes,
    quantize_blockwise,
    slot_map,
)
from fadam.quantization._sharded import check_sharded_args, dequantize_sharded, quantize_sharded
from fadam.transforms._validation import check_state

__all__ = ["QuantizedState", "quantize_state"]

DEFAULT_BLOCK_SIZE = {8: 256, 4: 128}


class QuantizedState(NamedTuple):
    inner_state: PyTree  # the inner transform's state with its large moments replaced by QuantizedArray nodes


def _is_atom(node: Any) -> bool:
    return isinstance(node, (QuantizedArray, MaskedNode))


def _flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    return optree.tree_flatten(tree, is_leaf=_is_atom, none_is_leaf=True)


def _param_positions(state: PyTree, params_spec: optree.PyTreeSpec) -> list[int | None]:
    """For each leaf of ``state`` (as ``_flatten`` lists them), the index of the param leaf it stands for, or None.

    A state subtree corresponds to the params when it has their exact structure (``mu`` and ``nu`` of Adam, the trace
    of momentum, the inner states of ``masked`` with their ``MaskedNode`` holes): this is structural, so it works for
    any transform whose per-param state is shaped like the params, and never looks at field names.
    """

    def structure(node: Any) -> optree.PyTreeSpec:
        return optree.tree_structure(node, is_leaf=_is_atom, none_is_leaf=True)

    groups = optree.tree_leaves(
        state, is_leaf=lambda node: _is_atom(node) or structure(node) == params_spec, none_is_leaf=True
    )
    positions: list[int | None] = []
    for group in groups:
        spec = structure(group)
        positions.extend(range(spec.num_leaves) if spec == params_spec else [None] * spec.num_leaves)
    return positions


def _mask_leaves(mask: PyTree | Callable[[PyTree], PyTree], params: PyTree) -> list[Any]:
    """``mask`` broadcast to one bool per leaf of ``_flatten(params)`` (a ``MaskedNode`` hole counts as a leaf)."""
    flags = _full_tree(mask, params, "mask", is_leaf=_is_atom)
    for flag, path in zip(flags, _flatten(params)[1].paths()):
        if not isinstance(flag, bool):
            raise TypeError(f"mask leaf for {path_str(path)} is {flag!r}; expected a bool")
    return flags


# State the wrapper keeps unquantized (small or masked params) in these dtypes is stored in float32 instead, as
# bitsandbytes and torchao keep small tensors' state
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def quantize_state(
    inner: GradientTransformation,
    bits: int = 8,
    block_size: int | None = None,
    min_size: int = 4096,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> GradientTransformation:
    r"""Stores the inner transform's large floating-point state blockwise-quantized to 8 or 4 bits.

    .. math::
        (u_t, s_t) = \mathrm{inner.update}(g_t, \mathrm{deq}(\hat s_{t-1})),\qquad \hat s_t = \mathrm{quant}(s_t)

    ``update`` dequantizes the state to float32, runs the inner update in full precision and requantizes the new state
    with each block's new absmax; the returned updates are the inner transform's, computed from the dequantized state.
    A state leaf is quantized when it sits in a subtree shaped like the params (Adam's ``mu``/``nu``, a momentum
    trace), is floating point (not complex), has its param's shape, and its param has at least ``min_size`` elements
    (the global count for a DTensor, so sharding never changes the choice) and is selected by ``mask``. Such a leaf of
    a smaller or unselected param stays unquantized, in float32 if it was bfloat16 or float16 (full precision, as the
    quantized leaves' dequantized state and as bitsandbytes and torchao keep small tensors' state); counts and
    everything else stay as they are. On DTensor params (FSDP2) each rank quantizes its own shard with
    no communication: codes are a uint8 DTensor sharded like the param, scales are per block of the local shard
    (a power-of-two ``block_size`` only; 4-bit codes are kept one per byte there, about 1 byte per element; see
    ``fadam.quantization._sharded`` for the layout, when it matches one process exactly, and how checkpoints reshard
    it).

    The map of each leaf is chosen on device at every requantization, with no host sync: a leaf with no negative entry
    (Adam's ``nu``, AMSGrad's ``nu_max``) gets the unsigned dynamic map at 8 bits (twice the resolution) or the
    zero-free linear map at 4 bits; any other the signed dynamic map (Dettmers et al., 2022; Li et al., 2023). A
    ``None`` update leaves its quantized state untouched, as the inner transform leaves its state.

    Non-finite state is kept as fp32 keeps it where it can be. The update of a step is the inner transform's, computed
    before requantization, so it holds whatever infinities and NaNs the inner transform's does. An infinity in the
    state is stored as an infinity (its block flags it; see ``fadam.quantization._codec``) and the block's finite
    entries keep their values up to the quantization error: a gradient large enough for Adam's ``nu`` to overflow
    (about 6e20 with the default betas) leaves ``nu`` infinite there and its updates 0, as fp32 Adam's, on every later
    step too, so params stay finite where fp32 Adam's do. A NaN is stored as 0 (no map has a code for it) and never
    sets a scale: a NaN gradient makes that step's update, and so the param, NaN exactly where fp32 Adam's are, but
    the element's later updates come from a state that no longer holds the NaN.

    Each quantized leaf records the shape it was made for (``QuantizedArray.shape``): an update, or a checkpoint
    loaded by ``fadam.state_from_dict``, of any other shape is refused with an error naming the leaf, before anything
    changes, even where the element count is the same.

    Args:
        inner: the transform whose state to quantize.
        bits: 8 or 4.
        block_size: elements per block sharing one float32 absmax (default 256 at 8 bits, 128 at 4 bits).
        min_size: params with fewer elements keep full-precision state.
        mask: a tree of bools shaped like the params (or a prefix, or a callable of the params): False keeps that
            param's state in full precision.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.quantize_state(fadam.scale_by_adam(), bits=8, min_size=16)
        >>> params = {"w": torch.zeros(64), "b": torch.zeros(4)}
        >>> state = tx.init(params)
        >>> type(state.inner_state.mu["w"]).__name__, type(state.inner_state.mu["b"]).__name__
        ('QuantizedArray', 'Tensor')
        >>> updates, state = tx.update({"w": torch.ones(64), "b": torch.ones(4)}, state)
        >>> updates["w"][:2]
        tensor([1.0000, 1.0000])

    References:
        Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022.
        Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023.
    """
    if bits not in DEFAULT_BLOCK_SIZE:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    block = DEFAULT_BLOCK_SIZE[bits] if block_size is None else block_size
    if not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"block_size must be an even int >= 2, got {block_size!r}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")

    def init(params: PyTree) -> QuantizedState:
        inner_state = inner.init(params)
        param_leaves, params_spec = _flatten(params)
        selected = [True] * len(param_leaves) if mask is None else _mask_leaves(mask, params)
        leaves, spec = _flatten(inner_state)
        new_leaves = []
        for path, leaf, position in zip(spec.paths(), leaves, _param_positions(inner_state, params_spec)):
            param = None if position is None else param_leaves[position]
            param_shaped = (
                isinstance(leaf, torch.Tensor)
                and isinstance(param, torch.Tensor)
                and leaf.is_floating_point()
                and leaf.shape == param.shape
            )
            if param_shaped and param.numel() >= min_size and selected[position]:
                if is_dtensor(leaf):
                    check_sharded_args(bits, block, f"quantized state at {path_str(path)}")
                    leaf = quantize_sharded(leaf, bits, block)
                else:
                    leaf = quantize_blockwise(leaf, bits, block)
            elif param_shaped and leaf.dtype in _HALF_DTYPES:
                leaf = leaf.float()  # full precision, as the quantized leaves' dequantized state
            new_leaves.append(leaf)
        return QuantizedState(spec.unflatten(new_leaves))

    def update(
        updates: PyTree, state: QuantizedState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, QuantizedState]:
        check_state(state, QuantizedState, "quantize_state")
        if declared:
            from fadam._execute import run_update  # the executor builds on the quantization package

            compiled = run_update(program, updates, state, params)
            if compiled is not None:
                return compiled
        update_leaves, updates_spec = _flatten(updates)
        leaves, spec = _flatten(state.inner_state)
        paths = spec.paths()
        full, passed = list(leaves), {}
        for index, (leaf, position) in enumerate(zip(leaves, _param_positions(state.inner_state, updates_spec))):
            if not isinstance(leaf, QuantizedArray):
                continue
            if position is None:
                raise ValueError(f"quantized state at {path_str(paths[index])} has no matching leaf in the updates")
            g = update_leaves[position]
            if g is None:  # skipped param: the inner transform leaves this state as it is; a placeholder stands in
                full[index] = passed[index] = torch.empty(0)
                continue
            if not isinstance(g, torch.Tensor):
                raise ValueError(f"updates leaf for state {path_str(paths[index])}: expected a tensor, got {g!r}")
            if g.shape != leaf.shape:
                raise ValueError(
                    f"quantized state at {path_str(paths[index])}: update shape {tuple(g.shape)} does not match "
                    f"expected {tuple(leaf.shape)}"
                )
            if is_dtensor(leaf.codes):
                _check_sharded(leaf, g, block, path_str(paths[index]))
                full[index] = passed[index] = dequantize_sharded(leaf, bits, block)
                continue
            if is_dtensor(g):
                raise ValueError(
                    f"quantized state at {path_str(paths[index])} was made for a plain param, but its update is a "
                    f"DTensor {tuple(g.shape)} {g.placements}"
                )
            sizes = (leaf.codes.shape[-1], leaf.absmax.shape[-1]) if leaf.codes.dim() else (-1, -1)
            if sizes != expected_sizes(g.numel(), bits, block):
                raise ValueError(
                    f"quantized state at {path_str(paths[index])} holds {sizes[0]} codes and {sizes[1]} blocks, but "
                    f"its update has shape {tuple(g.shape)} (expected {expected_sizes(g.numel(), bits, block)})"
                )
            full[index] = passed[index] = dequantize_blockwise(leaf, bits=bits, block_size=block)
        maps = declared_maps(state.inner_state)
        new_updates, new_inner = inner.update(updates, spec.unflatten(full), params, **extra_args)
        new_leaves, new_spec = _flatten(new_inner)
        if new_spec != spec:
            raise ValueError("the inner transform changed the structure of its state; it cannot be quantized")
        for index, old in passed.items():
            # A leaf returned untouched keeps its codes exactly (no needless requantization).
            new = new_leaves[index]
            if new is old:
                new_leaves[index] = leaves[index]
                continue
            map_id = next((m for prefix, m in maps if paths[index][: len(prefix)] == prefix), None)
            if map_id is not None:
                map_id = torch.full((), map_id, dtype=torch.uint8, device=leaves[index].map_id.device)
            if is_dtensor(new):
                new_leaves[index] = quantize_sharded(new, bits, block, map_id)
            else:
                new_leaves[index] = quantize_blockwise(new, bits, block, map_id=map_id)
        return new_updates, QuantizedState(new_spec.unflatten(new_leaves))

    inner_program = program_of(inner)
    declared = all(stage.decl is not None or stage.expand is not None for stage in inner_program.stages)
    program = inner_program.stored(Storage(bits, block), "inner_state") if declared else Program(())

    def declared_maps(inner_state: PyTree) -> list[tuple[tuple, int]]:
        """The map of each declared slot's quantized leaves, as ``(path prefix, map)`` in ``_flatten``'s paths: the
        slot's (``slot_map``), as the generated kernel writes it; other quantized leaves take the map their values
        call for."""
        if not declared:
            return []
        stages, expanded_state = inner_program.expanded(inner_state)
        found = []
        for stage in stages.stages:
            stage_state = state_at(expanded_state, stage.path)
            prefix = _index_path(expanded_state, stage.path)
            for slot in stage.decl.slots:
                found.append(((*prefix, stage_state._fields.index(slot.name)), slot_map(slot.nonnegative, bits)))
        return found

    return with_program(init, update, program)


def _index_path(state: Any, path: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``path`` (``Stage.path``: named tuples' fields by name) as optree's paths spell it (fields by position)."""
    spelled = []
    for key in path:
        spelled.append(state._fields.index(key) if isinstance(key, str) and hasattr(state, "_fields") else key)
        state = state_at(state, (key,))
    return tuple(spelled)


def _check_sharded(leaf: QuantizedArray, g: Any, block: int, where: str) -> None:
    """The update of a sharded quantized leaf is a DTensor laid out like its codes, with a block per scale."""
    codes = leaf.codes
    if not is_dtensor(g) or g.shape != codes.shape or g.placements != codes.placements:
        layout = f"DTensor {tuple(g.shape)} {g.placements}" if is_dtensor(g) else f"plain tensor {tuple(g.shape)}"
        raise ValueError(
            f"quantized state at {where} is sharded as DTensor {tuple(codes.shape)} {codes.placements}, but its "
            f"update is a {layout}"
        )
    local = codes.to_local().numel()
    if leaf.absmax.shape != (-(-local // block),):
        raise ValueError(
            f"quantized state at {where} holds {leaf.absmax.numel()} scales for a local shard of {local} elements "
            f"(expected {-(-local // block)} blocks of {block})"
        )
