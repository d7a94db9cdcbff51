"""The generated Triton backend: one Triton kernel per traced program segment and dtype, for GPU leaves.

``load(traced, dtypes)`` writes the segment's kernel as Python source under ``cache_dir() / "triton"`` (``triton.jit``
reads a function's source from its file) and imports it; ``TritonKernel.run(rows, scalars, leaf_scalars)`` takes
the arguments of ``fadam._cpu_kernel.Kernel.run`` and launches it once for a whole group of leaves: a table of the
leaves' data pointers, sizes and first blocks, and a map from each program (a block of ``BLOCK`` elements) to its
leaf, so that a program loads its leaf's pointers from the table and runs the graph over its block.

Each node computes as the C++ backend computes it (``fadam._cpu_kernel``, whose dtype rules this module reuses):
float32 and float64 as they are, bfloat16 loaded into float32 and rounded to nearest even after every operation
(by bit arithmetic, so the same on the GPU and in Triton's interpreter), numbers rounded to bfloat16 where ATen rounds
them. Every step's scalars, each leaf's scalars and the graph's constants travel as doubles in one float64 tensor and
are cast in the kernel, as the C++ backend casts them. Square roots and divisions are the IEEE ones
(``tl.sqrt_rn``, ``tl.div_rn`` in float32), the launch disables Triton's contraction of multiplies and adds
(``enable_fp_fusion=False``), and torch.lerp, torch.addcmul and torch.add's alpha are fused multiply-adds where the
caller says ATen's kernels fuse them (``fma``): its CUDA kernels, compiled with nvcc's default contraction, are
expected to (not yet checked on a GPU); its CPU ones do per ``fadam._cpu_kernel._aten_fma``.

Tested here, on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, which computes in numpy, with true
fused multiply-adds) against the eager path, per step (``tests/test_triton_kernel.py``): float32, float64 and bfloat16
results bit for bit where the eager path's square roots are IEEE ones, as its float32 and bfloat16 ones are; with
torch's CPU float64 square root (MKL's, whose last bit differs for 1% of inputs or more, by CPU), which the eager path
takes, the state is still bit for bit, the params within 2 ulps of the update beyond their own rounding and the
updates within 4 ulps of their largest magnitude. The interpreter takes the pointer table (an int64 tensor of
addresses cast with ``.to(tl.pointer_type(...))``) as the GPU does, so the tests run the one launch per group that a
GPU runs.

Blockwise-quantized slots (``fadam.quantization``, 8 or 4 bits) are decoded, stepped and encoded in the same launch:
a program then holds whole quantization blocks (``_Layout``: blocks of ``BLOCK`` elements or more one each, smaller
ones several, one block a row of its tensors, a leaf's ragged last block masked). It decodes each block as
``dequantize_blockwise`` (its map's value of each code, from the map's values for a block holding an infinity where
the stored scale is negative, times the scale's magnitude), runs the body, and encodes the new values with the slot's
map as ``quantize_blockwise`` does, in the same float32 operations on the same tables: each block's scale (its largest
finite magnitude, negated and at least 2**-126 where it holds an infinity; a maximum, the same in any order),
``x * (1 / scale)`` (times the map's top below 1 there), NaN as 0, clamped to [-1, 1], then the codec's first guess per
bfloat16 pattern and its midpoint above (ties to the lower code), 4-bit codes two a byte (low nibble first, a ragged
block padded with the code of 0); the leaf's first program writes the slot's map id. The stored map ids are copied
before the launch (``TritonKernel._codec``), since a donated step writes the new ones in place. So the codes, scales
and map ids equal the eager path's bit for bit wherever the new values do (tested in the interpreter, with ties at
every midpoint, infinities and NaNs; float32 and bfloat16 params, kept and donated).

``fadam._execute`` runs it for CUDA leaves (and, under ``fadam.backend("triton")``, for CPU leaves in the
interpreter), one launch per group of leaves and device. No CUDA run has been made: on the GPU, torch.rsqrt is the
hardware's reciprocal square root, not ``1 / sqrt`` as here and on the CPU, so a body that calls ``o.rsqrt`` is
expected to differ from CUDA's eager path in the last bits.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch

from fadam._cpu_kernel import (
    _COMPUTED_IN,
    KERNEL_DTYPES,
    Formats,
    Quantized,
    _finite_top,
    _node_dtypes,
    _operand_dtype,
    _reachable,
    cache_dir,
    read_as,
)
from fadam._program import Node, Traced

BLOCK = 1024  # elements per program: 8 per thread of 4 warps
LARGEST_BLOCK = 1 << 20  # the largest quantization block a program holds: Triton's largest block
_TL = {"float": "tl.float32", "double": "tl.float64", "int64_t": "tl.int64"}  # a C type's Triton type
_POINTEE = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.bfloat16: "tl.int16"}  # bits in memory

# Each helper computes in its arguments' Triton type; between equal values maximum and minimum take the second
# operand, and NaN propagates, as torch's ops do (the same rules as the C++ backend's prelude).
_PRELUDE = '''\
import triton
import triton.language as tl


@triton.jit
def fadam_round_bf16(x):
    """x rounded to the nearest bfloat16 (ties to even), kept in float32; NaN stays a quiet NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    quiet = (bits | 0x00400000) & 0xFFFF0000
    return tl.where(x != x, quiet, rounded).to(tl.float32, bitcast=True)


