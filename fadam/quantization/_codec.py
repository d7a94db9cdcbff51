"""Blockwise quantization of one tensor: ``quantize_blockwise`` and ``dequantize_blockwise``.

A tensor is flattened and cut into blocks of ``block_size`` elements (the last one zero-padded). Each block keeps its
largest finite magnitude ``absmax`` in float32; each element keeps the code of the map entry nearest to
``x / absmax``: one byte at 8 bits, two codes per byte at 4 bits (low nibble first). Which map decodes the codes is a
0-d uint8 ``map_id`` computed on the tensor's device from the values themselves (no host sync): a tensor with no
negative entry uses the non-negative map (twice the resolution at 8 bits; the zero-free linear map at 4 bits, for
second moments), any other tensor the signed dynamic map. Everything is plain tensor ops on the logical tensor, so
under ``torch.func.vmap`` each stacked member gets its own blocks and its own map.

Non-finite entries never set a block's scale: ``absmax`` is taken over finite entries, ``+-inf`` is stored as
``+-absmax`` and ``nan`` as 0 (no map has a code for them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fadam.quantization._maps import MAP_IDS, code_maps, encode_tables

__all__ = ["QuantizedArray", "dequantize_blockwise", "quantize_blockwise", "quantized_nbytes"]


class QuantizedArray(NamedTuple):
    """A blockwise-quantized tensor; its shape is its param's (known to whoever holds both)."""

    codes: torch.Tensor  # uint8: n codes (8-bit) or ceil(n / 2) bytes of two codes (4-bit)
    absmax: torch.Tensor  # float32, one per block of block_size elements
    map_id: torch.Tensor  # 0-d uint8: row of fadam.quantization._maps.code_maps()


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    n = flat.shape[-1]
    padded = -(-n // block_size) * block_size
    if padded != n:
        flat = F.pad(flat, (0, padded - n))
    return flat.reshape(padded // block_size, block_size)


def encode(y: torch.Tensor, map_id: torch.Tensor) -> torch.Tensor:
    """Nearest codes (int64) of finite ``y`` in [-1, 1] under map ``map_id``, by two table reads (see ``_maps``)."""
    tables, thresholds = encode_tables(y.device)
    top = (y.view(torch.int32) >> 16) & 0xFFFF
    row = map_id.to(torch.int64)
    guess = tables.view(-1)[row * 65536 + top.to(torch.int64)].to(torch.int64)
    return guess + (y > thresholds.view(-1)[row * 256 + guess]).to(torch.int64)


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> QuantizedArray:
    """Quantizes ``x`` (any floating dtype, any shape) blockwise to ``bits`` per element.

    Example:
        >>> import torch
        >>> from fadam.quantization import dequantize_blockwise, quantize_blockwise
        >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0])  # 0.5 is not a code of the signed map: nearest is 0.4938
        >>> q = quantize_blockwise(x, bits=8, block_size=2)
        >>> q.codes.dtype, q.absmax.tolist()
        (torch.uint8, [1.0, 0.25])
        >>> dequantize_blockwise(q, x.shape, bits=8, block_size=2)
        tensor([ 0.4938, -1.0000,  0.2500,  0.0000])
    """
    _check_bits(bits)
    n = x.numel()
    blocks = _blocks(x.reshape(-1).to(torch.float32), block_size)
    finite = torch.isfinite(blocks)
    absmax = torch.where(finite, blocks.abs(), 0.0).amax(dim=-1)
    negative = (blocks < 0).any()
    if bits == 8:
        map_id = torch.where(negative, MAP_IDS["dynamic8_signed"], MAP_IDS["dynamic8_unsigned"])
    else:
        map_id = torch.where(negative, MAP_IDS["dynamic4_signed"], MAP_IDS["linear4_nonzero"])
    map_id = map_id.to(torch.uint8)
    scale = torch.where(absmax > 0, absmax, 1.0).unsqueeze(-1)
    y = torch.nan_to_num(blocks / scale, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1.0, 1.0)
    codes = encode(y, map_id).reshape(-1)
    if bits == 8:
        return QuantizedArray(codes[:n].to(torch.uint8), absmax, map_id)
    pairs = codes[: 2 * (-(-n // 2))].reshape(-1, 2)
    return QuantizedArray((pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8), absmax, map_id)


def dequantize_blockwise(
    q: QuantizedArray, shape: torch.Size | tuple[int, ...], bits: int = 8, block_size: int = 256
) -> torch.Tensor:
    """The float32 tensor of ``shape`` that ``q`` encodes."""
    _check_bits(bits)
    n = 1
    for size in shape:
        n *= size
    codes = q.codes.to(torch.int64)
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(-1)[:n]
    values = code_maps(codes.device).view(-1)[q.map_id.to(torch.int64) * 256 + codes]
    return (_blocks(values, block_size) * q.absmax.unsqueeze(-1)).reshape(-1)[:n].reshape(shape)


def expected_sizes(n: int, bits: int, block_size: int) -> tuple[int, int]:
    """``(codes, absmax)`` lengths for a tensor of ``n`` elements."""
    return (n if bits == 8 else -(-n // 2)), -(-n // block_size)


def quantized_nbytes(q: QuantizedArray) -> int:
    return sum(t.numel() * t.element_size() for t in q)
