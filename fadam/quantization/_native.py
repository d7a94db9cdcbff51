"""The quantized Adam step's CPU kernel: ``_adam_rows.cpp``, built on first use and called through ctypes.

On the CPU, inductor's code for the fused step (``_fused.py``) reads each table entry in a scalar loop and goes
through memory between its two kernels; this loop does the same math in one pass per block, vectorized, with the
second half of one group of blocks in the same loop as the first half of the next (`benchmarks/bench_quantized.py`
times both). Its results equal the eager kernels bit for bit:
ATen's fused multiply-adds where ATen has them, and torch's own sqrt (MKL's, where torch links it). Only float32
and bfloat16 params on the CPU take it; everything else keeps the compiled kernels. The same call runs the step's
leaves whose moments stay in full precision (float32, below ``min_size``) with the same math, where eagerly each cost
tens of microseconds of Python and ATen dispatch (a 16M-param GPT-2-style model has 42 such leaves among 64).

A donated step whose leaves all take the kernel as they are (the common case from the second step on) is also read and
checked there (``read_leaves``): its tensors go to the library as torch's C shim handles
(``torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors``, the stable ABI that AOTInductor's code reads tensors with),
rather than by ``_fused._plan`` and ``Leaves``, tensor by tensor in Python, which costs about twice as much a leaf.
Any leaf that needs more (a copy, an eager part, tied weights, another
dtype...) sends the whole step back to them. A torch without the shim or the handles loses only that reading.

The library is built once per machine and source by ``torch.utils.cpp_extension`` (a C++ compiler, which torch.compile's
CPU backend needs as well, and ninja) from this one file, with none of torch's extension headers (the shim's functions
are declared there): about 5 s on two cores. Its instruction set follows ATen's
(``torch.backends.cpu.get_cpu_capability``), so that its multiply-adds are fused exactly where ATen's are. If the build
fails, ``available`` warns once and returns ``False``, and the compiled kernels serve.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fadam.quantization._codec import QuantizedArray, map_pair
from fadam.quantization._maps import _GRIDS, Tables, encode_tables, finite_tops, tables_on

if TYPE_CHECKING:  # _fused imports this module
    from fadam.quantization._fused import Rows

_SOURCE = Path(__file__).with_name("_adam_rows.cpp")
PARAM_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # param_dtype in the source
# Compiler flags per ATen CPU capability: the vector width and, above all, whether a multiply-add is fused.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma"],
}
# -ffp-contract=off: each operation rounds once, as ATen's kernels do, unless the source asks for a fused one;
# -fno-math-errno lets sqrt vectorize (results are the same).
_CFLAGS = ["-O3", "-mtune=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]


class _Grid(ctypes.Structure):
    _fields_ = [("entries", ctypes.c_void_p), ("base", ctypes.c_int32), ("finite_top", ctypes.c_float)]


class _Args(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("p", "g", "out", "m_codes", "m_absmax", "v_codes", "v_absmax")),
        *((name, ctypes.c_void_p) for name in ("m_map", "v_map", "m", "v")),
        ("m_grid", _Grid),
        ("v_grid", _Grid),
        ("rows", ctypes.c_int64),
        ("block", ctypes.c_int64),
        ("last", ctypes.c_int64),
        *((name, ctypes.c_int32) for name in ("bits", "param_dtype", "maximize", "coupled_decay", "decoupled_decay")),
        *(
            (name, ctypes.c_float)
            for name in (
                *("b1_weight", "b2", "one_minus_b2", "eps", "weight_decay"),
                *("lr", "bc1", "bc2_sqrt", "factor", "bf16_factor"),
            )
        ),
    ]


class _Reading(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("bits", "block", "m_map_id", "v_map_id", "maps_at", "map_bytes", "coupled_decay")
    ]


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    # cpp_extension runs `ninja` from PATH; the ninja package (a dependency) puts it in its own folder, which is on
    # PATH only in an activated environment. Added for the build only.
    try:
        import ninja

        folder = ninja.BIN_DIR
    except (ImportError, AttributeError):
        folder = None
    if folder is None or shutil.which("ninja") is not None:
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = folder + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


@functools.cache
def _library() -> ctypes.CDLL | None:
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        from torch.utils import cpp_extension

        with _ninja_on_path():
            path = cpp_extension.load(
                name=f"fadam_adam_rows_{capability.lower()}",
                sources=[str(_SOURCE)],
                extra_cflags=[*_CFLAGS, *_ISA_FLAGS.get(capability, [])],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
        library = ctypes.CDLL(path)
    except Exception as err:  # no compiler, no ninja, an unsupported platform: the compiled kernels serve
        warnings.warn(
            f"fadam: building the quantized Adam CPU kernel failed ({type(err).__name__}: {err}); using the "
            "torch.compile kernel instead",
            stacklevel=3,
        )
        return None
    library.fadam_quantized_adam_leaves.argtypes = [ctypes.POINTER(_Args), ctypes.c_void_p, ctypes.c_int64]
    library.fadam_quantized_adam_leaves.restype = ctypes.c_int64
    library.fadam_quantized_encode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.POINTER(_Grid),
        ctypes.c_void_p,
    ]
    library.fadam_quantized_encode.restype = None
    library.fadam_quantized_quotient.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    library.fadam_quantized_quotient.restype = ctypes.c_int32
    library.fadam_reads_leaves.argtypes = []
    library.fadam_reads_leaves.restype = ctypes.c_int32
    return library


_ONE = 0x3F80  # the bfloat16 bit pattern of 1.0: the largest |y| the kernel encodes
_NEGATIVE = 0x8000  # the sign bit of a bfloat16 pattern
_NONE = 0xFFFF  # no midpoint inside the pattern: no low 16 bits exceed it


@functools.cache
def _encoder(map_id: int) -> tuple[torch.Tensor, _Grid]:
    """The C++ encoder of one map (``Grid`` in the source) with the table it points into (cached together, so that
    the pointer lives as long as the table). Entry ``pattern - base`` for each bfloat16 pattern of a y in [-1, 1]:
    ``midpoint << 16 | code``. For y >= 0, ``code`` is the nearest code of the pattern's smallest float and
    ``midpoint`` the low 16 bits of the map's midpoint inside the pattern (``_NONE`` if none): y's code is ``code``
    plus one if its low 16 bits exceed ``midpoint``. For y < 0, whose code steps down as its low bits grow, both are
    mirrored (``0xFFFF - bits``) and ``code`` is that of the pattern's largest magnitude, so that the same comparison
    applies. The same codes as the chain's ``encode`` (its midpoints, re-packed for one read), ties included: y's code
    is the number of midpoints below it. With the map's ``finite_top``, for blocks that hold an infinity."""
    _, thresholds = encode_tables("cpu")
    grid = _GRIDS[map_id]
    midpoints = thresholds[map_id, grid.zero : grid.zero + grid.top].view(torch.int32).to(torch.int64)
    base = max((int(midpoints[0]) >> 16) - 1, 0)  # patterns up to base hold no midpoint
    starts = torch.arange(base, _ONE + 1, dtype=torch.int64) << 16
    below = torch.searchsorted(midpoints, starts)  # positive midpoints < the pattern's smallest float
    inside = torch.searchsorted(midpoints, starts | 0xFFFF, right=True) - below  # midpoints in the pattern
    if bool((inside > 1).any()) or bool(inside[0]):
        raise AssertionError("a map has two midpoints inside one bfloat16 pattern; the C++ encoder is invalid")
    low = midpoints[below.clamp(max=grid.top - 1)] - starts  # the midpoint's low 16 bits, where inside == 1
    has = inside == 1
    positive = (torch.where(has, low, _NONE) << 16) | (grid.zero + below)
    if grid.signed:  # -y has code zero - (midpoints <= |y|): the mirrored comparison removes the one at or below y
        negative = (torch.where(has & (low > 0), _NONE - low, _NONE) << 16) | (grid.zero - below - has.long())
    else:  # no midpoint below 0
        negative = torch.full_like(positive, _NONE << 16 | grid.zero)
    table = torch.zeros(_NEGATIVE + _ONE + 1 - base, dtype=torch.int64)
    table[: positive.numel()] = positive
    table[_NEGATIVE - base : _NEGATIVE] = _NONE << 16 | grid.zero  # -y below the first midpoint
    table[_NEGATIVE:] = negative
    table = torch.where(table >= 1 << 31, table - (1 << 32), table).to(torch.int32)  # uint32 bits as int32
    return table, _Grid(table.data_ptr(), base, float(finite_tops("cpu")[map_id]))


