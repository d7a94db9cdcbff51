"""Quantization maps: the sorted code values a block's normalised entries ``x * (1 / absmax)`` are rounded to.

Every map is a sorted 1-D float32 tensor with at most 256 entries; a code is an index into it. The maps (Dettmers et
al., 2022; Li et al., 2023):

- ``dynamic_map(signed, bits)``: dynamic exponent. Magnitudes are a union of linear grids, one per decade: each
  decade (``(0.1, 1] * 10**-k``) holds evenly spaced points ending at its power of ten, so the top decade ends at
  exactly 1.0 (a block's absmax round-trips exactly) and large magnitudes get fine steps while small ones keep their
  order of magnitude. Points per decade, smallest decade first: 8-bit unsigned ``1, 2, 4, ..., 128`` (1e-7 .. 1, 256
  codes with zero); 8-bit signed ``2, 4, 8, 16, 32, 65`` mirrored around zero (255 codes, symmetric; one more point
  in the top decade instead of a 1e-6 decade measurably lowers the error of Adam's m: 1.105% vs 1.123% update-direction
  error on real moments, bitsandbytes' map 1.116%); 4-bit signed ``1, 2, 4`` mirrored (15 codes).
- ``linear_nonzero_map(bits)``: ``(i + 1) / 2**bits`` — 4-bit second moments. It has no zero code: rounding a small
  ``v`` to 0 makes ``m / (sqrt(v) + eps)`` explode (Li et al., 2023, section 4.1).

Encoding rounds to the nearest code. ``encode_tables`` precomputes, for every bfloat16 bit pattern (the top 16 bits
of a float32), the nearest code of the smallest float32 with those top bits; since no map has two midpoints inside
one such interval (checked when the tables are built), ``code = table[top16(y)] + (y > midpoint[table[...]])`` is
the exact nearest code with two table reads and no search; the eager codec encodes so. The generated CPU kernel
(``fadam._cpu_kernel._encoder_table``) folds both reads and the comparison into one read and an addition, per bfloat16
pattern of the magnitude. ``encode`` with an int ``map_id`` computes the
magnitude's position on the map's grid arithmetically instead (each decade is a linear grid, so it is ``|y| * M + K``
with the decade's constants chosen by comparisons); its floor is the true code or one below it, and one read of the
midpoint table settles which. All give the same codes (the constants are checked when built;
benchmarks/check_encoder_exhaustive.py compares the table and arithmetic encoders on every float32 in [-1, 1] for
every map, and the tests the kernel's codes with the codec's).

Each map also has a second set of 256 values, for a block that holds an infinity (``fadam.quantization._codec``): there
the codes of ``+-1`` stand for ``+-inf``, and the block's finite entries are encoded for ``x * (1 / absmax) * top``,
``top`` being the map's largest value below 1 (``finite_tops``), so that they never reach the code of 1; code ``c``
then stands for ``value[c] / top`` (the largest finite entry round-trips exactly, as in a finite block).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = [
    "INFINITE",
    "MAP_IDS",
    "code_maps",
    "decode",
    "dynamic_map",
    "encode",
    "encode_tables",
    "finite_tops",
    "linear_nonzero_map",
]


# Points per decade of the dynamic maps, smallest decade first; decade d of D spans (0.1, 1] * 10**(d - D + 1).
_DECADES = {(8, False): [1, 2, 4, 8, 16, 32, 64, 128], (8, True): [2, 4, 8, 16, 32, 65], (4, True): [1, 2, 4]}


def dynamic_map(signed: bool, bits: int = 8) -> torch.Tensor:
    """Dynamic-exponent map: 255/256 codes at 8 bits (signed/unsigned), 15 at 4 bits signed.

    Example:
        >>> from fadam.quantization._maps import dynamic_map
        >>> m = dynamic_map(signed=True, bits=4)
        >>> m.numel(), m.min().item(), m.max().item(), bool((m == 0).any())
        (15, -1.0, 1.0, True)
    """
    if (bits, signed) not in _DECADES:
        raise ValueError(f"no dynamic map for bits={bits}, signed={signed}")
    decades = _DECADES[(bits, signed)]
    magnitudes = []
    for d, count in enumerate(decades):
        scale = 10.0 ** (d - len(decades) + 1)
        magnitudes.append(torch.linspace(0.1, 1.0, count + 1, dtype=torch.float64)[1:] * scale)
    mags = torch.cat(magnitudes)
    values = (
        torch.cat([-mags.flip(0), torch.zeros(1, dtype=torch.float64), mags])
        if signed
        else torch.cat([torch.zeros(1, dtype=torch.float64), mags])
    )
    return values.to(torch.float32)


def linear_nonzero_map(bits: int = 4) -> torch.Tensor:
    """``(i + 1) / 2**bits`` for ``i < 2**bits``: non-negative values with no zero code (4-bit second moments).

    Example:
        >>> from fadam.quantization._maps import linear_nonzero_map
        >>> linear_nonzero_map(4)[:3]
        tensor([0.0625, 0.1250, 0.1875])
    """
    if bits != 4:
        raise ValueError(f"the zero-free linear map is 4-bit, got bits={bits}")
    levels = 2**bits
    return (torch.arange(1, levels + 1, dtype=torch.float64) / levels).to(torch.float32)


# Map ids stored in the state (a 0-d uint8 per quantized leaf): which map decodes its codes.
MAP_IDS = {"dynamic8_signed": 0, "dynamic8_unsigned": 1, "dynamic4_signed": 2, "linear4_nonzero": 3}
_SIZE = 256  # codes per map slot; shorter maps are padded with their last value (those codes are never produced)
INFINITE = _SIZE  # where a map's values for a block holding an infinity start in its row of code_maps
_LENGTHS = (255, 256, 15, 16)  # codes of each map, in MAP_IDS order


def _unpadded_maps() -> tuple[torch.Tensor, ...]:
    return dynamic_map(True, 8), dynamic_map(False, 8), dynamic_map(True, 4), linear_nonzero_map(4)  # MAP_IDS order


@functools.cache
def _cpu_maps() -> torch.Tensor:
    rows = []
    for m, top in zip(_unpadded_maps(), _cpu_finite_tops()):
        padded = torch.cat([m, m[-1:].expand(_SIZE - m.numel())])
        infinite = torch.where(padded.abs() == 1, padded * float("inf"), padded / top)
        rows.append(torch.cat([padded, infinite]))
    return torch.stack(rows)


def code_maps(device: torch.device | str = "cpu") -> torch.Tensor:
    """All maps as one ``(4, 512)`` float32 tensor, row ``MAP_IDS[name]``: the values of its 256 codes in a finite
    block, then from ``INFINITE`` on their values in a block holding an infinity (see the module docstring)."""
    return _on_device(_cpu_maps, torch.device(device))


@functools.cache
def _cpu_finite_tops() -> torch.Tensor:
    return torch.stack([m[-2] for m in _unpadded_maps()])  # every map ends in 1.0


def finite_tops(device: torch.device | str = "cpu") -> torch.Tensor:
    """Each map's largest value below 1, ``(4,)`` float32: what a block holding an infinity scales its finite
    entries' ``x * (1 / absmax)`` by."""
    return _on_device(_cpu_finite_tops, torch.device(device))


