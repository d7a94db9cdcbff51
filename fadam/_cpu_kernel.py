"""The generated CPU backend: one C++ function per traced program segment and dtype.

The function walks every leaf of a group in one call: the leaves' elements are cut into chunks, OpenMP spreads the
chunks over threads, and each chunk is one loop that loads the segment's inputs, runs its graph and stores its
outputs. The compiler vectorizes the loop for the machine it runs on (``-march=native``: AVX2, AVX-512, NEON), with
``-ffp-contract=off`` so that every operation rounds once, as the eager torch ops do: the results equal the eager
path's bit for bit (see ``tests/test_program.py``), whatever the instruction set. A *streamed* kernel (``source``'s
``streamed``, for a disk-paged step, whose new state goes into another copy of it in a file's map) writes its slots
with non-temporal stores where the ISA has them and sums them for the paged file's checksum as it writes.

Sources are compiled by the system's C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) into a plain shared
library loaded through ``ctypes``, about a second each, and cached on disk under ``$FADAM_CACHE_DIR`` (default:
``$XDG_CACHE_HOME/fadam`` or ``~/.cache/fadam``), keyed by the source, the compiler and the machine's CPU. Without a
compiler, ``load`` warns once and returns ``None``: the eager path runs.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from fadam._compiled_checks import compiled_checks
from fadam._program import Node, Traced

_STORED = {torch.float32: "float", torch.float64: "double", torch.bfloat16: "uint16_t"}  # C types in memory
_COMPUTED_IN = {torch.float32: "float", torch.float64: "double", torch.bfloat16: "float"}  # and in registers
KERNEL_DTYPES = tuple(_STORED)
_CHUNK = 1 << 14  # elements per unit of work: a few hundred kilobytes of traffic, many per thread on large leaves
_SERIAL_BELOW = 1 << 16  # fewer elements than this run on one thread: waking the others costs more than it saves

# -ffp-contract=off: every operation rounds once, as ATen's kernels do; -fno-math-errno and -fno-trapping-math let
# the compiler vectorize square roots and selects between floats (neither changes a result).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
    "-std=c++17",
]
# GCC's generic tuning, which -march=native keeps for a CPU it does not know by name, never emits gather
# instructions: the quantized slots' table reads (one per decoded or encoded element) would then stay scalar.
_GCC_FLAGS = ["-mtune-ctrl=use_gather_2parts,use_gather_4parts,use_gather"]


def _flags(version: str) -> list[str]:
    gcc = "clang" not in version.lower() and platform.machine().lower() in ("x86_64", "amd64")
    return _FLAGS + (_GCC_FLAGS if gcc else [])


_PRELUDE = """\
#include <cstdint>
#include <cstdlib>
#include <cstring>

// <cmath>'s functions as the compiler builtins they call (GCC and Clang): parsing <cmath>, <algorithm> and <vector>
// took half the time of building a kernel
static inline float fadam_fabs(float x) { return __builtin_fabsf(x); }
static inline double fadam_fabs(double x) { return __builtin_fabs(x); }
static inline float fadam_sqrt(float x) { return __builtin_sqrtf(x); }
static inline double fadam_sqrt(double x) { return __builtin_sqrt(x); }
static inline float fadam_fma_once(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline double fadam_fma_once(double a, double b, double c) { return __builtin_fma(a, b, c); }
#define FADAM_INFINITY __builtin_inff()
#define FADAM_NAN __builtin_nanf("")
// the smaller and the larger of two integers (floats take fadam_minimum and fadam_maximum, which propagate NaN)
template <typename T> static inline T fadam_min(T a, T b) { return b < a ? b : a; }
template <typename T> static inline T fadam_max(T a, T b) { return a < b ? b : a; }
// a zeroed heap array, freed where it goes out of scope; ``data`` is null where memory ran out
template <typename T> struct FadamArray {
  T* data;
  explicit FadamArray(int64_t n) : data(static_cast<T*>(std::calloc(n > 0 ? n : 1, sizeof(T)))) {}
  FadamArray(const FadamArray&) = delete;
  FadamArray& operator=(const FadamArray&) = delete;
  ~FadamArray() { std::free(data); }
  T& operator[](int64_t i) { return data[i]; }
};

// Fills out[0, length) with what elements [start, start + length) of a leaf read from a spread: element f reads
// values[(f / (inner * count)) * inner + f % inner] (fadam._program.Spread.indexing), in runs of one index or of
// consecutive ones, so that the element loops read a spread as they read an input
template <typename T>
static inline void fadam_spread(const T* values, int64_t inner, int64_t count, int64_t start, int64_t length, T* out) {
  for (int64_t j = 0; j < length;) {
    const int64_t at = start + j;
    const int64_t first = (at / (inner * count)) * inner + at % inner;
    const int64_t run = fadam_min(inner == 1 ? count - at % count : inner - at % inner, length - j);
    if (inner == 1) {
      for (int64_t r = j; r < j + run; ++r) out[r] = values[first];
    } else {
      std::memcpy(out + j, values + first, run * sizeof(T));
    }
    j += run;
  }
}

// torch.maximum / torch.minimum: NaN propagates; between equal values the second operand, as ATen's vector path
template <typename T> static inline T fadam_maximum(T a, T b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
template <typename T> static inline T fadam_minimum(T a, T b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
// torch.clamp: NaN stays NaN, then min(max(x, low), high)
template <typename T> static inline T fadam_clamp(T x, T low, T high) {
  if (x != x) return x;
  const T raised = x < low ? low : x;
  return high < raised ? high : raised;
}
// torch.sign: 0 for zeros and NaN
template <typename T> static inline T fadam_sign(T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0)); }
// ATen's vectorized multiply-add: rounded once where its CPU capability has FMA (AVX2, AVX-512, NEON), else twice
#if FADAM_ATEN_FMA
template <typename T> static inline T fadam_fma(T a, T b, T c) { return fadam_fma_once(a, b, c); }
#else
template <typename T> static inline T fadam_fma(T a, T b, T c) { return a * b + c; }
#endif
// torch.lerp as ATen's vector kernel computes it
template <typename T> static inline T fadam_lerp(T start, T end, T weight) {
  const bool small = fadam_fabs(weight) < T(0.5);
  return fadam_fma(small ? weight : weight - T(1), end - start, small ? start : end);
}
// bfloat16 values live in floats: loaded exactly, and rounded to nearest even after every bfloat16 operation, as
// ATen rounds each op's float result (NaN stays NaN)
static inline float fadam_from_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}
static inline float fadam_round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = x != x ? (bits | 0x00400000u) & 0xFFFF0000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}
static inline uint16_t fadam_to_bf16(float rounded) {
  uint32_t bits;
  std::memcpy(&bits, &rounded, 4);
  return static_cast<uint16_t>(bits >> 16);
}
#if defined(__FP_FAST_FMAF)
#define FADAM_FAST_FMA 1  // fused multiply-adds are instructions, not library calls
#else
#define FADAM_FAST_FMA 0
#endif
// x / d for a float32 square root x and a number d with 2^-50 <= |d| <= 2^50, r = 1 / d: rounded as the division
// rounds, with three FMAs and a product instead of a division (_divided_roots says why)
static inline float fadam_divide_root(float x, float d, float r) {
  const float q0 = x * r;
  const float q1 = __builtin_fmaf(__builtin_fmaf(-q0, d, x), r, q0);
  // a zero signed as the division signs it
  const float q2 = __builtin_copysignf(__builtin_fmaf(__builtin_fmaf(-q1, d, x), r, q1), q0);
  return x == FADAM_INFINITY ? q0 : q2;
}
typedef void (*SqrtRows)(int, const double*, double*);  // MKL's vdSqrt, which torch's CPU float64 sqrt calls
typedef int (*MklThreads)(int);  // MKL_Set_Num_Threads_Local
"""

# The two running sums of ``fadam.paging._checksum`` (its docstring defines them), written once for its own C++
# function and for the streamed kernels below, which take them of what they write.
FLETCHER = """\
// eight 64-bit lanes as one value: the compiler keeps them in whatever vector registers the ISA has
typedef uint64_t fadam_lanes __attribute__((vector_size(64)));
// adds nbytes of data, in rows of 64 bytes (the last one zero padded), to the running sums a[8] and b[8]
static inline void fadam_fletcher_rows(const unsigned char* data, int64_t nbytes, uint64_t* a, uint64_t* b) {
  fadam_lanes x, y, w;
  std::memcpy(&x, a, sizeof x);
  std::memcpy(&y, b, sizeof y);
  const int64_t full = nbytes / 64;
  for (int64_t r = 0; r < full; ++r) {
    std::memcpy(&w, data + r * 64, 64);
    x += w;
    y += x;
  }
  if (full * 64 < nbytes) {
    w = fadam_lanes{};
    std::memcpy(&w, data + full * 64, nbytes - full * 64);
    x += w;
    y += x;
  }
  std::memcpy(a, &x, sizeof x);
  std::memcpy(b, &y, sizeof y);
}
// adds the sums (a, b) of a run of rows that ``after`` more rows of the whole follow to the whole's (s1, s2)
static inline void fadam_fletcher_join(uint64_t* s1, uint64_t* s2, const uint64_t* a, const uint64_t* b,
                                       uint64_t after) {
  for (int l = 0; l < 8; ++l) {
    s1[l] += a[l];
    s2[l] += b[l] + after * a[l];
  }
}
"""

# A streamed kernel writes its new slots into memory that is not read again soon (a file's other copy): from a
# scratch row in the L1 cache, with non-temporal stores where the ISA has them (x86's SSE2: the lines are written
# without being read first), adding each 64-byte row to the Fletcher sums of ``fadam.paging._checksum`` on the way.
_STREAM = (
    FLETCHER
    + """\
