"""Quantization maps: the code values a block's normalised entries ``x / absmax`` are rounded to, and the arithmetic
that encodes and decodes them.

Every map is sorted; a code is an index into it. The maps (Dettmers et al., 2022; Li et al., 2023):

- dynamic exponent, ``decades`` D: zero, then decades ``d = 0 .. D-1`` of ``2**d`` evenly spaced points of
  ``(0.1, 1] * 10**(d - D + 1)`` each, so large magnitudes get fine steps while small ones keep their order of
  magnitude, and the top decade ends at exactly 1.0 (a block's absmax is stored exactly). Signed maps mirror the
  magnitudes around zero. 8-bit signed: D = 7, 255 codes (smallest magnitude 1e-6); 8-bit unsigned: D = 8, 256 codes
  (twice the resolution per decade and one more decade, down to 1e-7); 4-bit signed: D = 3, 15 codes.
- linear without zero: ``(i + 1) / 16`` for 4-bit second moments. Rounding a small ``v`` to 0 makes
  ``m / (sqrt(v) + eps)`` explode (Li et al., 2023, section 4.1), so this map has no zero code.

Encoding and decoding are arithmetic (a log10, a few multiplies and selects per element; no table gathers, which
compile to scalar loops), so they vectorise and run in a single pass inside compiled kernels. Encoding returns the
nearest code; only values within float rounding of a midpoint between two codes may take the other neighbour.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["MAP_IDS", "code_maps", "decode", "dynamic_map", "encode", "linear_nonzero_map"]

# Map ids stored in the state (a 0-d uint8 per quantized leaf): which map decodes its codes.
MAP_IDS = {"dynamic8_signed": 0, "dynamic8_unsigned": 1, "dynamic4_signed": 2, "linear4_nonzero": 3}
_DYNAMIC = {0: (7, True), 1: (8, False), 2: (3, True)}  # map id -> (decades, signed)


def _decade_scale(d: torch.Tensor, decades: int) -> torch.Tensor:
    """``10 ** (d - decades + 1)`` for integer-valued float ``d``, as exact float32 constants (no pow rounding)."""
    scale = torch.full_like(d, 10.0 ** (1 - decades))
    for k in range(1, decades):
        scale = torch.where(d == k, 10.0 ** (k - decades + 1), scale)
    return scale


def _decode_dynamic(codes: torch.Tensor, decades: int, signed: bool) -> torch.Tensor:
    k = codes.to(torch.int32) - (2**decades - 1 if signed else 0)
    a = k.abs().to(torch.float32)  # magnitude index: 0 is zero, then decade d holds 2**d .. 2**(d+1) - 1
    bits = a.view(torch.int32)
    p2 = (bits & 0x7F800000).view(torch.float32)  # 2**d
    d = ((bits >> 23) - 127).to(torch.float32)
    fraction = 0.1 + 0.9 * ((a - p2 + 1) / torch.where(a > 0, p2, 1.0))
    value = torch.where(a > 0, fraction * _decade_scale(d, decades), 0.0)
    return torch.where(k < 0, -value, value) if signed else value


def _encode_dynamic(y: torch.Tensor, decades: int, signed: bool) -> torch.Tensor:
    a = y.abs()
    d = (torch.ceil(torch.log10(a)) + (decades - 1)).clamp(0, decades - 1)  # log10(0) = -inf lands in decade 0
    scale = _decade_scale(d, decades)
    p2 = torch.exp2(d)
    # decade d's points are 0.1 * scale (the previous decade's top; zero below decade 0) + j * 0.9 * scale / 2**d
    j = torch.where(
        d > 0, torch.minimum(torch.round((a / scale - 0.1) / 0.9 * p2).clamp(min=0), p2), torch.round(a / scale)
    ).clamp(min=0)
    index = torch.where(d > 0, p2 + j - 1, j).to(torch.int32)
    if signed:
        return (2**decades - 1) + torch.where(y < 0, -index, index)
    return index


def decode(codes: torch.Tensor, map_id: int) -> torch.Tensor:
    """float32 values of integer ``codes`` under map ``map_id`` (a static int of ``MAP_IDS``)."""
    if map_id == MAP_IDS["linear4_nonzero"]:
        return (codes.to(torch.float32) + 1) * (1 / 16)
    return _decode_dynamic(codes, *_DYNAMIC[map_id])


def encode(y: torch.Tensor, map_id: int) -> torch.Tensor:
    """Nearest int32 codes of finite float32 ``y`` in [-1, 1] (in [0, 1] for non-negative maps) under ``map_id``."""
    if map_id == MAP_IDS["linear4_nonzero"]:
        return (torch.round(y * 16) - 1).clamp(0, 15).to(torch.int32)
    return _encode_dynamic(y, *_DYNAMIC[map_id])


_LENGTHS = {0: 255, 1: 256, 2: 15, 3: 16}


def dynamic_map(signed: bool, bits: int = 8) -> torch.Tensor:
    """Every value of a dynamic-exponent map, sorted: 255/256 codes at 8 bits (signed/unsigned), 15 at 4 bits signed.

    Example:
        >>> from fadam.quantization import dynamic_map
        >>> m = dynamic_map(signed=True, bits=4)
        >>> m.numel(), m[7:]
        (15, tensor([0.0000, 0.0100, 0.0550, 0.1000, 0.3250, 0.5500, 0.7750, 1.0000]))
    """
    if (bits, signed) not in ((8, True), (8, False), (4, True)):
        raise ValueError(f"no dynamic map for bits={bits}, signed={signed}")
    map_id = MAP_IDS[f"dynamic{bits}_{'signed' if signed else 'unsigned'}"]
    return decode(torch.arange(_LENGTHS[map_id]), map_id)


def linear_nonzero_map(bits: int = 4) -> torch.Tensor:
    """``(i + 1) / 16``: non-negative values with no zero code (4-bit second moments).

    Example:
        >>> from fadam.quantization import linear_nonzero_map
        >>> linear_nonzero_map()[:3]
        tensor([0.0625, 0.1250, 0.1875])
    """
    if bits != 4:
        raise ValueError(f"the zero-free linear map is 4-bit, got bits={bits}")
    return decode(torch.arange(16), MAP_IDS["linear4_nonzero"])


@functools.cache
def code_maps() -> torch.Tensor:
    """All maps as one ``(4, 256)`` float32 CPU tensor, row ``MAP_IDS[name]`` (short maps padded with their last
    value, a code never produced): the reference the arithmetic codec is tested against."""
    rows = [decode(torch.arange(_LENGTHS[i]), i) for i in range(4)]
    return torch.stack([torch.cat([r, r[-1:].expand(256 - r.numel())]) for r in rows])
