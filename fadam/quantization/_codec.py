"""Blockwise quantization of one tensor: ``quantize_blockwise`` and ``dequantize_blockwise``.

A tensor is flattened and cut into blocks of ``block_size`` elements (the last one zero-padded). Each block keeps a
float32 scale, its largest finite magnitude ``absmax``; each element keeps the code of the map entry nearest to
``x * (1 / absmax)`` (float32 reciprocal, then product: the normalisation bitsandbytes uses, one division a block
rather than one an element): one byte at 8 bits, two codes per byte at 4 bits (low nibble first). Which map decodes
the codes is a 0-d uint8 ``map_id`` computed on the tensor's device from the values themselves (no host sync): a
tensor with no negative entry uses the non-negative map (twice the resolution at 8 bits; the zero-free linear map at
4 bits, for second moments), any other the signed dynamic map. Everything is plain tensor ops on the logical tensor,
so under ``torch.func.vmap`` each stacked member gets its own blocks and its own map. The tensor's shape is kept as
the shape of an empty tensor (``QuantizedArray.like``), so that a quantized array knows what it stands for with no
data, no host sync and nothing but tensors in it.

Infinities round-trip. A block holding ``+-inf`` stores its scale negated, ``-max(absmax, 2**-126)`` (a reciprocal
that stays finite): there the codes of ``+-1`` stand for ``+-inf``, and the finite entries are encoded for
``x * (1 / absmax) * top``, ``top`` being the map's largest value below 1, so that none takes those codes (each map's
values for such a block: ``fadam.quantization._maps``); blocks of finite entries are encoded as above. ``nan`` is
stored as 0 (no map has a code for it) and never sets a scale. ``x * (1 / absmax)`` is clamped to [-1, 1]: it exceeds
1 only where ``1 / absmax`` overflows (an absmax below about 3e-39, in a block of finite entries), and such a block
stores its nonzero entries as ``+-absmax``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fadam.quantization._maps import INFINITE, MAP_IDS, Tables, decode, encode, tables_on

__all__ = ["QuantizedArray", "dequantize_blockwise", "quantize_blockwise"]

# The least scale of a block holding an infinity: 2**-126, whose reciprocal is finite (a smaller finite absmax's is not)
_LEAST_INFINITE_SCALE = torch.finfo(torch.float32).tiny


class QuantizedArray(NamedTuple):
    """A blockwise-quantized tensor of shape ``shape``."""

    codes: torch.Tensor  # uint8: n codes (8-bit) or ceil(n / 2) bytes of two codes (4-bit)
    absmax: torch.Tensor  # float32 scales, one per block of block_size elements (negative: the block holds an inf)
    map_id: torch.Tensor  # 0-d uint8: which map of fadam.quantization._maps.MAP_IDS decodes the codes
    like: torch.Tensor  # uint8 of shape (*shape, 0): no elements, its shape is the quantized tensor's

    @property
    def shape(self) -> torch.Size:
        """The shape of the tensor that the codes stand for."""
        return self.like.shape[:-1]


def shape_like(shape: torch.Size | tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """A ``QuantizedArray.like`` for ``shape``."""
    return torch.empty((*shape, 0), dtype=torch.uint8, device=device)


def map_pair(bits: int) -> tuple[int, int]:
    """(signed map, non-negative map) ids for ``bits``."""
    if bits == 8:
        return MAP_IDS["dynamic8_signed"], MAP_IDS["dynamic8_unsigned"]
    if bits == 4:
        return MAP_IDS["dynamic4_signed"], MAP_IDS["linear4_nonzero"]
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def slot_map(nonnegative: bool, bits: int) -> int:
    """The map a declared slot's codes are written with: the non-negative one for a slot its transform keeps >= 0
    (``Slot.nonnegative``: a second moment), the signed one for any other, whatever the values of a step."""
    signed, unsigned = map_pair(bits)
    return unsigned if nonnegative else signed


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    n = flat.shape[-1]
    padded = -(-n // block_size) * block_size
    if padded != n:
        flat = F.pad(flat, (0, padded - n))
    return flat.reshape(padded // block_size, block_size)


def row_absmax(rows: torch.Tensor) -> torch.Tensor:
    """Each row's scale: its largest finite magnitude (0 for a row with none), or for a row holding an infinity the
    same raised to at least 2**-126 and negated."""
    finite = torch.where(torch.isfinite(rows), rows.abs(), 0.0).amax(dim=-1)
    infinite = (rows.abs() == float("inf")).any(dim=-1)
    return torch.where(infinite, -finite.clamp(min=_LEAST_INFINITE_SCALE), finite)


def encode_scaled(
    rows: torch.Tensor, absmax: torch.Tensor, bits: int, map_id: int | torch.Tensor, tables: Tables | None = None
) -> torch.Tensor:
    """The codes of ``rows`` for their scales ``absmax`` (``row_absmax``): see ``encode_rows``."""
    tables = tables_on(rows.device) if tables is None else tables
    scale = absmax.abs()
    inverse = torch.where(scale > 0, scale, 1.0).reciprocal()
    # a 1-element index, not a 0-d one (which indexing reads on the host)
    top = tables[3][map_id if isinstance(map_id, int) else map_id.reshape(1).to(torch.int32)]
    inverse = torch.where(absmax < 0, inverse * top, inverse).unsqueeze(-1)  # a row holding an inf: codes below 1
    y = rows * inverse
    y = torch.where(y != y, 0.0, y.clamp(-1.0, 1.0))  # nan_to_num, in ops inductor vectorises (isnan it does not)
    codes = encode(y, map_id, tables)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes.to(torch.uint8)


def encode_rows(
    rows: torch.Tensor, bits: int, map_id: int | torch.Tensor, tables: Tables | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes each row of a float32 ``(blocks, block_size)`` tensor as one block: ``(codes, absmax)``, codes
    shaped ``(blocks, block_size)`` at 8 bits and ``(blocks, block_size // 2)`` at 4 bits. ``map_id`` is a static int
    (the fused kernels) or a 0-d tensor read on device."""
    absmax = row_absmax(rows)
    return encode_scaled(rows, absmax, bits, map_id, tables), absmax


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    codes = codes.to(torch.int32)
    if bits == 4:
        # the width named: -1 is ambiguous for a tensor of no rows
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
    return codes


