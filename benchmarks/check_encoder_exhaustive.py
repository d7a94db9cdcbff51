"""Exhaustive check of the fused kernels' encoders against the chain's: every float32 in [-1, 1], every map.

    python benchmarks/check_encoder_exhaustive.py            # about 2.1e9 values per map; minutes on one core

The chain encodes with ``encode(y, map_id: Tensor)`` (the bfloat16-bucket table), the compiled fused kernels with
``encode(y, map_id: int)`` (an arithmetic first guess and one midpoint read), the C++ CPU kernel with its own packed
table (``_native.encode``; skipped if the kernel does not build). All must give the same code for every input the
codec can produce: every finite float32 ``y`` with ``|y| <= 1`` (``-0.0`` included). Prints the mismatch counts per
map.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _sweep import signed_floats  # benchmarks/, the script's folder

from fadam.quantization import _native
from fadam.quantization._maps import MAP_IDS, encode, tables_on


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    tables = tables_on("cpu")
    one = int(torch.tensor(1.0).view(torch.int32))  # bit pattern of 1.0: patterns 0..one are exactly [0, 1]
    native = _native._library() is not None
    total_bad = 0
    for name, map_id in MAP_IDS.items():
        start, bad_arithmetic, bad_native = time.perf_counter(), 0, 0
        for y in signed_floats(0, one):
            chain = encode(y, torch.tensor(map_id, dtype=torch.uint8), tables)
            bad_arithmetic += int((encode(y, map_id, tables) != chain).sum())
            if native:
                bad_native += int((_native.encode(y, map_id) != chain).sum())
        total_bad += bad_arithmetic + bad_native
        print(
            f"{name}: {2 * (one + 1)} values, {bad_arithmetic} mismatches (arithmetic), "
            f"{bad_native if native else 'not checked'} (C++) ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    sys.exit(1 if total_bad else 0)


if __name__ == "__main__":
    main()