#if defined(__SSE2__)
#include <immintrin.h>
#endif
static inline void fadam_stream_sum(void* dst, const void* src, int64_t nbytes, uint64_t* sums) {
  const unsigned char* from = static_cast<const unsigned char*>(src);
  fadam_fletcher_rows(from, nbytes, sums, sums + 8);
  unsigned char* to = static_cast<unsigned char*>(dst);
#if defined(__SSE2__)
  // the widest store the ISA has: a whole 64-byte line per store leaves the fewest lines partly written at a time
#if defined(__AVX512F__)
  constexpr int64_t width = 64;
#elif defined(__AVX__)
  constexpr int64_t width = 32;
#else
  constexpr int64_t width = 16;
#endif
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(to) & (width - 1));
  const int64_t head = fadam_min<int64_t>(nbytes, (width - misaligned) & (width - 1));
  std::memcpy(to, from, head);
  int64_t j = head;
  for (; j + width <= nbytes; j += width) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to + j), _mm512_loadu_si512(from + j));
#elif defined(__AVX__)
    const __m256i row = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + j));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + j), row);
#else
    const __m128i row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + j));
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + j), row);
#endif
  }
  std::memcpy(to + j, from + j, nbytes - j);
#else
  std::memcpy(to, from, nbytes);
#endif
}
static inline void fadam_stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();  // non-temporal stores are weakly ordered: this thread's are visible before the kernel returns
#endif
}
"""
)

_BINARY_C = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "gt": ">", "le": "<=", "ge": ">="}
_UNARY_C = {
    "neg": "-{}",
    "abs": "fadam_fabs({})",
    "sign": "fadam_sign({})",
    "reciprocal": "1 / {}",
    "rsqrt": "1 / fadam_sqrt({})",  # torch.rsqrt: the IEEE square root (not MKL's), then a division
    "sqrt": "fadam_sqrt({})",  # the IEEE root, as the eager path's of float32 and bfloat16 (float64: MKL's, below)
}
_CALLS = {
    "maximum": "fadam_maximum({}, {})",
    "minimum": "fadam_minimum({}, {})",
    "where": "{} ? {} : {}",
    "clamp": "fadam_clamp({}, {}, {})",
    "lerp": "fadam_lerp({}, {}, {})",
    "addcmul": "fadam_fma({3} * {1}, {2}, {0})",  # torch.addcmul(c, a, b, value=v): fma(v * a, b, c)
    "add_scaled": "fadam_fma({1}, {2}, {0})",  # torch.add(a, b, alpha=k): fma(b, k, a)
}
_COMPUTED = frozenset(_BINARY_C) | frozenset(_UNARY_C) | frozenset(_CALLS) | {"cast"}
# Operations where ATen rounds a number to a bfloat16 operand's dtype first (add and sub, a comparison, a clamp's
# bounds, torch.add's alpha, a where's branch); mul, div, lerp's weight and addcmul's value keep it in float.
_ROUNDS_SCALARS = frozenset(
    {"add", "sub", "lt", "gt", "le", "ge", "clamp", "add_scaled", "where", "maximum", "minimum"}
)
_BLOCK = 512  # elements per pass between square roots: their buffers stay in the L1 cache
_STREAMED_SPAN = 64  # elements per scratch row of a one-pass streamed kernel (``source`` says why)


def _literal(value: float, ctype: str) -> str:
    if value != value:
        return f"{ctype}(FADAM_NAN)"
    if value in (float("inf"), float("-inf")):
        return f"{ctype}(FADAM_INFINITY)" if value > 0 else f"{ctype}(-FADAM_INFINITY)"
    return f"{ctype}({value.hex()})"  # exact in any precision the C type holds it in


_WIDTH = {torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}


def _promoted(dtypes: list[torch.dtype | None]) -> torch.dtype | None:
    """torch's promotion between floating tensors (numbers take the tensors' dtype)."""
    found = [d for d in dtypes if d is not None and d != torch.bool]
    return max(found, key=_WIDTH.__getitem__) if found else None


def _node_dtypes(traced: Traced, inputs: tuple[torch.dtype, ...]) -> dict[int, torch.dtype | None]:
    """Each node's dtype, as torch would give it for tensors of the ``inputs``' dtypes: ``None`` for a number,
    ``torch.bool`` for a comparison; a comparison's operands are compared in ``operand_dtype``."""
    dtypes: dict[int, torch.dtype | None] = {}
    graph = traced.graph
    for node in graph.nodes:
        if node.op == "input":
            dtypes[node.index] = inputs[graph.inputs.index(node)]
        elif node.op == "operand":  # a spread's dtype follows the inputs'
            dtypes[node.index] = inputs[len(graph.inputs) + node.value]
        elif not node.elementwise:
            dtypes[node.index] = None
        elif node.boolean:
            dtypes[node.index] = torch.bool
        elif node.op == "cast":
            dtypes[node.index] = dtypes[node.args[1].index]
        else:
            arguments = node.args[1:] if node.op == "where" else node.args
            dtypes[node.index] = _promoted([dtypes[a.index] for a in arguments])
    return dtypes