def encode(y: torch.Tensor, map_id: int) -> torch.Tensor:
    """The kernel's encoder alone: int32 codes of float32 ``y`` (clamped to [-1, 1], NaN to 0) under ``map_id``, for
    comparison with the chain's ``_maps.encode`` (tests, benchmarks/check_encoder_exhaustive.py). Needs the library."""
    library = _library()
    if library is None:
        raise RuntimeError("the quantized Adam CPU kernel did not build")
    tables_on("cpu")  # builds _GRIDS
    y = y.detach().to(device="cpu", dtype=torch.float32).contiguous()
    codes = torch.empty(y.shape, dtype=torch.int32)
    _, grid = _encoder(map_id)
    library.fadam_quantized_encode(y.data_ptr(), y.numel(), ctypes.byref(grid), codes.data_ptr())
    return codes


def quotient(x: torch.Tensor, b: float) -> torch.Tensor | None:
    """The kernel's division of float32 ``x`` by a bias correction ``b`` through its reciprocal, for comparison with
    ``x / b`` (tests, benchmarks/check_quotient_exhaustive.py); ``None`` where the kernel divides by this ``b`` (it is
    outside [2**-20, 1], or the CPU lacks FMA). Needs the library."""
    library = _library()
    if library is None:
        raise RuntimeError("the quantized Adam CPU kernel did not build")
    x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
    out = torch.empty_like(x)
    return None if library.fadam_quantized_quotient(x.data_ptr(), x.numel(), b, out.data_ptr()) else out


