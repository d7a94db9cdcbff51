"""Per-step cost of the training-loop wrappers around Adam, against the plain alias, in one process, interleaved.

    python benchmarks/bench_training_wrappers.py [--leaves 20] [--size 50000] [--repeats 30] [--threads 2]

Rows: plain ``adam``; ``inject_hyperparams(adam)`` with a float lr and with a schedule (the factory is re-called each
step); ``apply_if_finite(adam)`` (one finiteness reduction per leaf); ``MultiSteps(adam, 1)`` (the accumulator pass);
a schedule evaluated alone. Each through ``tx.update`` + ``apply_updates`` and through ``fadam.step`` (which keeps
the fused kernel for the plain and injected alias). Prints medians in ms and the ratio to plain adam on the same path.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import fadam


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=20)
    parser.add_argument("--size", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = {f"p{i}": torch.randn(args.size) for i in range(args.leaves)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    schedule = fadam.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)
    variants = {
        "adam": fadam.adam(lr=1e-3),
        "inject(adam) lr=float": fadam.inject_hyperparams(fadam.adam)(lr=1e-3),
        "inject(adam) lr=schedule": fadam.inject_hyperparams(fadam.adam)(lr=schedule),
        "apply_if_finite(adam)": fadam.apply_if_finite(fadam.adam(lr=1e-3), 5),
        "MultiSteps(adam, k=1)": fadam.MultiSteps(fadam.adam(lr=1e-3), 1).gradient_transformation(),
    }
    states = {name: tx.init(params) for name, tx in variants.items()}

    def via_update(tx: fadam.GradientTransformation, state) -> Callable[[], None]:
        def run() -> None:
            updates, _ = tx.update(grads, state, params)
            fadam.apply_updates(params, updates)

        return run

    def via_step(tx: fadam.GradientTransformation, state) -> Callable[[], None]:
        return lambda: fadam.step(tx, params, grads, state)

    cases = {}
    for name, tx in variants.items():
        cases[(name, "update")] = via_update(tx, states[name])
        cases[(name, "step")] = via_step(tx, states[name])
    count = torch.tensor(500, dtype=torch.int32)
    cases[("schedule alone", "call")] = lambda: schedule(count)

    times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for fn in cases.values():
        fn()  # warm up
    for _ in range(args.repeats):  # interleaved: every case once per round
        for key, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)

    print(f"{args.leaves} leaves x {args.size} float32, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'variant':28} {'path':7} {'ms':>9} {'vs adam':>8}")
    for (name, path), samples in times.items():
        median = statistics.median(samples) * 1e3
        base = times.get(("adam", path))
        ratio = f"{median / (statistics.median(base) * 1e3):.2f}x" if base else ""
        print(f"{name:28} {path:7} {median:9.3f} {ratio:>8}")


if __name__ == "__main__":
    main()