def _operand_dtype(node: Node, dtypes: dict[int, torch.dtype | None]) -> torch.dtype | None:
    """The dtype ``node`` computes in: its own, or for a comparison its operands' promoted dtype."""
    if node.boolean:
        return _promoted([dtypes[a.index] for a in node.args])
    if node.op == "cast":
        return dtypes[node.args[1].index]
    return dtypes[node.index]


def read_as(node: Node, position: int, dtypes: dict) -> tuple[torch.dtype | None, bool]:
    """How ``node`` reads its argument ``position``, for every backend: the dtype a value is promoted to (``None``:
    as it is) or a number is read in, and whether that number is rounded to bfloat16 first, where ATen rounds it
    (``_ROUNDS_SCALARS``; only torch.add's alpha of add_scaled)."""
    arg = node.args[position]
    dtype = _operand_dtype(node, dtypes)
    if arg.elementwise:
        own = dtypes[arg.index]
        same = own in (None, torch.bool) or dtype is None or _COMPUTED_IN[own] == _COMPUTED_IN[dtype]
        return (None if same else dtype), False
    rounds = dtype == torch.bfloat16 and node.op in _ROUNDS_SCALARS and not (node.op == "add_scaled" and position != 2)
    return dtype, rounds


def _argument(node: Node, position: int, names: dict[int, str], dtypes: dict, scalar_names: dict) -> str:
    """How ``node`` reads its argument ``position`` in C++ (``read_as``)."""
    arg = node.args[position]
    dtype, rounds = read_as(node, position, dtypes)
    if arg.elementwise:
        if dtype is None:
            return names[arg.index]
        return f"static_cast<{_COMPUTED_IN[dtype]}>({names[arg.index]})"  # float32 promoted to float64: exact
    ctype = _COMPUTED_IN[dtype]
    if arg.op == "const":
        text = _literal(arg.value, ctype)
        return f"fadam_round_bf16({text})" if rounds else text
    return scalar_names[(arg.op, arg.value, ctype, rounds)]


def _expression(node: Node, args: list[str], dtypes: dict) -> str:
    if node.op in _BINARY_C:
        return f"{args[0]} {_BINARY_C[node.op]} {args[1]}"
    if node.op in _UNARY_C:
        return _UNARY_C[node.op].format(args[0])
    if node.op in _CALLS:
        return _CALLS[node.op].format(*args)
    if node.op == "cast":
        target = dtypes[node.index]
        return f"static_cast<{_COMPUTED_IN[target]}>({args[0]})"
    raise ValueError(f"no C++ for the operation {node.op}")


_DIVISOR_RANGE = (2.0**-50, 2.0**50)  # the magnitudes of divisors that fadam_divide_root takes


def _divided_roots(traced: Traced, needed: set[int], dtypes: dict) -> set[int]:
    """The divisions of a float32 square root by one of the step's numbers that the kernel
    computes with ``fadam_divide_root`` (``_PRELUDE``), three FMAs and a product, instead of a vector division, which
    costs several cycles an element: Adam's ``sqrt(nu) / bc2_sqrt``. Where the FMAs are not the machine's own
    instructions, or the step's divisors do not all lie in ``_DIVISOR_RANGE``, the kernel divides.

    They round as the division does. Scaling by powers of two is exact where nothing underflows or overflows, so take
    ``x`` and ``d`` in [1, 2), ``z = x / d`` in (1/2, 2) and ``u`` an ulp of ``z``. ``r = RN(1 / d)`` has ``d r = 1 -
    delta`` with ``|delta| <= d 2**-25``. ``q0 = RN(x r)`` lies within ``1.5 u`` of ``z``; the remainder ``x - q0 d``,
    rounded (relative error ``epsilon <= 2**-24``), gives ``q1 = RN(q0 + RN(x - q0 d) r)``, which misses ``z`` by at
    most ``u / 2 + 1.5 u (|delta| + epsilon)``: it is one of the two floats around ``z``. Its remainder ``x - q1 d``
    then has fewer than 24 bits on the grid of ``q1 d``, which the FMA computes exactly, and ``q2 = RN(q1 + (x - q1 d)
    r) = RN(z - (z - q1) delta)``. A quotient of two floats is never a midpoint ``M`` between floats: ``x - M d`` is a
    nonzero multiple of ``2**-24 u``, so ``|z - M| >= 2**-24 u / d``. As ``|z - q1| <= u / 2 + |z - M|`` for the
    midpoint nearest ``z``, ``(z - q1) delta`` falls short of ``M`` when ``2**-24 / d > d 2**-26 / (1 - |delta|)``,
    that is ``d**2 + d 2**-23 < 4``, true of every ``d`` below 2: ``q2 = RN(z)``. A square root is zero, NaN,
    infinite or between 2**-75 and 2**64, so with ``|d|`` in ``_DIVISOR_RANGE`` no step underflows or overflows; a
    zero's sign is the product's, and an infinity is the product itself. benchmarks/check_division_exhaustive.py
    checks every float32 ``x`` for a set of divisors."""
    found = set()
    for node in traced.graph.nodes:
        if node.index not in needed or node.op != "div" or dtypes[node.index] != torch.float32:
            continue
        dividend, divisor = node.args
        if dividend.op != "sqrt" or dtypes[dividend.index] != torch.float32:
            continue
        if divisor.op == "scalar":
            found.add(node.index)
    return found


def _phases(traced: Traced, needed: set[int], roots: set[int]) -> dict[int, int]:
    """The pass each node is computed in: a square root run by MKL (``roots``) is available one pass after its
    argument (torch's float64 square root runs over a block of arguments at once, in MKL), every other node in the
    pass of its last argument."""
    phase: dict[int, int] = {}
    for node in traced.graph.nodes:
        if node.index in needed:
            start = max((phase[a.index] for a in node.args), default=0)
            phase[node.index] = start + 1 if node.index in roots else start
    return phase