@functools.cache
def _cpu_tables() -> tuple[torch.Tensor, torch.Tensor]:
    maps = _cpu_maps()
    patterns = torch.arange(_SIZE * _SIZE, dtype=torch.int64)
    negative = patterns >= 0x8000
    # float32 bit patterns whose top 16 bits are `pattern`: [low, high] as integers; the smallest value is `low` for
    # a positive pattern and `high` for a negative one (float order is reversed there).
    low_bits = (patterns << 16).to(torch.int64)
    high_bits = low_bits | 0xFFFF
    as_float = lambda b: (b - (1 << 32) * (b >= 1 << 31)).to(torch.int32).view(torch.float32)  # noqa: E731
    smallest = torch.where(negative, as_float(high_bits), as_float(low_bits))
    largest = torch.where(negative, as_float(low_bits), as_float(high_bits))
    finite = torch.isfinite(smallest) & torch.isfinite(largest)
    tables, thresholds = [], []
    for row, length in zip(maps, _LENGTHS):
        values = row[:length]
        mids = (values[:-1] + values[1:]) / 2
        lo = torch.bucketize(smallest.clamp(-1, 1), mids)
        hi = torch.bucketize(largest.clamp(-1, 1), mids)
        if bool(((hi - lo) > 1)[finite].any()):
            raise AssertionError("a map has two midpoints inside one bfloat16 interval; the table encoder is invalid")
        tables.append(torch.where(finite, lo, 0).to(torch.uint8))
        thresholds.append(torch.cat([mids, torch.full((_SIZE - mids.numel(),), float("inf"))]))
    return torch.stack(tables), torch.stack(thresholds)


