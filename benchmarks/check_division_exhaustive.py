"""Exhaustive check of the generated kernel's division of a square root by a number (``fadam_divide_root``: three
FMAs and a product, ``fadam._cpu_kernel._divided_roots``) against IEEE division: every float32 a square root can be
(zeros, 2**-75 to 2**64, infinity, NaN), for a set of divisors.

    python benchmarks/check_division_exhaustive.py            # the divisors below; seconds each
    python benchmarks/check_division_exhaustive.py 0.7 1e-3   # these divisors

The default divisors: Adam's bias corrections sqrt(1 - b2**t) for b2 in (0.9, 0.99, 0.999) and several t, the
ends of the significand (1 and 2 - 2**-23), the ends of the range the kernel takes without dividing (2**-50, 2**50),
and negative ones. Prints the mismatch count per divisor and exits with 1 if any.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _sweep import signed_floats  # benchmarks/, the script's folder

from tests.kernel_functions import kernel_divide_root

DEFAULT = [
    *(math.sqrt(1 - b2**t) for b2 in (0.9, 0.99, 0.999) for t in (1, 2, 10, 1000)),
    1.0,
    2 - 2**-23,
    2.0**-50,
    2.0**50,
    -0.7,
    -(2 - 2**-23) * 2.0**-3,
]


def bits_of(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


def mismatches(divisor: float) -> int:
    d = torch.tensor(divisor, dtype=torch.float32)
    least, most = bits_of(2.0**-75), bits_of(2.0**64)
    chunks = [torch.tensor([0.0, -0.0, float("inf"), float("nan")])]
    bad = 0
    for x in [*chunks, *(c for c in signed_floats(least, most) if c[0] >= 0)]:  # square roots are not negative
        got, _ = kernel_divide_root(x, float(d))
        expected = x / d
        both_nan = got.isnan() & expected.isnan()
        bad += int(((got.view(torch.int32) != expected.view(torch.int32)) & ~both_nan).sum())
    return bad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("divisors", nargs="*", type=float)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    total = 0
    for divisor in args.divisors or DEFAULT:
        start = time.perf_counter()
        bad = mismatches(divisor)
        total += bad
        print(
            f"d = {float(torch.tensor(divisor, dtype=torch.float32))!r}: {bad} mismatches "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    sys.exit(1 if total else 0)


if __name__ == "__main__":
    main()