@triton.jit
def fadam_load_bf16(pointer, mask, other):
    bits = tl.load(pointer, mask=mask, other=other).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def fadam_store_bf16(pointer, rounded, mask):
    bits = (rounded.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
    tl.store(pointer, bits.to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def fadam_maximum(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a > b, a, b)))


@triton.jit
def fadam_minimum(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a < b, a, b)))


@triton.jit
def fadam_clamp(x, low, high):
    raised = tl.where(x < low, low, x)
    return tl.where(x != x, x, tl.where(high < raised, high, raised))


@triton.jit
def fadam_sign(x):
    one = tl.full(x.shape, 1, x.dtype)
    return tl.where(x > 0, one, tl.where(x < 0, -one, one - one))


@triton.jit
def fadam_mul_add(a, b, c, FMA: tl.constexpr):
    if FMA:
        return tl.fma(a, b, c)
    else:
        return a * b + c


@triton.jit
def fadam_lerp(start, end, weight, FMA: tl.constexpr):
    small = tl.abs(weight) < 0.5
    return fadam_mul_add(tl.where(small, weight, weight - 1), end - start, tl.where(small, start, end), FMA)


@triton.jit
def fadam_decode(codes, scale, values, mask):
    """A block row's values: its codes' entries of ``values`` (the map's row of code_maps, from its entries for a
    block holding an infinity where the scale is negative) times the scale's magnitude, as dequantize_blockwise."""
    return tl.load(values + codes, mask=mask, other=0.0) * tl.abs(scale)[:, None]


@triton.jit
def fadam_absmax(x):
    """Each row's scale, as the codec's row_absmax: its largest finite magnitude, or for a row holding an infinity
    that raised to at least 2**-126 and negated (a NaN is neither). Reduced by tl.max's own combine function, which
    Triton's interpreter reduces with numpy (any other element by element), rather than by tl.max, a function of
    Triton's library that its interpreter runs only where Triton was imported under TRITON_INTERPRET=1; the largest
    of magnitudes is the same in any order."""
    magnitude = tl.abs(x)
    finite = tl.where(magnitude <= 3.4028234663852886e38, magnitude, 0.0)
    largest = tl.reduce(finite, 1, tl.standard._elementwise_max)
    infinite = tl.reduce(tl.where(magnitude > 3.4028234663852886e38, 1, 0), 1, tl.standard._elementwise_max) > 0
    return tl.where(infinite, -tl.maximum(largest, 1.1754943508222875e-38), largest)


@triton.jit
def fadam_codes(x, absmax, top, guesses, thresholds):
    """The nearest codes of each row of ``x`` for its scale, as the codec's encode_scaled picks them: y = x * (1 /
    scale) (times ``top``, the map's largest value below 1, in a row holding an infinity), NaN as 0, clamped to
    [-1, 1]; then its encode tables' two reads (``guesses``, ``thresholds``: the map's rows), a first guess per
    bfloat16 pattern of y and one more code where y lies above the midpoint over it (ties to the lower code)."""
    scale = tl.abs(absmax)
    inverse = tl.div_rn(tl.full(scale.shape, 1, tl.float32), tl.where(scale > 0, scale, 1.0))
    inverse = tl.where(absmax < 0, inverse * top, inverse)
    y = x * inverse[:, None]
    y = tl.where(y != y, 0.0, tl.minimum(tl.maximum(y, -1.0), 1.0))
    guess = tl.load(guesses + ((y.to(tl.int32, bitcast=True) >> 16) & 0xFFFF)).to(tl.int32)
    return guess + tl.where(y > tl.load(thresholds + guess), 1, 0)


