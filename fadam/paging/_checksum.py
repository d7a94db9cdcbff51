"""The checksum of a paged state's data: two running sums (Fletcher's) over the data's 64-bit words, in 8 lanes.

Of a leaf's bytes, read as 64-bit words ``w`` in rows of 8 (the last row padded with zeros), for each lane ``l``::

    s1[l] = sum_r w[r, l]               s2[l] = sum_r (rows - r) * w[r, l]        (mod 2**64)

``s2`` is what the running sum ``s2 += s1`` after each row adds up to, so the loop is two vector adds per row: it runs
at memory speed on any ISA the compiler vectorizes for (one thread per run of rows; each run's sums are joined by
its offset), where zlib's CRC-32 runs at 2-3 GB/s a thread, slower than the optimizer step whose state it checks.
Like a CRC it catches every change of one word, a page that was not written or was written elsewhere, and zeroed or
torn runs; unlike a CRC, two changes of one bit that cancel in one lane's both sums (``+d`` and ``-d`` at rows whose
distance times ``d`` is a multiple of 2**64) go unseen. A chunk's checksum is the first 8 bytes of the BLAKE2b hash
of its leaves' sizes and sums, in order.

The sums are computed by a small C++ function compiled like the generated kernels (``fadam._cpu_kernel``), or, with
no C++ compiler, by torch ops (the same numbers, several times slower). A disk-paged fused step takes them from the
generated kernel itself, which adds each row of its new state as it writes it (``fadam._cpu_kernel.source``'s
``streamed``).
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import itertools
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from fadam._cpu_kernel import FLETCHER, _library

LANES = 8
_SIZE, _SUMS, _NATIVE_SUMS = struct.Struct("<q"), struct.Struct(f"<{2 * LANES}Q"), struct.Struct(f"={2 * LANES}Q")
_SWAPPED = sys.byteorder != "little"  # sums read from memory are then reordered before they are hashed
_ROW = 8 * LANES  # bytes
_SERIAL_BELOW = 4 << 20  # bytes: fewer than this are summed on one thread

_SOURCE = (
    r"""
#include <cstdint>
#include <cstring>
#include <omp.h>
"""
    + FLETCHER
    + r"""
// s1[8], then s2[8], of the 64-bit words of data (fadam/paging/_checksum.py says what they are)
extern "C" void fadam_fletcher(const unsigned char* data, int64_t nbytes, uint64_t* sums, int64_t threads) {
    const int64_t full = nbytes / 64, rows = (nbytes + 63) / 64;
    uint64_t s1[8] = {0}, s2[8] = {0};
    #pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = full * me / team, end = full * (me + 1) / team;
        uint64_t a[8] = {0}, b[8] = {0};
        fadam_fletcher_rows(data + first * 64, (end - first) * 64, a, b);
        // b weighs row r by (end - r); its weight in the whole is (rows - r)
        #pragma omp critical
        fadam_fletcher_join(s1, s2, a, b, rows - end);
    }
    if (full < rows) {  // the last, partial row: zero padded, weight 1
        uint64_t a[8] = {0}, b[8] = {0};
        fadam_fletcher_rows(data + full * 64, nbytes - full * 64, a, b);
        fadam_fletcher_join(s1, s2, a, b, 0);
    }
    for (int l = 0; l < 8; ++l) {
        sums[l] = s1[l];
        sums[8 + l] = s2[l];
    }
}

// the sums of count leaves, of sizes[i] bytes at base + offsets[i], into sums + 16 * i: one call for a chunk; a
// leaf under serial_below bytes takes one thread, so that the threads share a chunk of many small leaves
extern "C" void fadam_fletcher_leaves(const unsigned char* base, const int64_t* offsets, const int64_t* sizes,
                                      int64_t count, uint64_t* sums, int64_t threads, int64_t serial_below) {
    // a small leaf's rows in one run, on the thread that took it (no parallel region of its own)
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
    for (int64_t i = 0; i < count; ++i) {
        if (sizes[i] >= serial_below) continue;
        uint64_t* found = sums + 16 * i;
        std::memset(found, 0, 16 * sizeof(uint64_t));
        fadam_fletcher_rows(base + offsets[i], sizes[i], found, found + 8);
    }
    for (int64_t i = 0; i < count; ++i) {
        if (sizes[i] >= serial_below) fadam_fletcher(base + offsets[i], sizes[i], sums + 16 * i, threads);
    }
}
"""
)


@functools.cache
def _compiled() -> tuple[Callable[..., None], Callable[..., None]] | None:
    """``fadam_fletcher`` and ``fadam_fletcher_leaves``, or ``None`` without a C++ compiler."""
    library = _library(_SOURCE)
    if library is None:
        return None
    one, many = library.fadam_fletcher, library.fadam_fletcher_leaves
    one.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    many.argtypes = [*[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    one.restype = many.restype = None
    return one, many


def leaf_sums(data: torch.Tensor) -> tuple[int, ...]:
    """``s1`` and ``s2`` (16 unsigned 64-bit numbers) of a contiguous uint8 CPU tensor's bytes."""
    nbytes = data.numel()
    compiled = _compiled()
    if compiled is not None:
        sums = (ctypes.c_uint64 * (2 * LANES))()
        threads = 1 if nbytes < _SERIAL_BELOW else torch.get_num_threads()
        compiled[0](data.data_ptr(), nbytes, sums, threads)
        return tuple(sums)
    return _torch_sums(data)


