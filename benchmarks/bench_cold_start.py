"""The first step of a chain in a fresh process: with an empty kernel cache (cold), then with the cache it left (warm).

    python benchmarks/bench_cold_start.py [--leaves 200]

Each row runs two child processes with ``FADAM_CACHE_DIR`` set to a new empty folder: the first builds the chain's
generated kernels (the system C++ compiler) and, as it exits, starts the build of the compiled leaf checks
(``fadam._compiled_checks``, in a process of its own; its step checks its leaves in Python); the second, once that
build is in the folder, loads them all from it. Each child times one donated ``fadam.step`` right after ``init``, over
``--leaves`` float32 tensors of 16.8M elements in all (bfloat16 for the bfloat16 row). Python and torch start-up are
outside the timed region.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fadam

ELEMENTS = 16_777_216
CHAINS = {
    "clip+adamw chain": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-3, weight_decay=1e-2)),
    "lion": lambda: fadam.lion(1e-4, weight_decay=1e-2),
    "lion, bfloat16 params": lambda: fadam.lion(1e-4, weight_decay=1e-2),
    "lamb (two segments)": lambda: fadam.lamb(1e-3, weight_decay=1e-2),
    "adafactor (three segments)": lambda: fadam.adafactor(1e-3),
    "adamw8bit": lambda: fadam.adamw8bit(1e-3, weight_decay=1e-2),
    "lion8bit": lambda: fadam.lion8bit(1e-4, weight_decay=1e-2),
}


def first_step(name: str, leaves: int) -> float:
    """Seconds of the first donated step of ``CHAINS[name]`` (run in the child process)."""
    dtype = torch.bfloat16 if "bfloat16" in name else torch.float32
    params = {f"w{i}": torch.randn(ELEMENTS // leaves).to(dtype) for i in range(leaves)}
    grads = {k: torch.randn_like(v) * 1e-2 for k, v in params.items()}
    tx = CHAINS[name]()
    state = tx.init(params)
    start = time.perf_counter()
    fadam.step(tx, params, grads, state, donate=True)
    return time.perf_counter() - start


def in_child(name: str, leaves: int, cache: str) -> float:
    env = {**os.environ, "FADAM_CACHE_DIR": cache}
    command = [sys.executable, __file__, "--child", name, "--leaves", str(leaves)]
    return float(subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.split()[-1])


def wait_for_checks(cache: str, seconds: float = 300.0) -> None:
    """Waits until the build of the compiled checks that a cold child started is in ``cache``."""
    deadline = time.monotonic() + seconds
    while not list(Path(cache, "checks").glob("*.so")) and time.monotonic() < deadline:
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=200)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(first_step(args.child, args.leaves))
        return
    print(f"first donated step after init, {args.leaves} tensors, {torch.get_num_threads()} threads")
    print(f"{'chain':<28}{'cold (s)':>10}{'warm (s)':>10}")
    for name in CHAINS:
        with tempfile.TemporaryDirectory(prefix="fadam-cold-") as cache:
            cold = in_child(name, args.leaves, cache)
            wait_for_checks(cache)
            warm = in_child(name, args.leaves, cache)
        print(f"{name:<28}{cold:>10.2f}{warm:>10.2f}")


if __name__ == "__main__":
    main()
