"""Functions of the generated CPU kernel, compiled on their own so that they can be compared with torch on any float32
input: the encoders of the quantization maps (``fadam._cpu_kernel._codec_source``) and the division of a square root
by a number (``fadam_divide_root``)."""

from __future__ import annotations

import ctypes
import functools

import torch

from fadam import _cpu_kernel
from fadam.quantization._maps import MAP_IDS


@functools.cache
def _library() -> ctypes.CDLL | None:
    formats = [_cpu_kernel.Quantized(8, 256, map_id) for map_id in MAP_IDS.values()]
    cases = "\n".join(
        f"    case {map_id}: for (int64_t i = 0; i < n; ++i) codes[i] = fadam_encode{map_id}(y[i]); break;"
        for map_id in MAP_IDS.values()
    )
    text = f"""{_cpu_kernel._PRELUDE}
{_cpu_kernel._codec_source(formats)}
extern "C" void fadam_encode_all(int64_t map_id, const float* y, int64_t n, int32_t* codes) {{
  switch (map_id) {{
{cases}
  }}
}}
extern "C" int fadam_divide_all(const float* x, int64_t n, float d, float* y) {{
  const float r = 1.0f / d;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = fadam_divide_root(x[i], d, r);
  return FADAM_FAST_FMA;
}}
"""
    return _cpu_kernel._library(text)


def available() -> bool:
    return _library() is not None


def kernel_encode(y: torch.Tensor, map_id: int) -> torch.Tensor:
    """The int32 codes the kernel writes for contiguous float32 ``y`` (finite, in [-1, 1]) under ``map_id``."""
    y = y.contiguous()
    codes = torch.empty(y.shape, dtype=torch.int32)
    _library().fadam_encode_all(
        ctypes.c_int64(map_id),
        ctypes.c_void_p(y.data_ptr()),
        ctypes.c_int64(y.numel()),
        ctypes.c_void_p(codes.data_ptr()),
    )
    return codes


def kernel_divide_root(x: torch.Tensor, d: float) -> tuple[torch.Tensor, bool]:
    """``fadam_divide_root`` of contiguous float32 ``x`` by the float32 ``d``, and whether the machine's FMAs are
    instructions (where they are not, the kernel divides instead)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library = _library()
    library.fadam_divide_all.restype = ctypes.c_int
    fast = library.fadam_divide_all(
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.numel()), ctypes.c_float(d), ctypes.c_void_p(y.data_ptr())
    )
    return y, bool(fast)