class Quantized(NamedTuple):
    """A slot stored blockwise-quantized (``fadam.quantization``): its codes are decoded with the map each leaf's
    ``map_id`` names and the new values encoded, block by block, with ``map_id`` here."""

    bits: int
    block: int
    map_id: int

    @property
    def span(self) -> int:
        """Elements per pass of a kernel with this slot: whole blocks, each encoded once its values are known."""
        return self.block * max(1, _BLOCK // self.block)

    @property
    def sums_codes(self) -> bool:
        """Whether a streamed kernel can sum this slot's codes as it writes them: each pass's codes fill whole
        64-byte rows (``fadam.paging._checksum``'s), but for a leaf's last."""
        return self.span * self.bits % (8 * 64) == 0


Formats = tuple["Quantized | None", ...]  # per slot of a traced segment: quantized, or plain tensors (None)


_WEIGHTS = {"lerp": 2, "addcmul": 3, "add_scaled": 2}  # the argument that takes a number


@functools.lru_cache(maxsize=512)
def weight_scalars(traced: Traced) -> frozenset[str]:
    """The names of the scalars ``traced`` uses as lerp's weight, addcmul's value or add's alpha."""
    graph = traced.graph
    return frozenset(
        graph.scalars[node.args[_WEIGHTS[node.op]].value]
        for node in graph.nodes
        if node.op in _WEIGHTS and node.args[_WEIGHTS[node.op]].op == "scalar"
    )


class _Scalars(dict):
    """The C names of the step's scalars as the kernel reads them, declared on first use: per C type, and rounded to
    bfloat16 where an operation rounds them (``_argument``)."""

    def __missing__(self, key: tuple[str, int, str, bool]) -> str:
        op, index, ctype, rounds = key
        name = self[key] = f"{'s' if op == 'scalar' else 'l'}{index}_{ctype[0]}{'b' if rounds else ''}"
        return name

    def declarations(self) -> list[str]:
        lines = []
        for (op, index, ctype, rounds), name in self.items():
            source = f"scalars[{index}]" if op == "scalar" else f"leaf_scalars[leaf * PER_LEAF + {index}]"
            value = f"{ctype}({source})"
            lines.append((op, f"const {ctype} {name} = {f'fadam_round_bf16({value})' if rounds else value};"))
        return lines


@functools.lru_cache(maxsize=512)
def source(traced: Traced, dtypes: tuple[torch.dtype, ...], formats: Formats = (), streamed: bool = False) -> str:
    """The C++ source of ``traced`` for inputs of ``dtypes`` (in the graph's order; the outputs have their inputs'
    dtypes, the last one the first input's): ``fadam_run(leaves, sizes, pointers, scalars, leaf_scalars, threads,
    sqrt_double, mkl_threads)``, where ``pointers`` holds, per leaf, the inputs in the graph's order,
    then the outputs, then its spreads (``Graph.operands``, whose dtypes end ``dtypes``; their indexing is among the
    leaf's scalars, and each pass copies what its elements read into a row in the L1 cache: ``fadam_spread``); a
    quantized slot (``formats``) takes three of each: codes, absmax and map id. Each node is
    computed in its dtype as torch would compute it: float32 and float64 as they are, bfloat16 in float, rounded
    after every operation.

    ``streamed``: the new slots stored as they are go out through ``fadam_stream_sum`` (``_STREAM``), a quantized
    slot's codes are summed as each pass encodes them (``Quantized.sums_codes`` must hold), and ``fadam_run`` takes
    one more argument, ``leaf_sums``, where it puts each leaf's and slot's 16 Fletcher sums of the bytes it wrote (of
    a quantized slot: of its codes; ``fadam.paging._checksum.leaf_sums``'s numbers), leaf by leaf."""
    from fadam.quantization._maps import INFINITE  # the quantization package builds on the program

    graph = traced.graph
    slots = len(traced.outputs) - 1
    formats = formats or (None,) * slots
    first_slot = len(graph.inputs) - slots
    quantized = {k: f for k, f in enumerate(formats) if f is not None}
    if streamed and not all(q.sums_codes for q in quantized.values()):
        raise ValueError("a streamed kernel sums whole rows of codes in each pass")
    types = _node_dtypes(traced, dtypes)
    needed = _reachable(traced.outputs)
    mkl_roots = {
        n.index for n in graph.nodes if n.index in needed and n.op == "sqrt" and types[n.index] == torch.float64
    }
    phase = _phases(traced, needed, mkl_roots)
    divided = _divided_roots(traced, needed, types)
    passes = max(phase.values(), default=0) + 1
    if quantized:
        block = next(iter(quantized.values())).block
        if any(f.block != block for f in quantized.values()):
            raise ValueError("the quantized slots of one kernel share a block size")
        span = next(iter(quantized.values())).span
        chunk = span * -(-_CHUNK // span)
    else:
        # A streamed kernel's scratch rows are short: each row's non-temporal writes then go out between the loads
        # of the rows around it (fp32 AdamW on a 2-core Xeon, against the in-place kernel: 1.03-1.11x with rows of
        # 64 elements, 1.16-1.19x with 512, 1.14-1.24x with 16).
        span = _BLOCK if passes > 1 else _STREAMED_SPAN if streamed else _CHUNK
        chunk = _CHUNK
    output_of: dict[int, list[int]] = {}  # a node may be several outputs (trace's update is its new trace)
    for k, out in enumerate(traced.outputs):
        output_of.setdefault(out.index, []).append(k)
    roots = [n for n in graph.nodes if n.index in mkl_roots]
    uses: dict[int, set[int]] = {}  # the passes that read each node
    for node in graph.nodes:
        if node.index in needed:
            reader = phase[node.index] - 1 if node.index in mkl_roots else phase[node.index]  # its argument is stored
            for arg in node.args:
                uses.setdefault(arg.index, set()).add(reader)
    buffered = [  # computed values that a later pass reads
        n for n in graph.nodes if n.op in _COMPUTED and max(uses.get(n.index, {-1})) > phase.get(n.index, 0)
    ]
    buffered_indices = {n.index for n in buffered}
    scalar_names = _Scalars()

    def ctype(node: Node) -> str:
        return "bool" if node.boolean else _COMPUTED_IN[types[node.index]]

    def load(k: int, node: Node, name: str) -> list[str]:
        slot = k - first_slot
        if slot in quantized:  # the block's table offset and scale (o, w) are read before the loop
            code = f"c{slot}[at]" if quantized[slot].bits == 8 else f"u{slot}[j]"
            return [f"const float {name} = m{slot}[{code} + o{slot}] * w{slot};"]
        value = f"fadam_from_bf16(in{k}[at])" if dtypes[k] == torch.bfloat16 else f"in{k}[at]"
        return [f"const {ctype(node)} {name} = {value};"]

    def store(k: int, node: Node, name: str) -> str:
        if streamed and k < slots and k not in quantized:  # to the scratch row, written out after the loop
            return f"s{k}[j] = {f'fadam_to_bf16({name})' if types[node.index] == torch.bfloat16 else name};"
        if k in quantized:  # and the block's largest magnitude pattern so far (``_encode_blocks``)
            return (
                f"const float q{k}_{name} = {name};\n        q{k}[j] = q{k}_{name};\n        "
                f"uint32_t q{k}_bits;\n        std::memcpy(&q{k}_bits, &q{k}_{name}, 4);\n        "
                f"q{k}_bits &= 0x7FFFFFFFu;\n        top{k} = top{k} < q{k}_bits ? q{k}_bits : top{k};"
            )
        return f"out{k}[at] = {f'fadam_to_bf16({name})' if types[node.index] == torch.bfloat16 else name};"

    checked_divisors: dict[str, str] = {}  # a step's divisor -> its reciprocal's name, both checked once a call

    def value(node: Node, names: dict[int, str], fast: bool) -> str:
        if node.index in mkl_roots:
            return f"r{node.index}[j]"
        args = [_argument(node, k, names, types, scalar_names) for k in range(len(node.args))]
        if fast and node.index in divided:
            reciprocal = checked_divisors.setdefault(args[1], f"{args[1]}_reciprocal")
            return f"fadam_divide_root({args[0]}, {args[1]}, {reciprocal})"
        text = _expression(node, args, types)
        return f"fadam_round_bf16({text})" if types[node.index] == torch.bfloat16 else text

    spreads = [n for n in graph.nodes if n.op == "operand" and n.index in needed]
    loops: list[str] = [
        f"fadam_spread(x{n.value}, {scalar_names[('leaf_scalar', n.args[0].value, 'int64_t', False)]}, "
        f"{scalar_names[('leaf_scalar', n.args[1].value, 'int64_t', False)]}, start, count, xv{n.value});"
        for n in spreads
    ]
    loops += [_unpack_blocks(k, q) for k, q in quantized.items() if q.bits == 4]

    def pass_lines(current: int, fast: bool) -> list[str]:
        """The element loop's body of pass ``current``, with the divisions of ``divided`` without dividing if
        ``fast``."""
        names: dict[int, str] = {}
        lines: list[str] = []
        for node in graph.nodes:
            index = node.index
            if index not in needed or not node.elementwise:
                continue
            name = names[index] = f"v{index}"
            if node.op == "operand" and current in uses.get(index, ()):
                read = f"xv{node.value}[j]"  # its row, filled before the passes
                read = f"fadam_from_bf16({read})" if types[index] == torch.bfloat16 else read
                lines.append(f"const {ctype(node)} {name} = {read};")
            elif node.op == "input" and (current in uses.get(index, ()) or index in output_of):
                lines.extend(load(graph.inputs.index(node), node, name))
            elif phase[index] < current and current in uses.get(index, ()):
                lines.append(f"const {ctype(node)} {name} = b{index}[j];")
            elif phase[index] == current and node.op != "input":
                lines.append(f"const {ctype(node)} {name} = {value(node, names, fast)};")
                if index in buffered_indices:
                    lines.append(f"b{index}[j] = {name};")
            if phase[index] == current and index in output_of:
                lines.extend(store(k, node, name) for k in output_of[index])
        lines += [f"a{r.index}[j] = {names[r.args[0].index]};" for r in roots if phase[r.index] == current + 1]
        return lines

    for current in range(passes):
        stored = [
            k
            for n in graph.nodes
            if n.index in needed and n.elementwise and n.index in output_of and phase[n.index] == current
            for k in output_of[n.index]
        ]
        reduced = [k for k in stored if k in quantized]  # the quantized slots this pass stores
        streams = [k for k in stored if streamed and k < slots and k not in quantized]  # the streamed ones
        tops = ", ".join(f"top{k}" for k in reduced)
        header = f"""#pragma omp simd{f" reduction(max : {tops})" if reduced else ""}
      for (int64_t j = {"b0" if quantized else "0"}; j < {"stop" if quantized else "count"}; ++j) {{
        const int64_t at = start + j;
        """
        loop = header + "\n        ".join(pass_lines(current, True)) + "\n      }"
        if any(phase[index] == current for index in divided):
            plain = header + "\n        ".join(pass_lines(current, False)) + "\n      }"
            loop = f"if (fadam_fast_divide) {{\n      {loop}\n      }} else {{\n      {plain}\n      }}"
        if quantized:
            block = next(iter(quantized.values())).block
            before = "".join(f"uint32_t top{k} = 0;\n      " for k in reduced)
            after = "".join(f"\n      tops{k}[b0 / {block}] = top{k};" for k in reduced)
            loop = _block_loop(before + loop + after, quantized, INFINITE)
        loops.append(loop)
        loops += [
            f"fadam_stream_sum(out{k} + start, s{k}, count * {dtypes[first_slot + k].itemsize}, sums + {16 * k});"
            for k in streams
        ]
        for root in roots:
            if phase[root.index] == current + 1:
                loops.append(
                    f"if (sqrt_double) sqrt_double(static_cast<int>(count), a{root.index}, r{root.index});\n"
                    f"      else for (int64_t j = 0; j < count; ++j) r{root.index}[j] = fadam_sqrt(a{root.index}[j]);"
                )
    loops += [_encode_blocks(k, q) for k, q in quantized.items()]
    if streamed:  # the codes just written, while they are in the L1 cache
        loops += [
            f"fadam_fletcher_rows(oc{k} + start, count, sums + {16 * k}, sums + {16 * k + 8});"
            if q.bits == 8
            else f"fadam_fletcher_rows(oc{k} + start / 2, (count + 1) / 2, sums + {16 * k}, sums + {16 * k + 8});"
            for k, q in quantized.items()
        ]
    n_in, n_out = len(graph.inputs), len(traced.outputs)
    out_dtypes = [dtypes[first_slot + k] for k in range(slots)] + [dtypes[0]]
    widths = [3 if k - first_slot in quantized else 1 for k in range(n_in)]
    widths += [3 if k in quantized else 1 for k in range(n_out)]
    offsets = [sum(widths[:k]) for k in range(len(widths))]
    loads: list[str] = []
    for k in range(n_in):
        at = offsets[k]
        if k - first_slot in quantized:
            slot = k - first_slot
            loads += [
                f"const uint8_t* c{slot} = static_cast<const uint8_t*>(pointer[{at}]);",
                f"const float* a{slot} = static_cast<const float*>(pointer[{at + 1}]);",
                f"const float* m{slot} = fadam_maps + {2 * INFINITE} * maps_in[leaf * {len(quantized)} + "
                f"{list(quantized).index(slot)}];",
            ]
        else:
            stored = _STORED[dtypes[k]]
            loads.append(f"const {stored}* in{k} = static_cast<const {stored}*>(pointer[{at}]);")
    for k in range(n_out):
        at = offsets[n_in + k]
        if k in quantized:
            loads += [
                f"uint8_t* oc{k} = static_cast<uint8_t*>(pointer[{at}]);",
                f"float* oa{k} = static_cast<float*>(pointer[{at + 1}]);",
            ]
        else:
            stored = _STORED[out_dtypes[k]]
            loads.append(f"{stored}* out{k} = static_cast<{stored}*>(pointer[{at}]);")
    for n in spreads:
        stored = _STORED[dtypes[n_in + n.value]]
        loads.append(f"const {stored}* x{n.value} = static_cast<const {stored}*>(pointer[{sum(widths) + n.value}]);")
    width = sum(widths) + len(graph.operands)
    map_pointers = [(offsets[first_slot + k] + 2, offsets[n_in + k] + 2, q.map_id) for k, q in quantized.items()]
    scratch = [f"{ctype(n)} b{n.index}[{span}];" for n in buffered]
    scratch += [f"{ctype(r)} a{r.index}[{span}], r{r.index}[{span}];" for r in roots]
    scratch += [f"{_STORED[dtypes[n_in + n.value]]} xv{n.value}[{span}];" for n in spreads]
    scratch += [
        f"float q{k}[{span}]; uint32_t tops{k}[{span // q.block}];"
        + (f" uint8_t e{k}[{span + 1}], u{k}[{span + 1}];" if q.bits == 4 else "")
        for k, q in quantized.items()
    ]
    if streamed:
        scratch += [f"{_STORED[dtypes[first_slot + k]]} s{k}[{span}];" for k in range(slots) if k not in quantized]
    per_leaf = len(graph.leaf_scalars)
    declared = [(op, line.replace("PER_LEAF", str(per_leaf))) for op, line in scalar_names.declarations()]
    step_scalars = [line for op, line in declared if op == "scalar"]
    if checked_divisors:
        low, high = (_literal(bound, "float") for bound in _DIVISOR_RANGE)
        in_range = " && ".join(f"fadam_fabs({d}) >= {low} && fadam_fabs({d}) <= {high}" for d in checked_divisors)
        step_scalars += [f"const float {r} = 1.0f / {d};" for d, r in checked_divisors.items()]
        step_scalars.append(f"const bool fadam_fast_divide = FADAM_FAST_FMA && {in_range};")
    leaf_loads = [line for op, line in declared if op == "leaf_scalar"]
    newline = "\n  "
    chunk_open, chunk_close, join = (
        _stream_sums(slots, chunk, [_bytes_per(dtypes[first_slot + k], formats[k]) for k in range(slots)])
        if streamed
        else ("", "", "")
    )
    chunk_table = (
        f"\n  FadamArray<uint64_t> chunk_sums(chunks * {16 * slots});\n  if (!chunk_sums.data) return -2;"
        if streamed
        else ""
    )
    fence = "\n    fadam_stream_fence();" if streamed else ""
    return f"""#define FADAM_ATEN_FMA {int(_aten_fma())}
{_PRELUDE}{_STREAM if streamed else ""}
{_codec_source(quantized.values())}
extern "C" int64_t fadam_run(int64_t leaves, const int64_t* sizes, void* const* pointers, const double* scalars,
                             const double* leaf_scalars, int64_t threads, SqrtRows sqrt_double,
                             MklThreads mkl_threads{", uint64_t* leaf_sums" if streamed else ""}) {{
  {newline.join(step_scalars)}
  {_read_maps(map_pointers, width)}
  FadamArray<int64_t> first(leaves + 1);  // the first chunk of each leaf
  if (!first.data) return -2;
  for (int64_t leaf = 0; leaf < leaves; ++leaf) first[leaf + 1] = first[leaf] + (sizes[leaf] + {chunk} - 1) / {chunk};
  const int64_t chunks = first[leaves];
  const bool mkl = sqrt_double && mkl_threads;{chunk_table}
#pragma omp parallel num_threads(threads)
  {{
    // MKL would open a parallel region of its own inside each call from this thread
    const int mkl_before = mkl ? mkl_threads(1) : 0;
    {" ".join(scratch)}
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {{
      int64_t leaf = 0;  // the last leaf whose first chunk is at most this one, by bisection
      for (int64_t above = leaves; above - leaf > 1;) {{
        const int64_t middle = leaf + (above - leaf) / 2;
        if (first[middle] <= chunk) leaf = middle; else above = middle;
      }}
      void* const* pointer = pointers + leaf * {width};
      {(newline + "    ").join(loads + leaf_loads)}
      const int64_t begin = (chunk - first[leaf]) * {chunk};
      const int64_t end = fadam_min<int64_t>(begin + {chunk}, sizes[leaf]);{chunk_open}
      for (int64_t start = begin; start < end; start += {span}) {{
      const int64_t count = fadam_min<int64_t>({span}, end - start);
      {(newline + "    ").join(loops)}
      }}{chunk_close}
    }}{fence}
    if (mkl) mkl_threads(mkl_before);
  }}
  {_write_maps(map_pointers, width)}{join}
  return chunks;
}}
"""


def _bytes_per(dtype: torch.dtype, quantized: Quantized | None) -> tuple[int, int]:
    """A slot's stored bytes per element as ``(bytes, elements)``: its dtype's size, or a quantized slot's codes'."""
    return (dtype.itemsize, 1) if quantized is None else (1, 8 // quantized.bits)


def _stream_sums(slots: int, chunk: int, slot_bytes: list[tuple[int, int]]) -> tuple[str, str, str]:
    """A streamed kernel's sums: zeroed at each chunk's start, kept per chunk at its end, then joined leaf by leaf
    in order (``fadam.paging._checksum``: a run of rows that ends at row ``end`` of ``rows`` weighs its ``s1`` by
    ``rows - end`` in the leaf's ``s2``). Every chunk but a leaf's last is whole 64-byte rows. ``slot_bytes``:
    ``_bytes_per`` of each slot (``n`` elements store ``ceil(n * bytes / elements)`` bytes)."""
    widths = ", ".join(str(b) for b, _ in slot_bytes)
    per = ", ".join(str(e) for _, e in slot_bytes)
    chunk_open = f"\n      uint64_t sums[{16 * slots}] = {{0}};"
    chunk_close = f"\n      std::memcpy(chunk_sums.data + chunk * {16 * slots}, sums, sizeof sums);"
    join = f"""
  const int64_t widths[{slots}] = {{{widths}}}, per[{slots}] = {{{per}}};
  for (int64_t leaf = 0; leaf < leaves; ++leaf) {{
    for (int64_t k = 0; k < {slots}; ++k) {{
      const int64_t rows = ((sizes[leaf] * widths[k] + per[k] - 1) / per[k] + 63) / 64;
      uint64_t* found = leaf_sums + (leaf * {slots} + k) * 16;
      std::memset(found, 0, 16 * sizeof(uint64_t));
      for (int64_t c = first[leaf]; c < first[leaf + 1]; ++c) {{
        const uint64_t* part = chunk_sums.data + c * {16 * slots} + k * 16;
        const int64_t stop = fadam_min<int64_t>((c - first[leaf] + 1) * {chunk}, sizes[leaf]);
        const uint64_t after = static_cast<uint64_t>(rows - ((stop * widths[k] + per[k] - 1) / per[k] + 63) / 64);
        fadam_fletcher_join(found, found + 8, part, part + 8, after);
      }}
    }}
  }}"""
    return chunk_open, chunk_close, join


def _read_maps(map_pointers: list[tuple[int, int, int]], width: int) -> str:
    """Reads every quantized slot's stored map id before any code is written (a donated step writes them in place),
    refusing an unknown one before anything changes."""
    from fadam.quantization._maps import MAP_IDS

    if not map_pointers:
        return ""
    count = len(map_pointers)
    reads = " ".join(
        f"maps_in[leaf * {count} + {k}] = *static_cast<const uint8_t*>(pointers[leaf * {width} + {read}]);"
        for k, (read, _, _) in enumerate(map_pointers)
    )
    return f"""FadamArray<int64_t> maps_in(leaves * {count});
  if (!maps_in.data) return -2;
  for (int64_t leaf = 0; leaf < leaves; ++leaf) {{ {reads} }}
  for (int64_t j = 0; j < leaves * {count}; ++j) if (maps_in[j] < 0 || maps_in[j] >= {len(MAP_IDS)}) return -1;"""


def _write_maps(map_pointers: list[tuple[int, int, int]], width: int) -> str:
    writes = " ".join(
        f"*static_cast<uint8_t*>(pointers[leaf * {width} + {write}]) = {map_id};" for _, write, map_id in map_pointers
    )
    return f"for (int64_t leaf = 0; leaf < leaves; ++leaf) {{ {writes} }}" if map_pointers else ""


def _block_loop(loop: str, quantized: dict[int, Quantized], infinite: int) -> str:
    """``loop`` (an element loop from ``b0`` to ``stop``) run block by block over a pass: before each block, every
    quantized slot's block scale is read once into ``w`` (its magnitude) and ``o`` (the offset of the map's values
    for a block holding an infinity, where the scale is negative), so the loop decodes with one table read per
    element and no per-element select."""
    block = next(iter(quantized.values())).block
    reads = "\n        ".join(
        f"const float scale{k} = a{k}[(start + b0) / {block}];\n        "
        f"const int32_t o{k} = scale{k} < 0.0f ? {infinite} : 0;\n        "
        f"const float w{k} = fadam_fabs(scale{k});"
        for k in quantized
    )
    return f"""for (int64_t b0 = 0; b0 < count; b0 += {block}) {{
        const int64_t stop = fadam_min<int64_t>(b0 + {block}, count);
        {reads}
      {loop}
      }}"""


def _unpack_blocks(k: int, q: Quantized) -> str:
    """At 4 bits, the loop that spreads slot ``k``'s codes of a pass one per byte (``u``): the element loops then
    read them at unit stride, which the compiler vectorizes (8-bit codes are read in place)."""
    if q.bits == 8:
        return ""
    return f"""for (int64_t j = 0; j < (count + 1) / 2; ++j) {{
        const uint8_t byte = c{k}[start / 2 + j];
        u{k}[2 * j] = byte & 15;
        u{k}[2 * j + 1] = byte >> 4;
      }}"""


def _encode_blocks(k: int, q: Quantized) -> str:
    """The loop that quantizes slot ``k``'s new values of a pass, block by block, as ``quantize_blockwise`` does:
    the block's scale (its largest finite magnitude, negated with a floor of 2**-126 where it holds an infinity),
    then each element's code for ``x * (1 / scale)`` (times the map's top below 1 in a block holding an infinity),
    NaN as 0, clamped to [-1, 1]; 4-bit codes two per byte, a ragged block padded with the code of 0.

    The common block takes a short path with the same results: its largest magnitude is found as the largest bit
    pattern of the magnitudes (``top``, a reduction in the element loop that stores the values: integers order
    non-negative floats as the floats do; a NaN or an infinity lies above every finite pattern), and where that is
    finite and ``1 / scale`` too, no ``x * (1 / scale)`` is NaN or infinite, so the clamp to [-1, 1] is an integer
    minimum of the magnitude's pattern with that of 1.0. Blocks holding a NaN or an infinity, or with a subnormal
    scale, take the general loops."""
    codes = f"oc{k} + start + b0" if q.bits == 8 else f"e{k}"
    write = (
        ""
        if q.bits == 8
        else f"""
        if (length & 1) e{k}[length] = fadam_encode{q.map_id}(0.0f);
        for (int64_t j = 0; j < (length + 1) / 2; ++j) {{
          oc{k}[(start + b0) / 2 + j] = static_cast<uint8_t>(e{k}[2 * j] | (e{k}[2 * j + 1] << 4));
        }}"""
    )
    return f"""for (int64_t b0 = 0; b0 < count; b0 += {q.block}) {{
        const int64_t length = fadam_min<int64_t>({q.block}, count - b0);
        const float* values = q{k} + b0;
        uint8_t* codes = {codes};
        const uint32_t top = tops{k}[b0 / {q.block}];  // the largest magnitude pattern, from the pass that stored it
        float finite = 0.0f;
        int infinite = 0;
        if (top < 0x7F800000u) {{
          std::memcpy(&finite, &top, 4);
        }} else {{
          for (int64_t j = 0; j < length; ++j) {{
            const float magnitude = fadam_fabs(values[j]);
            finite = magnitude < FADAM_INFINITY && finite < magnitude ? magnitude : finite;
            infinite |= magnitude == FADAM_INFINITY;
          }}
        }}
        const float absmax = infinite ? -(finite < FLT_MIN ? FLT_MIN : finite) : finite;
        const float scale = fadam_fabs(absmax);
        float inverse = 1.0f / (scale > 0.0f ? scale : 1.0f);
        if (absmax < 0.0f) inverse = inverse * {_literal(_finite_top(q.map_id), "float")};
        if (top < 0x7F800000u && inverse <= FLT_MAX) {{
#pragma omp simd
          for (int64_t j = 0; j < length; ++j) {{
            const float y = values[j] * inverse;
            uint32_t bits;
            std::memcpy(&bits, &y, 4);
            const uint32_t magnitude = bits & 0x7FFFFFFFu;
            const uint32_t unit = magnitude < 0x3F800000u ? magnitude : 0x3F800000u;
            codes[j] = static_cast<uint8_t>(fadam_code{q.map_id}(bits, unit));
          }}
        }} else {{
#pragma omp simd
          for (int64_t j = 0; j < length; ++j) {{
            const float y = values[j] * inverse;
            const float unit = y != y ? 0.0f : (y < -1.0f ? -1.0f : (1.0f < y ? 1.0f : y));
            codes[j] = static_cast<uint8_t>(fadam_encode{q.map_id}(unit));
          }}
        }}{write}
        oa{k}[(start + b0) / {q.block}] = absmax;
      }}"""


def _finite_top(map_id: int) -> float:
    from fadam.quantization._maps import finite_tops

    return float(finite_tops()[map_id])


def _float_array(name: str, values: list[float]) -> str:
    items = ", ".join(_literal(v, "float") for v in values)
    return f"static const float {name}[{len(values)}] = {{{items}}};"


def _codec_source(formats: Iterable[Quantized]) -> str:
    """The decoding tables of every map and an encoder per map that the kernel writes with (``_encoder_table``)."""
    from fadam.quantization._maps import MAP_IDS, code_maps

    formats = list(formats)
    if not formats:
        return ""
    parts = ["#include <cfloat>", _float_array("fadam_maps", code_maps().reshape(-1).tolist())]
    for map_id in sorted({f.map_id for f in formats}):
        base, entries, negation = _encoder_table(map_id)
        items = ", ".join(str(e) for e in entries)
        parts.append(f"static const uint32_t fadam_codes{map_id}[{len(entries)}] = {{{items}}};")
        code = (
            f"const uint32_t s = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31);  // all ones if negative\n"
            f"  return ((u ^ s) + (s & {negation}u)) >> 17;"
            if negation is not None
            else "return (bits >> 31) ? 0 : u >> 17;"
        )
        parts.append(
            f"""// the code of the float with sign and bits ``bits`` and magnitude pattern ``magnitude``, at most 1.0's
static inline int fadam_code{map_id}(uint32_t bits, uint32_t magnitude) {{  // ({list(MAP_IDS)[map_id]})
  const uint32_t m = fadam_min<uint32_t>(fadam_max<uint32_t>(magnitude, {base << 16}u), 0x3F800000u);
  // a signed index: compilers vectorize table reads (gathers) with 32-bit signed indices
  const uint32_t u = fadam_codes{map_id}[static_cast<int32_t>(m >> 16) - {base}] + m;
  {code}
}}
static inline int fadam_encode{map_id}(float y) {{  // y in [-1, 1], not NaN
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  return fadam_code{map_id}(bits, bits & 0x7FFFFFFFu);
}}"""
        )
    return "\n".join(parts)


@functools.cache
def _encoder_table(map_id: int) -> tuple[int, list[int], int | None]:
    """``(base, entries, negation)`` of the kernel's encoder for ``map_id``, which finds a code with one table read
    and no comparison.

    For each bfloat16 pattern ``P`` of a magnitude (the top 16 bits of its float32) from ``base`` to 1.0's, let
    ``below`` count the map's positive midpoints under ``P``'s smallest float and ``mid`` hold the low 16 bits of the
    one midpoint inside ``P`` (``0x10000``: none; no pattern holds two, which is checked here). Then ``entry = ((zero +
    below) << 17) + 0x1FFFF - mid - (P << 16)`` modulo 2**32. A magnitude ``m`` of pattern ``P`` (``low = m - (P <<
    16)``) gives ``u = entry + m = ((zero + below) << 17) + (0x1FFFF - mid + low)``, whose last term lies in
    ``[0xFFFF, 0x2FFFE]`` and reaches ``0x20000`` exactly when ``low > mid``: ``u >> 17`` is ``zero + below + (low >
    mid)``, the count of midpoints below ``m`` plus the code of 0, so the nearest code of ``+m``. For ``-m``, ``(K - u)
    >> 17`` with ``K = (2 zero << 17) + 0x1FFFE`` is ``zero - below - (low >= mid)`` (the codec's nearest code, ties to
    the lower one); with ``s`` all ones for a negative ``y`` and zero otherwise, ``K - u = (u ^ s) + (s & (K + 1))``,
    and ``negation`` is ``K + 1`` (``None`` for an unsigned map, whose negative numbers take code 0). Magnitudes under
    ``base``'s pattern, which hold no midpoint, are raised to its smallest float."""
    from fadam.quantization._maps import _GRIDS, encode_tables, tables_on

    tables_on("cpu")  # builds the grids
    grid = _GRIDS[map_id]
    mids = encode_tables()[1][map_id, grid.zero : grid.zero + grid.top].view(torch.int32).tolist()
    base = (mids[0] >> 16) - 1
    top = 0x3F80  # the pattern of 1.0, the largest magnitude encoded
    entries = []
    below = 0
    for pattern in range(base, top + 1):
        while below < len(mids) and mids[below] < pattern << 16:
            below += 1
        inside = below < len(mids) and mids[below] >> 16 == pattern
        if inside and below + 1 < len(mids) and mids[below + 1] >> 16 == pattern:
            raise AssertionError("two midpoints in one bfloat16 pattern: the kernel's encoder is invalid")
        mid = (mids[below] & 0xFFFF) if inside else 0x10000
        entries.append((((grid.zero + below) << 17) + 0x1FFFF - mid - (pattern << 16)) % (1 << 32))
    negation = ((2 * grid.zero) << 17) + 0x1FFFF if grid.signed else None
    return base, entries, negation


def _reachable(outputs: tuple[Node, ...]) -> set[int]:
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node.index not in seen:
            seen.add(node.index)
            stack.extend(node.args)
    return seen


@functools.cache
def _aten_fma() -> bool:
    """Whether ATen's vectorized CPU kernels round a multiply-add once: its AVX2 and AVX-512 builds and ARM's NEON."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability.startswith(("AVX2", "AVX512")) or platform.machine().lower() in ("aarch64", "arm64")


@functools.cache
def _mkl_functions() -> tuple[int, int]:
    """The addresses of MKL's ``vdSqrt`` and ``MKL_Set_Num_Threads_Local`` in torch's CPU library, which its CPU
    float64 sqrt calls where torch links MKL (0 where it does not): the kernels call them too, so that their float64
    square roots round as the eager path's (MKL's last bit differs from the IEEE root for 1% of inputs or more, by
    CPU). Float32 roots are the IEEE ones on both paths (``fadam._program._mkl_float32``)."""
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return 0, 0
    found = []
    for name in ("vdSqrt", "MKL_Set_Num_Threads_Local"):
        function = getattr(library, name, None)
        found.append(ctypes.cast(function, ctypes.c_void_p).value or 0 if function is not None else 0)
    return found[0], found[1]


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$FADAM_CACHE_DIR``, else ``fadam`` under the user's cache directory."""
    configured = os.environ.get("FADAM_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fadam"


@functools.cache
def _compiler() -> tuple[str, str] | None:
    """The C++ compiler's path and its version line, or ``None`` if there is none."""
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(candidate) if candidate else None
        if path:
            try:
                version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            return path, version.splitlines()[0] if version else ""
    return None


@functools.cache
def _machine() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's model and feature flags."""
    described = platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    described += line
                if line.strip() == "":
                    break
    except OSError:
        described += platform.processor()
    return described


class Kernel:
    """A compiled segment: ``run`` calls it on a table of leaf pointers."""

    def __init__(self, library: ctypes.CDLL, streamed: bool = False) -> None:
        self.streamed = streamed
        self._function = library.fadam_run
        pointers = 3 if streamed else 2
        self._function.argtypes = [
            ctypes.c_int64,
            *[ctypes.c_void_p] * 4,
            ctypes.c_int64,
            *[ctypes.c_void_p] * pointers,
        ]
        self._function.restype = ctypes.c_int64
        self._library = library  # keeps the library loaded while the function is referenced
        self._mkl = [address or None for address in _mkl_functions()]

    def run(
        self,
        leaves: list[list[torch.Tensor]],
        scalars: list[float],
        leaf_scalars: list[float],
        sums: torch.Tensor | None = None,
    ) -> None:
        """Runs on ``leaves`` (per leaf: the inputs, then the outputs, all contiguous, of the kernel's dtype), with
        ``leaf_scalars`` holding each leaf's own scalars in turn. A streamed kernel puts the sums of the slots it
        wrote in ``sums`` (int64, contiguous, leaves x slots x 16: ``source``'s ``leaf_sums``)."""
        sizes = array.array("q", [row[0].numel() for row in leaves])
        checks = compiled_checks()
        if checks is not None:
            pointers = array.array("Q")
            pointers.frombytes(checks.data_pointers(leaves))
        else:
            pointers = array.array("Q", [t.data_ptr() for row in leaves for t in row])
        values = array.array("d", scalars or [0.0])
        leaf_values = array.array("d", leaf_scalars or [0.0])
        total = sum(sizes)
        threads = 1 if total < _SERIAL_BELOW else torch.get_num_threads()
        status = self._function(
            len(leaves),
            sizes.buffer_info()[0],
            pointers.buffer_info()[0],
            values.buffer_info()[0],
            leaf_values.buffer_info()[0],
            threads,
            *self._mkl,
            *([sums.data_ptr()] if self.streamed else []),
        )
        if status == -2:
            raise MemoryError("the generated kernel could not allocate its table of chunks; nothing was written")
        if status < 0:
            raise ValueError("quantized state names an unknown map (map_id); nothing was written")


NO_COMPILER = "no C++ compiler found (set CXX)"


def unbuildable() -> str | None:
    """Why no generated CPU kernel can be built here (``NO_COMPILER``), or ``None`` where a compiler is found (a
    build may still fail: ``_library`` warns then)."""
    return NO_COMPILER if _compiler() is None else None


def _library(text: str) -> ctypes.CDLL | None:
    """The shared library compiled from ``text`` (from the disk cache where it is there), or ``None``."""
    compiler = _compiler()
    if compiler is None:
        _warn_once(NO_COMPILER)
        return None
    described = "\0".join([text, *compiler, " ".join(_flags(compiler[1])), _machine()])
    key = hashlib.sha256(described.encode()).hexdigest()[:24]
    folder = cache_dir() / "kernels"
    library_path = folder / f"{key}.so"
    if not library_path.exists():
        try:
            _compile(compiler, text, folder, library_path)
        except (OSError, subprocess.SubprocessError) as err:
            _warn_once(f"compiling a kernel failed ({err})")
            return None
    return ctypes.CDLL(str(library_path))


@functools.lru_cache(maxsize=512)
def _load_source(text: str, streamed: bool = False) -> Kernel | None:
    library = _library(text)
    return None if library is None else Kernel(library, streamed)


def _compile(compiler: tuple[str, str], text: str, folder: Path, target: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as scratch:
        src = Path(scratch) / "kernel.cpp"
        src.write_text(text)
        built = Path(scratch) / "kernel.so"
        command = [compiler[0], *_flags(compiler[1]), str(src), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip().splitlines()[-1] if result.stderr else "failed")
        os.replace(built, target)  # atomic: another process loading the same key sees a whole library or none


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"fadam: {reason}; composed steps run eagerly", stacklevel=_caller_level())


# fadam's files and torch's wrappers (each folder with its separator: a user's ``fadam_train.py`` beside the package
# is not inside it)
_INSIDE = (os.path.join(Path(__file__).parent, ""), os.path.join(Path(torch.__file__).parent, ""))


def _caller_level() -> int:
    """The ``stacklevel`` that makes a warning from ``_warn_once`` name the line of the code that called fadam,
    however deep inside fadam (and torch's wrappers, such as ``torch.compiler.disable``'s) the warning arose."""
    frame, level = sys._getframe(2), 2  # _warn_once is level 1 (its frame is 1 here), its caller 2
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def load(
    traced: Traced, dtypes: tuple[torch.dtype, ...], formats: Formats = (), streamed: bool = False
) -> Kernel | None:
    """The compiled kernel of ``traced`` for inputs of ``dtypes`` and slot ``formats`` (built on first use), or
    ``None`` without a compiler; ``streamed``: ``source``'s."""
    return _load_source(source(traced, dtypes, formats, streamed), streamed)
