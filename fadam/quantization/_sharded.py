"""Quantized state of DTensor params (FSDP2): each rank quantizes its own shard.

Layout of a ``QuantizedArray`` for a DTensor state leaf ``x``:

- ``codes``: a uint8 DTensor with ``x``'s global shape, mesh and placements: one code per element, so the codes are
  sharded exactly like the param and every rank holds the codes of its local shard. At 4 bits too: a byte holds one
  4-bit code (its high nibble is 0), since two codes packed per byte cannot be sharded like the param; so 4-bit state
  of sharded params costs about 1 byte per element, as 8-bit (its codes are packed for decoding, shard-locally);
- ``absmax``: a plain float32 tensor, one scale per block of ``block_size`` elements of the *flattened local shard*
  (the last block of a shard may be short); it differs from rank to rank;
- ``map_id``: a plain 0-d uint8, the map chosen from the local shard's values (no collective); it also tells the bits
  (``sharded_bits``);
- ``like``: a plain empty tensor of shape ``(*x.shape, 0)``, ``x``'s global shape (as the codes').

So quantizing never communicates, and the full-precision/quantized choice is made on the DTensor's global size. A shard
has the same blocks as one process when the param is sharded along dim 0 and every shard starts at a multiple of
``block_size`` elements (e.g. ``fully_shard`` of an ``(80, 64)`` weight on 2 ranks with blocks of 256): then training
is identical to one process. Otherwise the blocks straddle other elements and results differ by the quantization
error.

``absmax`` is tied to the shard layout, so it cannot be saved as is with ``torch.distributed.checkpoint``:
``fadam.state_to_dict`` stores such a leaf dequantized, as a float32 DTensor sharded like the param (4 bytes per
element instead of 1, in exchange for resharding like any other state), and ``fadam.state_from_dict`` requantizes
it into the template's layout. The checkpoint recovers ``block_size`` from a shard's size and block count, which is
unambiguous for a power of two; other block sizes are refused on DTensor params.
"""

from __future__ import annotations

from typing import Any

import torch

from fadam._dispatch import is_dtensor
from fadam.quantization._codec import QuantizedArray, dequantize_blockwise, quantize_blockwise, shape_like, unpack_codes
from fadam.quantization._maps import MAP_IDS

__all__ = [
    "check_sharded_args",
    "dequantize_sharded",
    "is_sharded",
    "quantize_sharded",
    "sharded_bits",
    "sharded_block_size",
]

_FOUR_BIT_MAPS = (MAP_IDS["dynamic4_signed"], MAP_IDS["linear4_nonzero"])


def is_sharded(node: Any) -> bool:
    """A ``QuantizedArray`` of a DTensor state leaf (its codes are a DTensor)."""
    return isinstance(node, QuantizedArray) and is_dtensor(node.codes)


def check_sharded_args(bits: int, block_size: int, where: str) -> None:
    if block_size & (block_size - 1):
        raise ValueError(
            f"{where}: block_size must be a power of two on DTensor params (checkpoints recover it), got {block_size}"
        )


def _wrap(local: torch.Tensor, like: Any) -> Any:
    """``local`` as the DTensor shard of a tensor shaped and placed like the DTensor ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def quantize_sharded(x: Any, bits: int, block_size: int, map_id: torch.Tensor | None = None) -> QuantizedArray:
    """Quantizes each rank's shard of the DTensor ``x`` (see the module docstring for the layout), with the map
    ``map_id`` forces or, by default, the one its local values call for."""
    local = x.to_local()
    q = quantize_blockwise(local, bits, block_size, map_id=map_id)
    codes = q.codes
    if bits == 4:  # one code per byte, so that the codes shard like the param
        codes = unpack_codes(codes, 4)[: local.numel()].to(torch.uint8)
    return q._replace(codes=_wrap(codes.reshape(local.shape), x), like=shape_like(x.shape, local.device))


def dequantize_sharded(q: QuantizedArray, bits: int, block_size: int) -> Any:
    """The float32 DTensor, shaped and placed like ``q.codes``, that ``q`` encodes."""
    codes = q.codes.to_local()
    flat = codes.reshape(-1)
    if bits == 4:  # repack the local codes two per byte (low nibble first) for the decoder
        flat = torch.nn.functional.pad(flat, (0, flat.numel() % 2))
        flat = flat[0::2] | (flat[1::2] << 4)
    local_q = QuantizedArray(flat, q.absmax, q.map_id, shape_like(codes.shape, codes.device))
    local = dequantize_blockwise(local_q, bits=bits, block_size=block_size)
    return _wrap(local, q.codes)


def sharded_bits(q: QuantizedArray) -> int:
    """4 or 8: the bits of a sharded ``q``, read from its map (a host sync where ``map_id`` lives on a device)."""
    return 4 if int(q.map_id) in _FOUR_BIT_MAPS else 8


def sharded_block_size(q: QuantizedArray) -> int:
    """The (power of two) block size of a sharded ``q``, from its local element and block counts."""
    n, blocks = q.codes.to_local().numel(), q.absmax.numel()
    if blocks <= 1:  # one block (or none): any block size >= n splits the shard the same way
        return max(2, 1 << max(n - 1, 0).bit_length())
    size = 1 << (-(-n // blocks) - 1).bit_length()
    if -(-n // size) != blocks:
        raise ValueError(f"sharded quantized state has {n} elements in {blocks} blocks: no power-of-two block size")
    return size
