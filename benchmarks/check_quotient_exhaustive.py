"""Exhaustive check of the C++ CPU kernel's division by a bias correction through its reciprocal.

    python benchmarks/check_quotient_exhaustive.py [THREADS] [B ...]   # about 3.4e9 values per b; a minute each

The kernel (fadam/quantization/_adam_rows.cpp: quotient) computes m / bc1 and sqrt(v) / bc2_sqrt as q = x * (1 / b)
and one FMA correction, where b lies in [2**-20, 1] and every |x| of a row in [2**-100, 2**100] (or 0); elsewhere it
divides. This compares it with IEEE division (torch's) for every float32 x in that range, both signs, and each b:
by default the float32 bias corrections 1 - b1**t of common betas at early steps, sqrt(1 - b2**t), random b in the
range and b with all-ones significands. Prints the mismatch count per b; exits 1 if any.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _sweep import signed_floats  # benchmarks/, the script's folder

from fadam.quantization import _native


def default_divisors() -> list[float]:
    """Bias corrections as the kernel receives them (rounded to float32), and others across [2**-20, 1]."""
    chosen = [1 - b1**t for b1 in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999) for t in (1, 2, 3, 5, 10, 50)]
    chosen += [(1 - b2**t) ** 0.5 for b2 in (0.95, 0.99, 0.999) for t in (1, 2, 3, 10, 100)]
    rng = random.Random(1)
    chosen += [2.0 ** rng.uniform(-20, 0) for _ in range(8)]
    chosen += [2.0**e * (2 - 2.0**-23) for e in (-20, -8, -4, -2, -1)]  # all-ones significands
    chosen += [2.0**-20, 1.0]
    return sorted({torch.tensor(b, dtype=torch.float32).item() for b in chosen})


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    divisors = [torch.tensor(float(b), dtype=torch.float32).item() for b in sys.argv[2:]] or default_divisors()
    least, most = (torch.tensor(2.0**e).view(torch.int32).item() for e in (-100, 100))
    total_bad = 0
    for b in divisors:
        start, bad = time.perf_counter(), 0
        for x in signed_floats(least, most):
            got = _native.quotient(x, b)
            if got is None:
                raise SystemExit(f"the kernel divides by b = {b!r}: outside [2**-20, 1], or no FMA on this CPU")
            bad += int((got.view(torch.int32) != (x / torch.full_like(x, b)).view(torch.int32)).sum())
        total_bad += bad
        print(
            f"b = {b!r} ({b.hex()}): {2 * (most - least + 1)} values, {bad} mismatches "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    sys.exit(1 if total_bad else 0)


if __name__ == "__main__":
    main()