def spans_sums(buffer: torch.Tensor, spans: list[tuple[int, int]]) -> list[bytes]:
    """``leaf_sums`` of each ``(offset, nbytes)`` span of a contiguous uint8 CPU tensor, in one compiled call, each
    as its 16 numbers' bytes in memory's order (as ``ChunkChecksum.of_leaves`` takes them)."""
    compiled = _compiled()
    if compiled is None or not spans:
        return [_NATIVE_SUMS.pack(*leaf_sums(buffer[offset : offset + nbytes])) for offset, nbytes in spans]
    offsets = array.array("q", [offset for offset, _ in spans])
    sizes = array.array("q", [nbytes for _, nbytes in spans])
    sums = array.array("Q", bytes(8 * 2 * LANES * len(spans)))
    pointers = (offsets.buffer_info()[0], sizes.buffer_info()[0], sums.buffer_info()[0])
    threads = torch.get_num_threads()
    compiled[1](buffer.data_ptr(), pointers[0], pointers[1], len(spans), pointers[2], threads, _SERIAL_BELOW)
    raw = sums.tobytes()
    return [raw[_NATIVE_SUMS.size * i : _NATIVE_SUMS.size * (i + 1)] for i in range(len(spans))]


def _torch_sums(data: torch.Tensor) -> tuple[int, ...]:
    """``leaf_sums`` by torch ops, whose int64 arithmetic wraps as the unsigned one does."""
    full, rows = data.numel() // _ROW, -(-data.numel() // _ROW)
    padded = torch.zeros(_ROW, dtype=torch.uint8)
    padded[: data.numel() - full * _ROW] = data[full * _ROW :]
    words = torch.cat([data[: full * _ROW], padded]).view(torch.int64).view(full + 1, LANES)
    weights = torch.arange(rows, rows - full - 1, -1, dtype=torch.int64).view(-1, 1)  # rows - r, for every row
    s1, s2 = words.sum(0), (words * weights).sum(0)
    return tuple(int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in (*s1.tolist(), *s2.tolist()))


class Spans(NamedTuple):
    """A chunk's leaves of at least one byte, in order of offset, as ``ChunkChecksum.of_leaves`` reads them: where
    each starts, its bytes, and those as the hash takes them. A chunk's layout makes it once."""

    offsets: list[int]
    nbytes: list[int]
    packed: list[bytes]

    @classmethod
    def of(cls, places: Iterable[Any]) -> Spans:
        """The spans of leaves at ``places`` (their ``offset`` and ``nbytes``, in order of offset)."""
        filled = [place for place in places if place.nbytes]
        nbytes = [place.nbytes for place in filled]
        return cls([place.offset for place in filled], nbytes, [_SIZE.pack(n) for n in nbytes])


class ChunkChecksum:
    """A chunk's checksum, fed its leaves' bytes in order of offset (``add``), or taken of a chunk at once
    (``of_leaves``)."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=8)
        self._empty = True

    @classmethod
    def of_leaves(cls, buffer: torch.Tensor, spans: Spans, known: dict[int, bytes] | None = None) -> ChunkChecksum:
        """The checksum of the leaves at ``spans`` in a chunk's bytes (a contiguous uint8 CPU tensor), leaf after
        leaf; the padding between them is not part of it. ``known``: the sums of leaves already taken as they were
        written (16 unsigned 64-bit numbers, in memory's byte order), by the data pointer of the leaf's first
        byte."""
        checksum, base, known = cls(), buffer.data_ptr(), known or {}
        found = list(map(known.get, map(base.__add__, spans.offsets)))
        missing = [i for i, sums in enumerate(found) if sums is None]
        computed = spans_sums(buffer, [(spans.offsets[i], spans.nbytes[i]) for i in missing])
        for i, sums in zip(missing, computed):
            found[i] = sums
        if _SWAPPED:
            found = [_SUMS.pack(*_NATIVE_SUMS.unpack(sums)) for sums in found]
        # a single update of the hash with each leaf's size and sums in turn, as ``add`` leaf after leaf gives
        checksum._hash.update(b"".join(itertools.chain.from_iterable(zip(spans.packed, found))))
        checksum._empty = not found
        return checksum

    def add(self, data: torch.Tensor) -> None:
        """Adds a leaf (a contiguous uint8 CPU tensor of its bytes) by its size and sums."""
        self._hash.update(_SIZE.pack(data.numel()))
        self._hash.update(_SUMS.pack(*leaf_sums(data)))
        self._empty = False

    @property
    def value(self) -> int:
        """The checksum: 0 for a chunk of no bytes."""
        return 0 if self._empty else int.from_bytes(self._hash.digest(), "little")
