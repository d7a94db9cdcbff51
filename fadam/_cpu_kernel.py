"""The generated CPU backend: one C++ function per traced program segment and dtype.

The function walks every leaf of a group in one call: the leaves' elements are cut into chunks, OpenMP spreads the
chunks over threads, and each chunk is one loop that loads the segment's inputs, runs its graph and stores its
outputs. The compiler vectorizes the loop for the machine it runs on (``-march=native``: AVX2, AVX-512, NEON), with
``-ffp-contract=off`` so that every operation rounds once, as the eager torch ops do: the results equal the eager
path's bit for bit (see ``tests/test_program.py``), whatever the instruction set.

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
import tempfile
import warnings
from pathlib import Path

import torch

from fadam._program import Node, Traced

_CTYPES = {torch.float32: "float", torch.float64: "double"}
KERNEL_DTYPES = tuple(_CTYPES)
_CHUNK = 1 << 14  # elements per unit of work: a few hundred kilobytes of traffic, many per thread on large leaves
_SERIAL_BELOW = 1 << 16  # fewer elements than this run on one thread: waking the others costs more than it saves

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17"]

_PRELUDE = """\
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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
template <typename T> static inline T fadam_fma(T a, T b, T c) { return std::fma(a, b, c); }
#else
template <typename T> static inline T fadam_fma(T a, T b, T c) { return a * b + c; }
#endif
// torch.lerp as ATen's vector kernel computes it
template <typename T> static inline T fadam_lerp(T start, T end, T weight) {
  const bool small = std::fabs(weight) < T(0.5);
  return fadam_fma(small ? weight : weight - T(1), end - start, small ? start : end);
}
typedef void (*SqrtRows)(int, const void*, void*);  // MKL's vsSqrt / vdSqrt, which torch's CPU sqrt calls
typedef int (*MklThreads)(int);  // MKL_Set_Num_Threads_Local
"""

_BINARY_C = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "gt": ">", "le": "<=", "ge": ">="}
_UNARY_C = {
    "neg": "-{}",
    "abs": "std::fabs({})",
    "sign": "fadam_sign({})",
    "reciprocal": "T(1) / {}",
    "rsqrt": "T(1) / std::sqrt({})",  # torch.rsqrt: the IEEE square root (not MKL's), then a division
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
_COMPUTED = frozenset(_BINARY_C) | frozenset(_UNARY_C) | frozenset(_CALLS) | {"sqrt"}
_BLOCK = 512  # elements per pass between square roots: their buffers stay in the L1 cache


def _literal(value: float) -> str:
    if value != value:
        return "T(NAN)"
    if value in (float("inf"), float("-inf")):
        return "T(INFINITY)" if value > 0 else "T(-INFINITY)"
    return f"T({value.hex()})"  # exact in any precision T holds it in


def _expression(node: Node, names: dict[int, str]) -> str:
    args = [names[a.index] for a in node.args]
    if node.op in _BINARY_C:
        return f"{args[0]} {_BINARY_C[node.op]} {args[1]}"
    if node.op in _UNARY_C:
        return _UNARY_C[node.op].format(args[0])
    if node.op in _CALLS:
        return _CALLS[node.op].format(*args)
    raise ValueError(f"no C++ for the operation {node.op}")


def _phases(traced: Traced, needed: set[int]) -> dict[int, int]:
    """The pass each node is computed in: a square root's result is available one pass after its argument (torch's
    square roots run over a block of arguments at once, in MKL), every other node in the pass of its last argument."""
    phase: dict[int, int] = {}
    for node in traced.graph.nodes:
        if node.index in needed:
            start = max((phase[a.index] for a in node.args), default=0)
            phase[node.index] = start + 1 if node.op == "sqrt" else start
    return phase


@functools.lru_cache(maxsize=512)
def source(traced: Traced, dtype: torch.dtype) -> str:
    """The C++ source of ``traced`` for ``dtype``: ``fadam_run(leaves, sizes, pointers, scalars, threads, sqrt_rows,
    mkl_threads)``, where ``pointers`` holds, per leaf, the inputs in the graph's order, then the outputs."""
    graph = traced.graph
    needed = _reachable(traced.outputs)
    phase = _phases(traced, needed)
    passes = max(phase.values(), default=0) + 1
    output_of: dict[int, list[int]] = {}  # a node may be several outputs (trace's update is its new trace)
    for k, out in enumerate(traced.outputs):
        output_of.setdefault(out.index, []).append(k)
    roots = [n for n in graph.nodes if n.index in needed and n.op == "sqrt"]
    uses: dict[int, set[int]] = {}  # the passes that read each node
    for node in graph.nodes:
        if node.index in needed:
            reader = phase[node.index] - 1 if node.op == "sqrt" else phase[node.index]  # its argument is stored
            for arg in node.args:
                uses.setdefault(arg.index, set()).add(reader)
    buffered = [  # computed values that a later pass reads
        n for n in graph.nodes if n.op in _COMPUTED and max(uses.get(n.index, {-1})) > phase.get(n.index, 0)
    ]
    buffered_indices = {n.index for n in buffered}
    loops: list[str] = []
    for current in range(passes):
        names: dict[int, str] = {}
        lines: list[str] = []
        for node in graph.nodes:
            index = node.index
            if index not in needed:
                continue
            name = names[index] = f"v{index}"
            if node.op == "scalar":
                names[index] = f"s{node.value}"
            elif node.op == "leaf_scalar":
                names[index] = f"l{node.value}"
            elif node.op == "const":
                names[index] = _literal(node.value)
            elif node.op == "input" and (current in uses.get(index, ()) or index in output_of):
                lines.append(f"const T {name} = in{graph.inputs.index(node)}[at];")
            elif phase[index] < current and current in uses.get(index, ()):
                lines.append(f"const T {name} = b{index}[j];")
            elif phase[index] == current and node.op != "input":
                kind = "bool" if node.boolean else "T"
                value = f"r{index}[j]" if node.op == "sqrt" else _expression(node, names)
                lines.append(f"const {kind} {name} = {value};")
                if index in buffered_indices:
                    lines.append(f"b{index}[j] = {name};")
            if phase[index] == current and index in output_of:
                lines.extend(f"out{k}[at] = {name};" for k in output_of[index])
        lines += [f"a{r.index}[j] = {names[r.args[0].index]};" for r in roots if phase[r.index] == current + 1]
        body = "\n        ".join(lines)
        loops.append(
            f"""#pragma omp simd
      for (int64_t j = 0; j < count; ++j) {{
        const int64_t at = start + j;
        {body}
      }}"""
        )
        for root in roots:
            if phase[root.index] == current + 1:
                loops.append(
                    f"if (sqrt_rows) sqrt_rows(static_cast<int>(count), a{root.index}, r{root.index});\n"
                    f"      else for (int64_t j = 0; j < count; ++j) r{root.index}[j] = std::sqrt(a{root.index}[j]);"
                )
    n_in, n_out = len(graph.inputs), len(traced.outputs)
    loads = [f"const T* in{k} = static_cast<const T*>(pointer[{k}]);" for k in range(n_in)]
    loads += [f"T* out{k} = static_cast<T*>(pointer[{n_in + k}]);" for k in range(n_out)]
    scratch = [f"{'bool' if n.boolean else 'T'} b{n.index}[{_BLOCK}];" for n in buffered]
    scratch += [f"T a{r.index}[{_BLOCK}], r{r.index}[{_BLOCK}];" for r in roots]
    scalars = [f"const T s{k} = T(scalars[{k}]);" for k in range(len(graph.scalars))]
    per_leaf = len(graph.leaf_scalars)
    leaf_loads = [f"const T l{k} = T(leaf_scalars[leaf * {per_leaf} + {k}]);" for k in range(per_leaf)]
    newline = "\n  "
    return f"""#define FADAM_ATEN_FMA {int(_aten_fma())}
{_PRELUDE}
typedef {_CTYPES[dtype]} T;

extern "C" int64_t fadam_run(int64_t leaves, const int64_t* sizes, void* const* pointers, const double* scalars,
                             const double* leaf_scalars, int64_t threads, SqrtRows sqrt_rows, MklThreads mkl_threads) {{
  {newline.join(scalars)}
  std::vector<int64_t> first(leaves + 1, 0);  // the first chunk of each leaf
  for (int64_t leaf = 0; leaf < leaves; ++leaf) first[leaf + 1] = first[leaf] + (sizes[leaf] + {_CHUNK} - 1) / {_CHUNK};
  const int64_t chunks = first[leaves];
#pragma omp parallel num_threads(threads)
  {{
    // MKL would open a parallel region of its own inside each call from this thread
    const int mkl_before = (sqrt_rows && mkl_threads) ? mkl_threads(1) : 0;
    {" ".join(scratch)}
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {{
      const int64_t leaf = std::upper_bound(first.begin(), first.end(), chunk) - first.begin() - 1;
      void* const* pointer = pointers + leaf * {n_in + n_out};
      {(newline + "    ").join(loads + leaf_loads)}
      const int64_t begin = (chunk - first[leaf]) * {_CHUNK};
      const int64_t end = std::min(begin + {_CHUNK}, sizes[leaf]);
      for (int64_t start = begin; start < end; start += {_BLOCK if passes > 1 else _CHUNK}) {{
      const int64_t count = std::min<int64_t>({_BLOCK if passes > 1 else _CHUNK}, end - start);
      {(newline + "    ").join(loops)}
      }}
    }}
    if (sqrt_rows && mkl_threads) mkl_threads(mkl_before);
  }}
  return chunks;
}}
"""


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
def _mkl_functions() -> tuple[int, int, int]:
    """The addresses of MKL's ``vsSqrt``, ``vdSqrt`` and ``MKL_Set_Num_Threads_Local`` in torch's CPU library, which
    its CPU sqrt calls where torch links MKL (0 where it does not): the kernels call them too, so that their square
    roots round as torch's (MKL's last bit differs from the IEEE square root for about 1% of inputs)."""
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return 0, 0, 0
    found = []
    for name in ("vsSqrt", "vdSqrt", "MKL_Set_Num_Threads_Local"):
        function = getattr(library, name, None)
        found.append(ctypes.cast(function, ctypes.c_void_p).value or 0 if function is not None else 0)
    return found[0], found[1], found[2]


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

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._function = library.fadam_run
        self._function.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int64, *[ctypes.c_void_p] * 2]
        self._function.restype = ctypes.c_int64
        self._library = library  # keeps the library loaded while the function is referenced
        single, double, threads = _mkl_functions()
        self._sqrt_rows = single if dtype == torch.float32 else double
        self._mkl_threads = threads

    def run(self, leaves: list[list[torch.Tensor]], scalars: list[float], leaf_scalars: list[float]) -> None:
        """Runs on ``leaves`` (per leaf: the inputs, then the outputs, all contiguous, of the kernel's dtype), with
        ``leaf_scalars`` holding each leaf's own scalars in turn."""
        sizes = array.array("q", [row[0].numel() for row in leaves])
        pointers = array.array("Q", [t.data_ptr() for row in leaves for t in row])
        values = array.array("d", scalars or [0.0])
        leaf_values = array.array("d", leaf_scalars or [0.0])
        total = sum(sizes)
        threads = 1 if total < _SERIAL_BELOW else torch.get_num_threads()
        self._function(
            len(leaves),
            sizes.buffer_info()[0],
            pointers.buffer_info()[0],
            values.buffer_info()[0],
            leaf_values.buffer_info()[0],
            threads,
            self._sqrt_rows or None,
            self._mkl_threads or None,
        )


