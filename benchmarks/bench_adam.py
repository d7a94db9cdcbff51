"""Adam step time: fadam (pure and donating) against torch.optim.Adam's three implementations.

Two workloads of 16.8M fp32 elements: (a) one tensor, (b) 200 tensors. All variants run interleaved in one process
(round-robin, one step each per round) so that machine noise hits them alike; medians are reported with ratios
against ``torch.optim.Adam(fused=True)`` and against the memory-bandwidth bound: an fp32 Adam step reads p, g, m, v
and writes p, m, v (28 bytes per element), divided by the in-place bandwidth measured here (``mul_`` on 64M floats).

Run: ``python benchmarks/bench_adam.py [--rounds 20] [--threads 2]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import fadam

ELEMENTS = 16_777_216


def inplace_bandwidth_gbs(rounds: int) -> float:
    x = torch.ones(64 * 1024 * 1024)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        x.mul_(1.0000001)
        times.append(time.perf_counter() - start)
    return 2 * x.numel() * 4 / statistics.median(times) / 1e9  # one read + one write per element


def make_variants(shapes: list[tuple[int, ...]]) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    params0 = [torch.randn(shape) for shape in shapes]
    grads = [torch.randn(shape) * 1e-2 for shape in shapes]
    variants: dict[str, Callable[[], None]] = {}

    for name, kwargs in [
        ("torch for-loop", {"foreach": False}),
        ("torch foreach", {"foreach": True}),
        ("torch fused", {"fused": True}),
    ]:
        params = [p.clone() for p in params0]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt = torch.optim.Adam(params, lr=1e-3, **kwargs)
        variants[name] = opt.step

    tx = fadam.adam(lr=1e-3)

    def pure_step_factory() -> Callable[[], None]:
        holder = {"params": [p.clone() for p in params0]}
        holder["state"] = tx.init(holder["params"])

        def run() -> None:
            holder["params"], holder["state"] = fadam.step(tx, holder["params"], grads, holder["state"])

        return run

    def pure_update_factory() -> Callable[[], None]:
        holder = {"params": [p.clone() for p in params0]}
        holder["state"] = tx.init(holder["params"])

        def run() -> None:
            updates, holder["state"] = tx.update(grads, holder["state"], holder["params"])
            holder["params"] = fadam.apply_updates(holder["params"], updates)

        return run

    def donating_factory() -> Callable[[], None]:
        holder = {"params": [p.clone() for p in params0]}
        holder["state"] = tx.init(holder["params"])

        def run() -> None:
            holder["params"], holder["state"] = fadam.step(tx, holder["params"], grads, holder["state"], donate=True)

        return run

    variants["fadam step, pure"] = pure_step_factory()
    variants["fadam update+apply, pure"] = pure_update_factory()
    variants["fadam step, donating"] = donating_factory()
    return variants


def measure(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    for run in variants.values():  # warm up: state allocation, first-step branches
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bandwidth = inplace_bandwidth_gbs(args.rounds)
    bound_ms = 28 * ELEMENTS / (bandwidth * 1e9) * 1e3
    print(f"torch {torch.__version__}, {args.threads} threads, in-place bandwidth {bandwidth:.1f} GB/s")
    print(f"bandwidth bound for one fp32 Adam step over {ELEMENTS:,} elements: {bound_ms:.1f} ms\n")
    workloads = {
        "(a) 1 x 16.8M": [(ELEMENTS,)],
        "(b) 200 tensors": [(ELEMENTS // 200,)] * 199 + [(ELEMENTS - 199 * (ELEMENTS // 200),)],
    }
    for workload, shapes in workloads.items():
        medians = measure(make_variants(shapes), args.rounds)
        fused, foreach = medians["torch fused"], medians["torch foreach"]
        print(f"{workload}: median ms per step over {args.rounds} interleaved rounds")
        print(f"  {'variant':<26}{'ms':>8}{'/ fused':>9}{'/ foreach':>11}{'/ bound':>9}")
        for name, ms in medians.items():
            print(f"  {name:<26}{ms:8.1f}{ms / fused:9.2f}{ms / foreach:11.2f}{ms / bound_ms:9.2f}")
        print()


if __name__ == "__main__":
    main()