def _shared_args(scalars: Sequence[float | torch.Tensor], config: tuple, bits: int) -> _Args:
    """An ``_Args`` with the fields every leaf of one step shares (hyperparameters, this step's scalars [lr, bc1,
    bc2_sqrt, factor, bf16_factor], which the float fields round to float32 as torch does, and the encoders); the
    library fills in each leaf's fields. ``factor`` is what float32 params multiply by for the decoupled decay and
    ``bf16_factor`` what bfloat16 ones do (``_fused._update``'s ``factor`` for each)."""
    b1, b2, eps, weight_decay, decoupled, maximize = config
    (_, m_grid), (_, v_grid) = (_encoder(map_id) for map_id in map_pair(bits))
    lr, bc1, bc2_sqrt, factor, bf16_factor = (float(s) for s in scalars)
    return _Args(
        m_grid=m_grid,
        v_grid=v_grid,
        bits=bits,
        maximize=bool(maximize),
        coupled_decay=bool(weight_decay) and not decoupled,
        decoupled_decay=bool(weight_decay) and decoupled,
        b1_weight=1 - b1,
        b2=b2,
        one_minus_b2=1 - b2,
        eps=eps,
        weight_decay=weight_decay,
        lr=lr,
        bc1=bc1,
        bc2_sqrt=bc2_sqrt,
        factor=factor,
        bf16_factor=bf16_factor,
    )


# A leaf's fields, as the library reads them (kLeafFields in the source): the addresses of p, g, out, m_codes,
# m_absmax, v_codes, v_absmax, m_map, v_map, and of m and v for a full-precision leaf (0 for the ones a leaf has not),
# then its rows, their length, the last one's (shorter for a ragged last block) and param_dtype.
_LEAF_FIELDS = 15


