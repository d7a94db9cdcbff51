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
results bit for bit where the eager path's square roots are IEEE ones; with torch's CPU square root (MKL's, whose
last bit differs for about 1% of float32 and float64 inputs) the state is still bit for bit, the params within 2 ulps
of the update beyond their own rounding and the updates within 4 ulps of their largest magnitude. The interpreter
takes the pointer table (an int64 tensor of addresses cast with ``.to(tl.pointer_type(...))``) as the GPU does, so
the tests run the one launch per group that a GPU runs.

``fadam._execute`` runs it for CUDA leaves (and, under ``fadam.backend("triton")``, for CPU leaves in the
interpreter), one launch per group of leaves and device. Not yet: quantized slots (``supports`` refuses them; those
leaves stay on the other backends). No CUDA run has been made: on the GPU, torch.rsqrt is the
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
from typing import Any

import torch

from fadam._cpu_kernel import (
    _COMPUTED_IN,
    KERNEL_DTYPES,
    Formats,
    _node_dtypes,
    _operand_dtype,
    _reachable,
    cache_dir,
    read_as,
)
from fadam._program import Node, Traced

BLOCK = 1024  # elements per program: 8 per thread of 4 warps
_TL = {"float": "tl.float32", "double": "tl.float64"}  # a computed C type's Triton type
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
def fadam_load_bf16(pointer, mask):
    bits = tl.load(pointer, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32)
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


def supports(formats: Formats) -> bool:
    """Whether this backend takes slots of ``formats``: plain tensors only (quantized slots are not generated yet)."""
    return all(f is None for f in formats)


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

    def declarations(self, per_leaf: int) -> list[str]:
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
            lines.append(f"{name} = tl.broadcast_to({value}, (BLOCK,))")
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


def _body(traced: Traced, dtypes: tuple[torch.dtype, ...], types: dict, scalars: _Scalars) -> list[str]:
    """The lines that load a block's inputs, compute the graph's nodes and store its outputs."""
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
        if node.op == "input":
            k = graph.inputs.index(node)
            bf16 = dtypes[k] == torch.bfloat16
            load = f"fadam_load_bf16(in{k} + at, mask)" if bf16 else f"tl.load(in{k} + at, mask=mask)"
            lines.append(f"{name} = {load}")
            continue
        args = [_argument(node, k, names, types, scalars) for k in range(len(node.args))]
        text = _expression(node, args, types)
        lines.append(f"{name} = {f'fadam_round_bf16({text})' if types[node.index] == torch.bfloat16 else text}")
    for k, (out, dtype) in enumerate(zip(traced.outputs, out_dtypes)):
        store = "fadam_store_bf16({}, {}, mask)" if dtype == torch.bfloat16 else "tl.store({}, {}, mask=mask)"
        lines.append(store.format(f"out{k} + at", names[out.index]))
    return lines


@functools.lru_cache(maxsize=512)
def source(traced: Traced, dtypes: tuple[torch.dtype, ...], fma: bool) -> tuple[str, tuple[float, ...]]:
    """The Triton source of ``traced`` for inputs of ``dtypes`` (in the graph's order; the outputs have their inputs'
    dtypes, the last one the first input's), and the constants its values tensor holds after the step's scalars.
    ``fadam_kernel(table, leaves, values, BLOCK, FMA)``: per leaf, ``table`` holds the inputs' and outputs' data
    pointers, then its size and its first block; after the leaves, each program's leaf."""
    graph = traced.graph
    types = _node_dtypes(traced, dtypes)
    scalars = _Scalars(len(graph.scalars))
    body = _body(traced, dtypes, types, scalars)
    n_in, n_out = len(graph.inputs), len(traced.outputs)
    slots = n_out - 1
    out_dtypes = [dtypes[n_in - slots + k] for k in range(slots)] + [dtypes[0]]
    width = n_in + n_out + 2
    pointers = [f"in{k} = tl.load(row + {k}).to(tl.pointer_type({_POINTEE[d]}))" for k, d in enumerate(dtypes)]
    pointers += [
        f"out{k} = tl.load(row + {n_in + k}).to(tl.pointer_type({_POINTEE[d]}))" for k, d in enumerate(out_dtypes)
    ]
    lines = [
        "program = tl.program_id(0)",
        f"leaf = tl.load(table + leaves * {width} + program)",
        f"row = table + leaf * {width}",
        f"at = (program - tl.load(row + {width - 1})) * BLOCK + tl.arange(0, BLOCK)",
        f"mask = at < tl.load(row + {width - 2})",
        *pointers,
        *scalars.declarations(len(graph.leaf_scalars)),
        *body,
    ]
    text = "\n    ".join(lines)
    kernel = f"""

@triton.jit
def fadam_kernel(table, leaves, values, BLOCK: tl.constexpr, FMA: tl.constexpr):
    {text}
"""
    return _PRELUDE + kernel, tuple(scalars.constants)


