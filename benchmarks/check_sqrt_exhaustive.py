"""Exhaustive check of the eager path's float32 square root (``fadam._program.EagerOps.sqrt``) against the IEEE one
(numpy's), which the generated kernels compute with the machine's instruction: every float32 from 0 to infinity, both
signs (a negative one's root is NaN on both).

    python benchmarks/check_sqrt_exhaustive.py   # 1-4 minutes on one core, by CPU

Where torch links MKL, torch's own float32 square root differs from the IEEE one in its last bit for 1-17% of
inputs, by CPU (8.5% on an AVX-512 AMD EPYC); the eager path takes MKL's float64 root and rounds it, which is the
IEEE float32 root (the reason is in ``fadam._program._mkl_float32``). Prints the mismatch count and torch's own, and
exits with 1 if the eager path has any.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _sweep import signed_floats  # benchmarks/, the script's folder

from fadam._program import EagerOps


def differing(got: torch.Tensor, expected: torch.Tensor) -> int:
    both_nan = got.isnan() & expected.isnan()
    return int(((got.view(torch.int32) != expected.view(torch.int32)) & ~both_nan).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    ours = torchs = total = 0
    for x in signed_floats(0, 0x7F800000):
        with numpy.errstate(invalid="ignore"):  # the roots of negative numbers
            expected = torch.from_numpy(numpy.sqrt(x.numpy()))
        ours += differing(EagerOps.sqrt(x), expected)
        torchs += differing(torch.sqrt(x), expected)
        total += x.numel()
    print(
        f"{total:,} float32 values: the eager path's square root differs from the IEEE one for {ours}, "
        f"torch.sqrt for {torchs} ({time.perf_counter() - start:.0f} s)"
    )
    sys.exit(1 if ours else 0)


if __name__ == "__main__":
    main()