def _run(shared: _Args, fields: list[int]) -> None:
    """Runs in one call the leaves whose fields ``fields`` holds (``_LEAF_FIELDS`` each), with the hyperparameters
    and scalars of ``shared``."""
    _run_table(shared, array.array("q", fields), len(fields) // _LEAF_FIELDS)


def _run_table(shared: _Args, table: array.array, count: int) -> None:
    # _run's call, with the fields already in an array (read_leaves writes them there)
    failed = _library().fadam_quantized_adam_leaves(ctypes.byref(shared), table.buffer_info()[0], count)
    if failed:
        rows, block, last, param_dtype = table[failed * _LEAF_FIELDS - 4 : failed * _LEAF_FIELDS]
        dtype = next((d for d, code in PARAM_DTYPES.items() if code == param_dtype), "another dtype")
        raise ValueError(
            f"the quantized Adam CPU kernel takes 8 or 4 bits (even rows) and float32 or bfloat16 params, got "
            f"{shared.bits} bits, {rows} rows of {block} (the last of {last}), {dtype}"
        )


def step_rows(
    views: Rows,
    scalars: tuple[torch.Tensor, ...],
    tables: Tables,
    config: tuple,
    bits: int,
    out: torch.Tensor | None = None,
) -> None:
    """``_fused._rows_step_inplace`` in C++: the same arguments, the same results. The step itself passes its leaves
    through ``Leaves``; this row-level form is how tests compare the kernel with the eager kernels on crafted rows.
    ``tables`` goes unread: the kernel encodes with tables packed from the CPU ones once (``_encoder``)."""
    p, g, m_codes, m_absmax, m_map, v_codes, v_absmax, v_map = views
    tensors = (p, g, out, m_codes, m_absmax, v_codes, v_absmax, m_map, v_map, None, None)  # _LEAF_FIELDS' order
    fields = [0 if t is None else t.data_ptr() for t in tensors]
    rows, block = p.shape
    shared = _shared_args((*scalars, scalars[3]), config, bits)  # p's dtype multiplies by scalars[3]
    _run(shared, [*fields, rows, block, block, PARAM_DTYPES.get(p.dtype, -1)])


class Leaves:
    """One step's leaves for the kernel, run together by ``run``: one call into the library for all of them, where a
    call per leaf cost more Python than a 4096-element leaf's work. ``add`` records a quantized leaf's pointers and
    ``add_full`` those of a leaf whose moments stay in full precision (its caller checks the leaf first); nothing runs
    until ``run``, except that a leaf writing what an earlier one writes (tied weights, donated) first runs those
    before it, so that it reads their results as it would in order: in one call, the threads could split the two
    leaves between them."""

    def __init__(self, scalars: Sequence[float], config: tuple, bits: int, block_size: int) -> None:
        maps = tables_on("cpu")[0]  # (maps, 512) float32, alive in tables_on's cache; builds _GRIDS
        self._maps_at, self._map_bytes = maps.data_ptr(), maps.stride(0) * maps.element_size()
        self._shared = _shared_args(scalars, config, bits)
        self._eager_bf16_tail = bool(self._shared.coupled_decay)  # see add
        self._bits, self._block = bits, block_size
        self._fields: list[int] = []  # _LEAF_FIELDS for each recorded leaf
        self._gradients: list[torch.Tensor] = []  # alive until run: a caller's contiguous copy of a gradient, say
        self._written: set[int] = set()  # data pointers of the tensors the recorded leaves write

    def add(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        out: torch.Tensor | None,
        m: QuantizedArray,
        v: QuantizedArray,
        m_id: int,
        v_id: int,
    ) -> bool:
        """Records the leaf's whole blocks and, where the kernel can take it, its ragged last block as a last, shorter
        row (any length at 8 bits, an even one at 4: an odd one ends in half a byte). False if the ragged block is
        left to the caller. The caller has checked the leaf (``_fused._plan``: float32 or bfloat16 params and
        gradients, moments made for the param's shape with uint8 codes and float32 absmax of its sizes, all
        contiguous on the CPU), read its maps' ids, ``m_id`` and ``v_id``, and holds p, out, m and v until ``run``.

        Not for bfloat16 params with Adam's L2 decay either: the chain's ``torch.add(g, p, alpha)`` takes ATen's
        scalar loop for a leaf's last ``numel % 64`` elements (its vector loop steps two 32-lane vectors), which rounds
        ``alpha * p`` to bfloat16 before adding, where the vector loop, which the kernel follows, rounds once; blocks
        being multiples of 64, the eager ragged block ends in the same scalar loop."""
        block = self._block
        rows, tail = divmod(p.numel(), block)
        param_dtype = PARAM_DTYPES[p.dtype]
        p_at, g_at, out_at = p.data_ptr(), g.data_ptr(), 0 if out is None else out.data_ptr()
        m_codes, m_absmax = m.codes.data_ptr(), m.absmax.data_ptr()
        v_codes, v_absmax = v.codes.data_ptr(), v.absmax.data_ptr()
        self._writes(g, (out_at or p_at, m_codes, m_absmax, v_codes, v_absmax))
        m_map, v_map = self._maps_at + m_id * self._map_bytes, self._maps_at + v_id * self._map_bytes
        takes_tail = (
            tail > 0
            and (self._bits == 8 or tail % 2 == 0)
            and not (p.dtype == torch.bfloat16 and self._eager_bf16_tail)
        )
        last = tail if takes_tail else block  # the ragged block as a last, shorter row
        rows += takes_tail
        if rows:
            self._fields += (
                p_at, g_at, out_at, m_codes, m_absmax, v_codes, v_absmax, m_map, v_map, 0, 0, rows, block, last,
                param_dtype,
            )  # fmt: skip
        return tail == 0 or takes_tail

    def takes_full(self, p: torch.Tensor) -> bool:
        """Whether ``add_full`` may take ``p``'s leaf: not bfloat16 params with Adam's L2 decay, whose last elements
        ATen's eager ops round otherwise (see ``add``)."""
        return not (p.dtype == torch.bfloat16 and self._eager_bf16_tail)

    def add_full(
        self, p: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None, m: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Records a leaf whose moments ``m`` and ``v`` stay in full precision, updated in place: its caller checks
        (``_fused._plan``, ``takes_full``) float32 or bfloat16 params and gradients and float32 moments, all
        contiguous and of p's shape on the CPU, and holds p, out, m and v until ``run``. Its rows are whole blocks and a
        shorter last one, as a quantized leaf's."""
        block, n = self._block, p.numel()
        rows = -(-n // block)
        if rows:
            p_at, out_at, m_at, v_at = p.data_ptr(), 0 if out is None else out.data_ptr(), m.data_ptr(), v.data_ptr()
            self._writes(g, (out_at or p_at, m_at, v_at))
            self._fields += (
                p_at, g.data_ptr(), out_at, 0, 0, 0, 0, 0, 0, m_at, v_at, rows, block, n - (rows - 1) * block,
                PARAM_DTYPES[p.dtype],
            )  # fmt: skip

    def _writes(self, g: torch.Tensor, written: tuple[int, ...]) -> None:
        # A leaf about to be recorded: runs the recorded ones first if it writes what they write (tied weights), and
        # holds its gradient until run.
        if not self._written.isdisjoint(written):
            self.run()
        self._written.update(written)
        self._gradients.append(g)

    def run(self) -> None:
        if self._fields:
            _run(self._shared, self._fields)
        self._fields.clear()
        self._gradients.clear()
        self._written.clear()


@functools.cache
def _reader() -> tuple[Callable[[list[torch.Tensor]], list[Any]], Any] | None:
    """``(alloc, read)``: torch's function that makes a list of its C shim's tensor handles (capsules) from tensors,
    and the library's ``fadam_read_leaves``, called holding the GIL (it reads the list). ``None`` where this torch
    has either not: each step's leaves are then read in Python."""
    library = _library()
    alloc = getattr(getattr(torch._C, "_aoti", None), "unsafe_alloc_void_ptrs_from_tensors", None)
    if library is None or alloc is None or not library.fadam_reads_leaves():
        return None
    read = ctypes.PyDLL(library._name).fadam_read_leaves
    read.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(_Reading), ctypes.c_void_p]
    read.restype = ctypes.c_int64
    return alloc, read


def read_leaves(
    tensors: list[torch.Tensor], kinds: list[int], bits: int, block_size: int, coupled_decay: bool
) -> tuple[array.array, int] | None:
    """The fields of a donated step's leaves, checked in C++: ``kinds`` says how many of ``tensors`` each leaf has,
    10 for quantized moments (p, g, and m's codes, absmax, map id and like, then v's) and 4 for float32 ones (p, g, m,
    v). Returns ``(fields, leaves)`` for ``run_fields``, or ``None`` where any leaf needs ``_fused._plan`` and
    ``Leaves`` (the library's comment on ``fadam_read_leaves`` lists when). The caller has checked that every tensor
    is a plain one that autograd need not track and holds them until ``run_fields``. Nothing is written."""
    reader = _reader() if available() else None
    if reader is None:
        return None
    alloc, read = reader
    maps = tables_on("cpu")[0]  # (maps, 512) float32, alive in tables_on's cache
    signed, unsigned = map_pair(bits)
    reading = _Reading(
        bits=bits,
        block=block_size,
        m_map_id=signed,
        v_map_id=unsigned,
        maps_at=maps.data_ptr(),
        map_bytes=maps.stride(0) * maps.element_size(),
        coupled_decay=bool(coupled_decay),
    )
    fields = array.array("q", bytes(8 * _LEAF_FIELDS * len(kinds)))
    counts = array.array("q", kinds)
    leaves = read(alloc(tensors), counts.buffer_info()[0], len(kinds), ctypes.byref(reading), fields.buffer_info()[0])
    return None if leaves < 0 else (fields, leaves)


def run_fields(fields: array.array, leaves: int, scalars: Sequence[float], config: tuple, bits: int) -> None:
    """Runs the ``leaves`` that ``read_leaves`` wrote into ``fields``, with the step's scalars (as ``Leaves``)."""
    if leaves:
        _run_table(_shared_args(scalars, config, bits), fields, leaves)


def available() -> bool:
    """Whether the kernel is there to run: built (on the first ask; ``False`` with a warning where it cannot be)."""
    return _library() is not None