class TritonKernel:
    """A generated segment: ``run`` launches it on a group of leaves."""

    def __init__(self, function: Callable[..., Any], constants: tuple[float, ...], fma: bool, per_leaf: int) -> None:
        self._function = function
        self._constants = list(constants)
        self._fma = fma
        self._per_leaf = per_leaf

    def run(self, leaves: list[list[torch.Tensor]], scalars: list[float], leaf_scalars: list[float]) -> None:
        """Runs on ``leaves`` (per leaf: the inputs, then the outputs, contiguous, on one device, of the kernel's
        dtypes), with ``leaf_scalars`` holding each leaf's own scalars in turn: ``fadam._cpu_kernel.Kernel.run``'s
        arguments. Two small host-to-device copies (the table, the values) and one launch."""
        if len(leaf_scalars) != self._per_leaf * len(leaves):
            raise ValueError(f"expected {self._per_leaf} scalars per leaf, got {len(leaf_scalars)} for {len(leaves)}")
        sizes = [row[0].numel() for row in leaves]
        blocks = [-(-size // BLOCK) for size in sizes]
        total = sum(blocks)
        if total == 0:
            return
        table: list[int] = []
        first = 0
        for row, size, count in zip(leaves, sizes, blocks):
            table += [t.data_ptr() for t in row]
            table += [size, first]
            first += count
        owners = torch.repeat_interleave(torch.arange(len(leaves), dtype=torch.int64), torch.tensor(blocks))
        device = leaves[0][0].device
        packed = torch.cat([torch.tensor(table, dtype=torch.int64), owners]).to(device, non_blocking=True)
        values = torch.tensor([*scalars, *self._constants, *leaf_scalars, 0.0], dtype=torch.float64)
        self._function[(total,)](
            packed,
            len(leaves),
            values.to(device, non_blocking=True),
            BLOCK=BLOCK,
            FMA=self._fma,
            enable_fp_fusion=False,  # every operation rounds once, as torch's separate kernels do
        )


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
def _load(traced: Traced, dtypes: tuple[torch.dtype, ...], fma: bool, interpreted: bool) -> TritonKernel:
    text, constants = source(traced, dtypes, fma)
    module = _import(text)  # decorated for the interpreter or the GPU as ``interpreted`` says, and kept so
    return TritonKernel(module.fadam_kernel, constants, fma, len(traced.graph.leaf_scalars))


def load(
    traced: Traced, dtypes: tuple[torch.dtype, ...], formats: Formats = (), fma: bool = True
) -> TritonKernel | None:
    """The Triton kernel of ``traced`` for inputs of ``dtypes`` (``fadam._cpu_kernel.load``'s arguments), or ``None``
    where this backend does not take them (quantized slots, another dtype) or Triton is not installed. ``fma``: whether
    torch.lerp, torch.addcmul and torch.add's alpha round once, as ATen's CUDA kernels compute them."""
    if not supports(formats) or any(d not in KERNEL_DTYPES for d in dtypes) or not installed():
        return None
    return _load(traced, dtypes, fma, _interpreted())