def encode_tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(tables, thresholds)``: ``(4, 65536)`` uint8 first guesses and ``(4, 256)`` float32 upper midpoints."""
    return _on_device(_cpu_tables, torch.device(device))


_device_cache: dict[tuple[str, torch.device], object] = {}


def _on_device(build, device: torch.device):
    # Constants built once on the CPU and copied once per device (not state: the same for every optimizer).
    key = (build.__name__, device)
    if key not in _device_cache:
        value = build()
        _device_cache[key] = tuple(v.to(device) for v in value) if isinstance(value, tuple) else value.to(device)
    return _device_cache[key]


# (maps, first guesses, thresholds, finite tops) on one device
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def tables_on(device: torch.device | str) -> Tables:
    if not _GRIDS:  # built here, eagerly: a compiled kernel reads them as constants and must not trace their build
        _GRIDS.update({map_id: _grid(map_id) for map_id in MAP_IDS.values()})
    return (code_maps(device), *encode_tables(device), finite_tops(device))


def decode(codes: torch.Tensor, map_id: int | torch.Tensor, tables: Tables | None = None) -> torch.Tensor:
    """float32 values of integer ``codes`` under ``map_id`` (a static int, or a 0-d tensor read on device); a code
    plus ``INFINITE`` reads its value in a block holding an infinity."""
    maps = (tables_on(codes.device) if tables is None else tables)[0]
    codes = codes.to(torch.int32)  # int32 indices: cheaper gathers in compiled code than int64
    if isinstance(map_id, int):
        return maps[map_id][codes]
    return maps.view(-1)[map_id.to(torch.int32) * maps.shape[-1] + codes]


class _Grid(NamedTuple):
    """A map's positive half as linear segments: ``position = |y| * M + K`` in units of codes above the sign."""

    signed: bool
    zero: int  # code of 0 (signed maps) or of the smallest value; thresholds[zero + i] is the i-th positive midpoint
    top: int  # largest position: the number of positive midpoints
    segments: tuple[tuple[float, float, float], ...]  # (lowest |y| of the segment, M, K), ascending


_GRIDS: dict[int, _Grid] = {}  # filled by tables_on


def _grid(map_id: int) -> _Grid:
    maps, (_, thresholds) = _cpu_maps(), _cpu_tables()
    length = _LENGTHS[map_id]
    values = maps[map_id, :length]
    signed = bool(values[0] < 0)
    zero = length // 2 if signed else 0
    top = length - 1 - zero
    if map_id == MAP_IDS["linear4_nonzero"]:
        segments = ((0.0, float(2**4), -1.0),)  # value (i + 1) / 16 is code i
    else:
        segments, base = [], 0
        decades = _DECADES[(8 if length > 16 else 4, signed)]
        for d, count in enumerate(decades):  # value number j of decade d (j = 1..count) has position base + j
            scale = 10.0 ** (d - len(decades) + 1)
            segments.append((0.0 if d == 0 else 0.1 * scale, count / (0.9 * scale), base - count / 9))
            base += count
        segments = tuple(segments)
    grid = _Grid(signed, zero, top, segments)
    # The guess floor(position) is off by at most one below, so one midpoint comparison fixes it exactly, if every
    # positive midpoint i lies strictly inside (i, i + 1) and each segment starts near a code (continuity).
    mids = thresholds[map_id, zero : zero + top]
    pos = _position(mids, segments)
    ok = bool(((pos > torch.arange(top)) & (pos < torch.arange(1, top + 1))).all())
    for lo, m, k in segments[1:]:
        here = torch.tensor([lo], dtype=torch.float32)
        below = [s for s in segments if s[0] < lo][-1]
        ok &= abs(float(_position(here, (below,)) - _position(here, ((0.0, m, k),)))) < 0.1
    if not ok:
        raise AssertionError("the arithmetic encoder's constants do not bracket a map's midpoints")
    return grid


def _position(a: torch.Tensor, segments: tuple[tuple[float, float, float], ...]) -> torch.Tensor:
    # float32 throughout, as the compiled kernel computes it
    m, k = segments[0][1], segments[0][2]
    for lo, m_seg, k_seg in segments[1:]:
        above = a >= lo
        m, k = torch.where(above, m_seg, m), torch.where(above, k_seg, k)
    return a * m + k


def _encode_static(y: torch.Tensor, map_id: int, thresholds: torch.Tensor) -> torch.Tensor:
    grid = _GRIDS[map_id]
    a = y.abs()
    guess = _position(a, grid.segments).clamp(0, grid.top).to(torch.int32)  # floor: the position is >= 0 here
    mid = thresholds[map_id][grid.zero + guess]  # the midpoint above the guess (inf above the top code)
    if not grid.signed:  # no midpoint lies below 0
        return torch.where(y < 0, 0, guess + (a > mid).to(torch.int32))
    # y < 0 counts the negative midpoints below y: the mirror image of the positive ones at or above |y|
    return torch.where(
        y < 0, grid.zero - guess - (a >= mid).to(torch.int32), grid.zero + guess + (a > mid).to(torch.int32)
    )


def encode(y: torch.Tensor, map_id: int | torch.Tensor, tables: Tables | None = None) -> torch.Tensor:
    """Nearest int32 codes of finite float32 ``y`` in [-1, 1] under ``map_id``: the number of the map's midpoints
    below ``y``. A static int ``map_id`` computes a first guess arithmetically (one table read); a 0-d tensor one
    reads the guess table (two reads). Both give the same codes."""
    _, guesses, thresholds, _ = tables_on(y.device) if tables is None else tables
    if isinstance(map_id, int):
        return _encode_static(y, map_id, thresholds)
    top = (y.view(torch.int32) >> 16) & 0xFFFF
    row = map_id.to(torch.int32)
    guess = guesses.view(-1)[row * _SIZE * _SIZE + top].to(torch.int32)
    return guess + (y > thresholds.view(-1)[row * _SIZE + guess]).to(torch.int32)
