"""What ``fadam.pmap`` adds on top of ``torch.func.vmap``: the split, the moves and the merge, measured on the CPU.

    python benchmarks/bench_pmap.py [--leaves 200] [--members 8] [--repeats 30]

On a device list of one CPU, ``pmap`` does the same work as ``vmap`` plus its bookkeeping (flattening, splitting,
wrapping outputs in ``Sharded``); with two CPUs the work is also cut in two launches. Medians of interleaved repeats
in one process; small leaves, so the per-call overhead dominates.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.func import vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fadam


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=200)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--size", type=int, default=256, help="elements per leaf and member")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)

    tx = fadam.adamw(1e-3)
    params = {f"p{i}": torch.randn(args.members, args.size) for i in range(args.leaves)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    cpu = torch.device("cpu")
    runs: dict[str, Callable[[], object]] = {}
    vmap_state = vmap(tx.init)(params)
    runs["vmap(tx.update)"] = lambda: vmap(tx.update)(grads, vmap_state, params)
    for n in (1, 2):
        update = fadam.pmap(tx.update, [cpu] * n)
        state = update(grads, fadam.pmap(tx.init, [cpu] * n)(params), params)[1]  # Sharded, as in a loop
        runs[f"pmap(tx.update), {n} cpu"] = lambda update=update, state=state: update(grads, state, params)

    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():  # interleaved
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["vmap(tx.update)"])
    print(f"{args.leaves} leaves x {args.members} members x {args.size} elements, adamw, medians of {args.repeats}")
    print(f"{'call':<24} {'ms':>8} {'vs vmap':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<24} {median * 1e3:8.2f} {median / base:8.2f}x")


if __name__ == "__main__":
    main()
