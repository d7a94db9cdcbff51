"""Exhaustive check of the encoders against the table encoder: every float32 in [-1, 1], every map.

    python benchmarks/check_encoder_exhaustive.py               # about 2.1e9 values per map; minutes a map on one core
    python benchmarks/check_encoder_exhaustive.py --from 0.99   # only magnitudes in [0.99, 1]: a smoke run

The codec's eager path encodes with ``encode(y, map_id: Tensor)`` (the bfloat16-bucket table: two table reads) or
``encode(y, map_id: int)`` (a first guess on the map's linear grid and one midpoint comparison); the generated C++
kernel with a table of its own (``fadam._cpu_kernel._encoder_table``: one read and an addition), compiled here on its
own (``tests/kernel_functions.py``). All must give the same code for every input the codec can produce: every finite
float32 ``y`` with ``|y| <= 1`` (``-0.0`` included). Prints the mismatch counts per map and exits with 1 if any.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _sweep import signed_floats  # benchmarks/, the script's folder

from fadam.quantization._maps import MAP_IDS, encode, tables_on
from tests.kernel_functions import kernel_encode


def bits_of(value: float) -> int:
    """The bit pattern of float32 ``value``: patterns 0 to that of 1.0 are exactly the magnitudes in [0, 1]."""
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


def mismatches(map_id: int, least: int, most: int) -> tuple[int, int]:
    """Inputs whose magnitude's pattern lies in ``[least, most]`` (both signs) where the arithmetic encoder and the
    kernel's differ from the table encoder."""
    tables = tables_on("cpu")
    table_id = torch.tensor(map_id, dtype=torch.uint8)
    static = kernel = 0
    for y in signed_floats(least, most):
        table = encode(y, table_id, tables)
        static += int((encode(y, map_id, tables) != table).sum())
        kernel += int((kernel_encode(y, map_id) != table).sum())
    return static, kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--from", dest="lowest", type=float, default=0.0, help="smallest magnitude checked (>= 0)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not 0.0 <= args.lowest <= 1.0:
        parser.error("--from must lie in [0, 1]")
    torch.set_num_threads(args.threads)
    least, most = bits_of(args.lowest), bits_of(1.0)
    values = 2 * (most - least + 1)
    print(f"{values} values per map, |y| in [{args.lowest}, 1]", flush=True)
    total_bad = 0
    for name, map_id in MAP_IDS.items():
        start = time.perf_counter()
        static, kernel = mismatches(map_id, least, most)
        total_bad += static + kernel
        elapsed = time.perf_counter() - start
        print(f"{name}: {static} arithmetic and {kernel} kernel mismatches ({elapsed:.0f} s)", flush=True)
    sys.exit(1 if total_bad else 0)


if __name__ == "__main__":
    main()