def _library(text: str) -> ctypes.CDLL | None:
    """The shared library compiled from ``text`` (from the disk cache where it is there), or ``None``."""
    compiler = _compiler()
    if compiler is None:
        _warn_once("no C++ compiler found (set CXX)")
        return None
    key = hashlib.sha256("\0".join([text, *compiler, " ".join(_FLAGS), _machine()]).encode()).hexdigest()[:24]
    folder = cache_dir() / "kernels"
    library_path = folder / f"{key}.so"
    if not library_path.exists():
        try:
            _compile(compiler[0], text, folder, library_path)
        except (OSError, subprocess.SubprocessError) as err:
            _warn_once(f"compiling a kernel failed ({err})")
            return None
    return ctypes.CDLL(str(library_path))


@functools.lru_cache(maxsize=512)
def _load_source(text: str, dtype: torch.dtype) -> Kernel | None:
    library = _library(text)
    return None if library is None else Kernel(library, dtype)


def _compile(compiler: str, text: str, folder: Path, target: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as scratch:
        src = Path(scratch) / "kernel.cpp"
        src.write_text(text)
        built = Path(scratch) / "kernel.so"
        result = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip().splitlines()[-1] if result.stderr else "failed")
        os.replace(built, target)  # atomic: another process loading the same key sees a whole library or none


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"fadam: {reason}; composed steps run eagerly", stacklevel=4)


def load(traced: Traced, dtype: torch.dtype) -> Kernel | None:
    """The compiled kernel of ``traced`` for ``dtype`` (built on first use), or ``None`` without a compiler."""
    return _load_source(source(traced, dtype), dtype)