@triton.jit
def fadam_pack4(codes):
    """4-bit codes two per byte along each row, the first of a pair in the low nibble."""
    low, high = tl.split(tl.reshape(codes, (codes.shape[0], codes.shape[1] // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)
'''

_BINARY = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "gt": ">", "le": "<=", "ge": ">="}
_UNARY = {"neg": "-{}", "abs": "tl.abs({})", "sign": "fadam_sign({})"}
_CALLS = {
    "maximum": "fadam_maximum({}, {})",
    "minimum": "fadam_minimum({}, {})",
    "where": "tl.where({}, {}, {})",
    "clamp": "fadam_clamp({}, {}, {})",
    "lerp": "fadam_lerp({}, {}, {}, FMA)",
    "addcmul": "fadam_mul_add({3} * {1}, {2}, {0}, FMA)",  # torch.addcmul(c, a, b, value=v): fma(v * a, b, c)
    "add_scaled": "fadam_mul_add({1}, {2}, {0}, FMA)",  # torch.add(a, b, alpha=k): fma(b, k, a)
}


@functools.cache
def installed() -> bool:
    """Whether the ``triton`` package can be imported (imported once, on first need: it takes a while)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreted() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def runs_on(device: torch.device) -> bool:
    """Whether this backend runs leaves on ``device``: CUDA ones, and CPU ones under ``TRITON_INTERPRET=1``, where
    Triton's interpreter runs kernels on the CPU (slowly: for tests, and to see on any machine what a GPU computes)."""
    if device.type not in ("cuda", "cpu") or not installed():
        return False
    return device.type == "cuda" or _interpreted()


def takes_blocks(bits: int, block: int) -> bool:
    """Whether this backend generates slots quantized to ``bits`` in blocks of ``block`` elements: 8 or 4 bits, an
    even block (whose 4-bit codes fill whole bytes) that one program holds (Triton's blocks hold at most 2**20
    elements, rounded up to a power of two)."""
    return bits in (8, 4) and 2 <= block <= LARGEST_BLOCK and block % 2 == 0


def supports(formats: Formats) -> bool:
    """Whether this backend takes slots of ``formats``: plain tensors, and quantized ones of one block size that
    ``takes_blocks`` admits."""
    quantized = [f for f in formats if f is not None]
    return len({f.block for f in quantized}) <= 1 and all(takes_blocks(f.bits, f.block) for f in quantized)


def _divide(a: str, b: str, ctype: str) -> str:
    return f"tl.div_rn({a}, {b})" if ctype == "float" else f"{a} / {b}"  # float32's `/` may be approximate on GPUs


def _sqrt(x: str, ctype: str) -> str:
    return f"tl.sqrt_rn({x})" if ctype == "float" else f"tl.sqrt({x})"  # float64's is always correctly rounded


class _Scalars:
    """The kernel's names for the scalars and constants it reads, declared on first use: per computed type, and
    rounded to bfloat16 where an operation rounds them. Constants take places after the step's scalars in the values
    tensor, each leaf's scalars after them."""

    def __init__(self, step_count: int) -> None:
        self._step_count = step_count
        self._names: dict[tuple[str, int, str, bool], str] = {}
        self.constants: list[float] = []
        self._constant_at: dict[int, int] = {}  # a constant node -> its index in ``constants``

    def name(self, node: Node, ctype: str, rounds: bool) -> str:
        index = node.value if node.op != "const" else self._constant(node)
        key = (node.op, index, ctype, rounds)
        if key not in self._names:
            self._names[key] = f"{node.op[0]}{index}_{ctype[0]}{'b' if rounds else ''}"
        return self._names[key]

    def _constant(self, node: Node) -> int:
        if node.index not in self._constant_at:
            self._constant_at[node.index] = len(self.constants)
            self.constants.append(node.value)
        return self._constant_at[node.index]

    def declarations(self, per_leaf: int, shape: str) -> list[str]:
        lines = []
        first_leaf = self._step_count + len(self.constants)
        for (op, index, ctype, rounds), name in self._names.items():
            if op == "scalar":
                at = str(index)
            elif op == "const":
                at = str(self._step_count + index)
            else:
                at = f"{first_leaf} + leaf * {per_leaf} + {index}"
            value = f"tl.load(values + {at}).to({_TL[ctype]})"
            value = f"fadam_round_bf16({value})" if rounds else value
            lines.append(f"{name} = tl.broadcast_to({value}, {shape})")
        return lines


def _argument(node: Node, position: int, names: dict[int, str], types: dict, scalars: _Scalars) -> str:
    """How ``node`` reads its argument ``position``: a value by its name, promoted to ``node``'s computed type, or a
    number in that type (``fadam._cpu_kernel._argument``'s rules)."""
    arg = node.args[position]
    dtype, rounds = read_as(node, position, types)
    if arg.elementwise:
        if dtype is None:
            return names[arg.index]
        return f"{names[arg.index]}.to({_TL[_COMPUTED_IN[dtype]]})"  # float32 promoted to float64: exact
    return scalars.name(arg, _COMPUTED_IN[dtype], rounds)


def _expression(node: Node, args: list[str], types: dict) -> str:
    ctype = _COMPUTED_IN[_operand_dtype(node, types)]
    if node.op in _BINARY:
        return f"{args[0]} {_BINARY[node.op]} {args[1]}"
    if node.op in _UNARY:
        return _UNARY[node.op].format(args[0])
    if node.op in _CALLS:
        return _CALLS[node.op].format(*args)
    if node.op == "div":
        return _divide(args[0], args[1], ctype)
    if node.op == "reciprocal":
        return _divide(f"tl.full({args[0]}.shape, 1, {_TL[ctype]})", args[0], ctype)
    if node.op == "sqrt":
        return _sqrt(args[0], ctype)
    if node.op == "rsqrt":  # torch.rsqrt on the CPU: 1 / the IEEE square root
        return _divide(f"tl.full({args[0]}.shape, 1, {_TL[ctype]})", _sqrt(args[0], ctype), ctype)
    if node.op == "cast":
        return args[0]  # _argument converted it to the target's computed type; a bfloat16 one rounds after
    raise ValueError(f"no Triton for the operation {node.op}")


class _Layout(NamedTuple):
    """Where a kernel's slots lie in each leaf's row of the pointer table, and how a program holds its elements:
    ``(BLOCK,)`` of them in a plain kernel; in a quantized one, ``rows`` quantization blocks of ``block`` elements,
    a row of the program's tensors each, ``columns`` wide (the block rounded up to a power of two)."""

    first_slot: int  # the graph's input of the first slot
    quantized: dict[int, Quantized]  # slot -> its format
    block: int
    rows: int
    columns: int

    @property
    def span(self) -> int:
        """The elements of a leaf that one program holds."""
        return self.rows * self.block if self.quantized else BLOCK

    @property
    def shape(self) -> str:
        return f"({self.rows}, {self.columns})" if self.quantized else "(BLOCK,)"

    def widths(self, count: int, slot_of: Callable[[int], int]) -> list[int]:
        """The table entries of ``count`` tensors: three for a quantized slot's codes, absmax and map id."""
        return [3 if slot_of(k) in self.quantized else 1 for k in range(count)]


def _layout(traced: Traced, formats: Formats) -> _Layout:
    slots = len(traced.outputs) - 1
    quantized = {k: f for k, f in enumerate(formats) if f is not None}
    block = next(iter(quantized.values())).block if quantized else BLOCK
    columns = 1 << (block - 1).bit_length()
    return _Layout(len(traced.graph.inputs) - slots, quantized, block, max(1, BLOCK // columns), columns)


def _decode(slot: int, name: str, layout: _Layout) -> list[str]:
    """Slot ``slot``'s values in the program's blocks from their codes, scales and the leaf's map (``maps_in``: the
    map ids read before the launch), as ``dequantize_blockwise`` decodes them."""
    from fadam.quantization._maps import INFINITE

    q = layout.quantized[slot]
    if q.bits == 8:
        lines = [f"k{slot} = tl.load(c{slot} + at, mask=mask, other=0).to(tl.int32)"]
    else:  # two codes a byte, the first in the low nibble
        lines = [f"k{slot} = tl.load(c{slot} + at // 2, mask=mask, other=0).to(tl.int32)"]
        lines.append(f"k{slot} = tl.where(at % 2 == 0, k{slot} & 15, k{slot} >> 4)")
    stored = list(layout.quantized).index(slot)  # where the leaf's map id lies in ``maps_in``
    return [
        *lines,
        f"w{slot} = tl.load(a{slot} + blocks, mask=held, other=0.0)",
        f"m{slot} = code_maps + tl.load(maps_in + leaf * {len(layout.quantized)} + {stored}).to(tl.int32) * "
        f"{2 * INFINITE} + tl.where(w{slot} < 0, {INFINITE}, 0)[:, None]",
        f"{name} = fadam_decode(k{slot}, w{slot}, m{slot}, mask)",
    ]


def _encode(slot: int, name: str, layout: _Layout) -> list[str]:
    """Stores ``name`` as slot ``slot``'s new blocks, as ``quantize_blockwise`` encodes them with the slot's map:
    the elements past the leaf's end count as zeros (the codec pads a ragged block so); the leaf's first program
    writes the map id."""
    from fadam.quantization._maps import encode_tables

    q = layout.quantized[slot]
    guesses, thresholds = (table.shape[-1] * q.map_id for table in encode_tables())  # the map's rows
    lines = [
        f"x{slot} = tl.where(mask, {name}, 0.0)",
        f"s{slot} = fadam_absmax(x{slot})",
        f"e{slot} = fadam_codes(x{slot}, s{slot}, {_finite_top(q.map_id)!r}, guesses + {guesses}, "
        f"thresholds + {thresholds})",
    ]
    if q.bits == 8:
        lines.append(f"tl.store(oc{slot} + at, e{slot}.to(tl.uint8), mask=mask)")
    else:
        half, columns = layout.block // 2, layout.columns // 2
        inside = f" & (tl.arange(0, {columns}) < {half})[None, :]" if columns != half else ""
        lines.append(f"b{slot} = blocks[:, None] * {half} + tl.arange(0, {columns})[None, :]")  # its bytes
        lines.append(f"tl.store(oc{slot} + b{slot}, fadam_pack4(e{slot}), mask=(b{slot} < (size + 1) // 2){inside})")
    lines.append(f"tl.store(oa{slot} + blocks, s{slot}, mask=held)")
    lines.append(f"tl.store(om{slot} + blocks * 0, tl.full(({layout.rows},), {q.map_id}, tl.uint8), mask=blocks == 0)")
    return lines


def _body(
    traced: Traced, dtypes: tuple[torch.dtype, ...], types: dict, scalars: _Scalars, layout: _Layout
) -> list[str]:
    """The lines that load (or decode) a block's inputs, compute the graph's nodes and store (or encode) its
    outputs."""
    graph = traced.graph
    needed = _reachable(traced.outputs)
    slots = len(traced.outputs) - 1
    out_dtypes = [dtypes[len(graph.inputs) - slots + k] for k in range(slots)] + [dtypes[0]]
    names: dict[int, str] = {}
    lines: list[str] = []
    for node in graph.nodes:
        if node.index not in needed or not node.elementwise:
            continue
        if node.op == "cast" and types[node.args[0].index] == types[node.index]:
            names[node.index] = names[node.args[0].index]  # already rounded to its dtype
            continue
        name = names[node.index] = f"v{node.index}"
        if node.op == "operand":  # a spread, read through its indexing (fadam._program.Spread.indexing)
            inner, count = (scalars.name(arg, "int64_t", False) for arg in node.args)
            pointer = f"x{node.value} + (at // tl.maximum({inner} * {count}, 1)) * {inner} + at % {inner}"
            bf16 = types[node.index] == torch.bfloat16
            # 1 past the leaf's end: a body may divide by a spread (the interpreter would warn of 0 / 0 there)
            load = f"fadam_load_bf16({pointer}, mask, 1.0)" if bf16 else f"tl.load({pointer}, mask=mask, other=1.0)"
            lines.append(f"{name} = {load}")
            continue
        if node.op == "input":
            k = graph.inputs.index(node)
            if k - layout.first_slot in layout.quantized:
                lines.extend(_decode(k - layout.first_slot, name, layout))
                continue
            bf16 = dtypes[k] == torch.bfloat16
            load = f"fadam_load_bf16(in{k} + at, mask, 0.0)" if bf16 else f"tl.load(in{k} + at, mask=mask)"
            lines.append(f"{name} = {load}")
            continue
        args = [_argument(node, k, names, types, scalars) for k in range(len(node.args))]
        text = _expression(node, args, types)
        lines.append(f"{name} = {f'fadam_round_bf16({text})' if types[node.index] == torch.bfloat16 else text}")
    for k, (out, dtype) in enumerate(zip(traced.outputs, out_dtypes)):
        if k in layout.quantized:
            lines.extend(_encode(k, names[out.index], layout))
            continue
        store = "fadam_store_bf16({}, {}, mask)" if dtype == torch.bfloat16 else "tl.store({}, {}, mask=mask)"
        lines.append(store.format(f"out{k} + at", names[out.index]))
    return lines


def _pointers(
    dtypes: tuple[torch.dtype, ...], out_dtypes: list[torch.dtype], layout: _Layout, operands: int
) -> list[str]:
    """The lines that read a leaf's pointers from its row of the table: a plain tensor's (``in``, ``out``), a
    quantized slot's codes and absmax (``c``, ``a``; its map id is read before the launch, into ``maps_in``) and
    new codes, absmax and map id (``oc``, ``oa``, ``om``), then its spreads' (``x``: the last ``operands`` of
    ``dtypes``)."""
    lines, at = [], 0
    spread_dtypes = dtypes[len(dtypes) - operands :]
    dtypes = dtypes[: len(dtypes) - operands]
    for k, dtype in enumerate(dtypes):
        slot = k - layout.first_slot
        if slot in layout.quantized:
            lines.append(f"c{slot} = tl.load(row + {at}).to(tl.pointer_type(tl.uint8))")
            lines.append(f"a{slot} = tl.load(row + {at + 1}).to(tl.pointer_type(tl.float32))")
            at += 3
        else:
            lines.append(f"in{k} = tl.load(row + {at}).to(tl.pointer_type({_POINTEE[dtype]}))")
            at += 1
    for k, dtype in enumerate(out_dtypes):
        if k in layout.quantized:
            for prefix, pointee in zip(("oc", "oa", "om"), ("tl.uint8", "tl.float32", "tl.uint8")):
                lines.append(f"{prefix}{k} = tl.load(row + {at}).to(tl.pointer_type({pointee}))")
                at += 1
        else:
            lines.append(f"out{k} = tl.load(row + {at}).to(tl.pointer_type({_POINTEE[dtype]}))")
            at += 1
    for k, dtype in enumerate(spread_dtypes):
        lines.append(f"x{k} = tl.load(row + {at + k}).to(tl.pointer_type({_POINTEE[dtype]}))")
    return lines


def _positions(width: int, layout: _Layout) -> list[str]:
    """The lines that find the program's leaf and its elements (``at``, within the leaf's ``mask``); in a quantized
    kernel also its blocks (``blocks``, those of the leaf: ``held``)."""
    lines = [
        "program = tl.program_id(0)",
        f"leaf = tl.load(table + leaves * {width} + program)",
        f"row = table + leaf * {width}",
        f"size = tl.load(row + {width - 2})",
    ]
    if not layout.quantized:
        return [
            *lines,
            f"at = (program - tl.load(row + {width - 1})) * BLOCK + tl.arange(0, BLOCK)",
            "mask = at < size",
        ]
    block, columns = layout.block, layout.columns
    inside = f" & (tl.arange(0, {columns}) < {block})[None, :]" if columns != block else ""
    return [
        *lines,
        f"blocks = (program - tl.load(row + {width - 1})) * {layout.rows} + tl.arange(0, {layout.rows})",
        f"held = blocks * {block} < size",
        f"at = blocks[:, None] * {block} + tl.arange(0, {columns})[None, :]",
        f"mask = (at < size){inside}",
    ]


@functools.lru_cache(maxsize=512)
def source(
    traced: Traced, dtypes: tuple[torch.dtype, ...], fma: bool, formats: Formats = ()
) -> tuple[str, tuple[float, ...]]:
    """The Triton source of ``traced`` for inputs of ``dtypes`` (in the graph's order; the outputs have their inputs'
    dtypes, the last one the first input's) and slots of ``formats`` (``fadam._cpu_kernel.source``'s), and the
    constants its values tensor holds after the step's scalars. ``fadam_kernel(table, leaves, values, BLOCK, FMA)``:
    per leaf, ``table`` holds the inputs' and outputs' data pointers (three for a quantized slot: codes, absmax, map
    id) and its spreads' (``Graph.operands``, read at ``Spread.indexing``'s places), then its size and its first
    program; after the leaves, each program's leaf. With quantized slots it also
    takes ``maps_in`` (each leaf's stored map ids, slot after slot), ``code_maps`` and the encode tables
    (``fadam.quantization._maps``), after ``values``."""
    graph = traced.graph
    types = _node_dtypes(traced, dtypes)
    layout = _layout(traced, formats)
    scalars = _Scalars(len(graph.scalars))
    body = _body(traced, dtypes, types, scalars, layout)
    n_in, n_out = len(graph.inputs), len(traced.outputs)
    out_dtypes = [dtypes[layout.first_slot + k] for k in range(n_out - 1)] + [dtypes[0]]
    widths = layout.widths(n_in, lambda k: k - layout.first_slot) + layout.widths(n_out, lambda k: k)
    width = sum(widths) + len(graph.operands) + 2
    lines = [
        *_positions(width, layout),
        *_pointers(dtypes, out_dtypes, layout, len(graph.operands)),
        *scalars.declarations(len(graph.leaf_scalars), layout.shape),
        *body,
    ]
    text = "\n    ".join(lines)
    codec = "maps_in, code_maps, guesses, thresholds, " if layout.quantized else ""
    kernel = f"""

@triton.jit
def fadam_kernel(table, leaves, values, {codec}BLOCK: tl.constexpr, FMA: tl.constexpr):
    {text}
"""
    return _PRELUDE + kernel, tuple(scalars.constants)


class TritonKernel:
    """A generated segment: ``run`` launches it on a group of leaves, ``span`` elements of a leaf per program;
    ``stored_maps``: where each quantized slot's map id lies in a leaf's row (none in a plain kernel)."""

    def __init__(
        self,
        function: Callable[..., Any],
        constants: tuple[float, ...],
        fma: bool,
        per_leaf: int,
        span: int = BLOCK,
        stored_maps: tuple[int, ...] = (),
    ) -> None:
        self._function = function
        self._constants = list(constants)
        self._fma = fma
        self._per_leaf = per_leaf
        self._tables: dict[tuple, torch.Tensor] = {}  # the leaves' pointer tables on their device, by their contents
        self._device_constants: dict[torch.device, torch.Tensor] = {}
        self._span = span
        self._stored_maps = stored_maps

    def _codec(self, leaves: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """A quantized kernel's codec arguments: the leaves' stored map ids, copied before the launch (a donated
        step writes the new ones in place while other programs of the leaf decode), checked, and the map and encode
        tables on their device. An unknown map id is refused before anything is written: on the CPU by an error
        here, on a GPU by a device-side assert (``torch._assert_async``) ahead of the launch, without a host sync."""
        if not self._stored_maps or not leaves:
            return []
        from fadam.quantization._maps import MAP_IDS, tables_on

        stored = torch.stack([row[k] for row in leaves for k in self._stored_maps])
        known = (stored < len(MAP_IDS)).all()
        message = "quantized state names an unknown map (map_id); nothing was written"
        if stored.is_cpu and not bool(known):
            raise ValueError(message)
        if not stored.is_cpu:
            torch._assert_async(known, message)
        maps, guesses, thresholds, _ = tables_on(stored.device)
        return [stored, maps, guesses, thresholds]

    def run(
        self,
        leaves: list[list[torch.Tensor]],
        scalars: list[float] | torch.Tensor,
        leaf_scalars: list[float] | torch.Tensor,
    ) -> None:
        """Runs on ``leaves`` (per leaf: the inputs, then the outputs, contiguous, on one device, of the kernel's
        dtypes), with ``leaf_scalars`` holding each leaf's own scalars in turn: ``fadam._cpu_kernel.Kernel.run``'s
        arguments. The scalars come as doubles, or as one float64 tensor on the leaves' device (a capturable
        step's, ``fadam._numerics.device_vector``), which is not copied from the host; the table of the leaves'
        pointers is copied to the device once for each set of pointers and kept (``_table``). Then one launch
        (with quantized slots, a copy of their map ids first: ``_codec``)."""
        if len(leaf_scalars) != self._per_leaf * len(leaves):
            raise ValueError(f"expected {self._per_leaf} scalars per leaf, got {len(leaf_scalars)} for {len(leaves)}")
        codec = self._codec(leaves)
        sizes = [row[0].numel() for row in leaves]
        least = 1 if codec else 0  # a leaf's first program writes its map ids: an empty leaf's too
        blocks = [max(least, -(-size // self._span)) for size in sizes]
        total = sum(blocks)
        if total == 0:
            return
        device = leaves[0][0].device
        self._function[(total,)](
            self._table(leaves, sizes, blocks, device),
            len(leaves),
            self._values(scalars, leaf_scalars, device),
            *codec,
            BLOCK=BLOCK,
            FMA=self._fma,
            enable_fp_fusion=False,  # every operation rounds once, as torch's separate kernels do
        )

    _KEPT_TABLES = 8  # per kernel: more than the groups of leaves one step gives it

    def _table(
        self, leaves: list[list[torch.Tensor]], sizes: list[int], blocks: list[int], device: torch.device
    ) -> torch.Tensor:
        """The launch's table on ``device``: per leaf its tensors' data pointers, its size and its first program, then
        each program's leaf. Kept while the pointers are unchanged, which a donated step's are, so that such steps copy
        nothing from pageable host memory and a CUDA graph that captures one reads a table that outlives it (the last
        ``_KEPT_TABLES`` are kept, by their contents: a table is a function of its key)."""
        table: list[int] = []
        first = 0
        for row, size, count in zip(leaves, sizes, blocks):
            table += [t.data_ptr() for t in row]
            table += [size, first]
            first += count
        key = (device, *table, *blocks)
        found = self._tables.pop(key, None)
        if found is None:
            owners = torch.repeat_interleave(torch.arange(len(leaves), dtype=torch.int64), torch.tensor(blocks))
            found = torch.cat([torch.tensor(table, dtype=torch.int64), owners]).to(device, non_blocking=True)
            if len(self._tables) >= self._KEPT_TABLES:
                del self._tables[next(iter(self._tables))]  # the least recently used
        self._tables[key] = found
        return found

    def _values(
        self, scalars: list[float] | torch.Tensor, leaf_scalars: list[float] | torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """The values tensor on ``device``: the step's scalars, the graph's constants, each leaf's scalars, and a pad.
        Tensor scalars are joined there by one ``torch.cat`` with the constants, which are copied there once."""
        if not isinstance(scalars, torch.Tensor):
            values = torch.tensor([*scalars, *self._constants, *leaf_scalars, 0.0], dtype=torch.float64)
            return values.to(device, non_blocking=True)
        constants = self._device_constants.get(device)
        if constants is None:
            constants = torch.tensor([*self._constants, 0.0], dtype=torch.float64).to(device)
            self._device_constants[device] = constants
        if not isinstance(leaf_scalars, torch.Tensor):
            leaf_scalars = torch.tensor(leaf_scalars, dtype=torch.float64).to(device)
        return torch.cat([scalars, constants[:-1], leaf_scalars, constants[-1:]])


def _import(text: str) -> ModuleType:
    """The module of ``text``, written under ``cache_dir() / "triton"`` once (``triton.jit`` reads it back)."""
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    folder = cache_dir() / "triton"
    path = folder / f"fadam_{key}.py"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".build-", suffix=".py", delete=False) as file:
            file.write(text)
        os.replace(file.name, path)  # atomic: another process importing the same key sees a whole file or none
    spec = importlib.util.spec_from_file_location(f"fadam_triton_{key}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=512)
def _load(
    traced: Traced, dtypes: tuple[torch.dtype, ...], formats: Formats, fma: bool, interpreted: bool
) -> TritonKernel:
    text, constants = source(traced, dtypes, fma, formats)
    module = _import(text)  # decorated for the interpreter or the GPU as ``interpreted`` says, and kept so
    layout = _layout(traced, formats)
    starts = [0]
    for width in layout.widths(len(traced.graph.inputs), lambda k: k - layout.first_slot):
        starts.append(starts[-1] + width)
    stored_maps = tuple(starts[layout.first_slot + slot] + 2 for slot in layout.quantized)
    return TritonKernel(module.fadam_kernel, constants, fma, len(traced.graph.leaf_scalars), layout.span, stored_maps)


def load(
    traced: Traced, dtypes: tuple[torch.dtype, ...], formats: Formats = (), fma: bool = True
) -> TritonKernel | None:
    """The Triton kernel of ``traced`` for inputs of ``dtypes`` and slots of ``formats`` (``fadam._cpu_kernel.load``'s
    arguments), or ``None`` where this backend does not take them (``supports``, another dtype) or Triton is not
    installed. ``fma``: whether torch.lerp, torch.addcmul and torch.add's alpha round once, as ATen's CUDA kernels
    compute them."""
    if not supports(formats) or any(d not in KERNEL_DTYPES for d in dtypes) or not installed():
        return None
    return _load(traced, dtypes, formats, fma, _interpreted())