def decode_rows(
    codes: torch.Tensor, absmax: torch.Tensor, bits: int, map_id: int | torch.Tensor, tables: Tables | None = None
) -> torch.Tensor:
    """Inverse of ``encode_rows``."""
    return decode(_indices(codes, absmax, bits), map_id, tables) * absmax.abs().unsqueeze(-1)


def _indices(codes: torch.Tensor, absmax: torch.Tensor, bits: int) -> torch.Tensor:
    # each code's index into its map's values: past INFINITE in a row that holds an infinity
    infinite = torch.where(absmax < 0, INFINITE, 0).to(torch.int32)
    return unpack_codes(codes, bits) + infinite.unsqueeze(-1)


def quantize_blockwise(
    x: torch.Tensor, bits: int = 8, block_size: int = 256, map_id: torch.Tensor | None = None
) -> QuantizedArray:
    """Quantizes ``x`` (any floating dtype, any shape) blockwise to ``bits`` per element.

    ``map_id`` forces a map (a 0-d uint8 of ``MAP_IDS``); by default it is chosen from the values (see above).

    Example:
        >>> import torch
        >>> from fadam.quantization import dequantize_blockwise, quantize_blockwise
        >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0])  # 0.5 is not a code of the signed map: nearest is 0.5015
        >>> q = quantize_blockwise(x, bits=8, block_size=2)
        >>> q.codes.dtype, q.absmax.tolist()
        (torch.uint8, [1.0, 0.25])
        >>> dequantize_blockwise(q, x.shape, bits=8, block_size=2)
        tensor([ 0.5015, -1.0000,  0.2500,  0.0000])
    """
    signed, unsigned = map_pair(bits)
    n = x.numel()
    blocks = _blocks(x.reshape(-1).to(torch.float32), block_size)
    if map_id is None:
        map_id = torch.where((blocks < 0).any(), signed, unsigned).to(torch.uint8)
    codes, absmax = encode_rows(blocks, bits, map_id)
    codes = codes.reshape(-1)[: expected_sizes(n, bits, block_size)[0]]
    return QuantizedArray(codes, absmax, map_id, shape_like(x.shape, x.device))


def dequantize_blockwise(
    q: QuantizedArray, shape: torch.Size | tuple[int, ...] | None = None, bits: int = 8, block_size: int = 256
) -> torch.Tensor:
    """The float32 tensor that ``q`` encodes, of its shape; ``shape``, if given, must be that shape."""
    map_pair(bits)
    if shape is not None and tuple(shape) != tuple(q.shape):
        raise ValueError(f"quantized array of shape {tuple(q.shape)} cannot be dequantized as shape {tuple(shape)}")
    n = q.shape.numel()
    width = block_size if bits == 8 else block_size // 2
    rows = _blocks(q.codes, width)  # zero-padded codes decode to junk that is sliced off below
    return decode_rows(rows, q.absmax, bits, q.map_id).reshape(-1)[:n].reshape(q.shape)


def expected_sizes(n: int, bits: int, block_size: int) -> tuple[int, int]:
    """``(codes, absmax)`` lengths for a tensor of ``n`` elements."""
    return (n if bits == 8 else -(-n // 2)), -(-n // block_size)
