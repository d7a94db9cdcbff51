"""Paged optimizer state on the CPU: speed against in-memory state, and peak resident memory of disk paging.

    python benchmarks/bench_paged.py              # both parts
    python benchmarks/bench_paged.py --part speed
    python benchmarks/bench_paged.py --part rss --state-gib 4

speed: Adam over 16.8M fp32 params in 8 leaves (the anchors' size), in-memory vs paged in host memory vs paged on disk
(the file in the page cache), interleaved in one process; medians of ``tx.update`` and of ``fadam.step(donate=True)``
(the fused kernel for in-memory Adam; chunk by chunk for paged Adam).

rss: one subprocess per configuration trains a model whose fp32 Adam state is ``--state-gib`` GiB (params half of
that) for a few steps with ``fadam.step(donate=True)``, and reports its peak resident set (``ru_maxrss``): a throwaway
SGD (no state) as the baseline, Adam paged on disk, and, with ``--with-in-memory``, Adam in memory. The state file goes
to the temp directory and is deleted.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fadam  # noqa: E402

LEAF = 1 << 23  # 8M floats per leaf: 64 MiB of Adam state, one chunk each at the default chunk_bytes


def speed(repeats: int) -> None:
    torch.manual_seed(0)
    params = {f"w{i}": torch.randn(2_097_152) for i in range(8)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    path = os.path.join(tempfile.gettempdir(), f"fadam-bench-speed-{os.getpid()}.state")
    configs = {
        "in-memory": fadam.adam(lr=1e-3),
        "paged host": fadam.paged_adam(lr=1e-3),
        "paged disk": fadam.paged_adam(lr=1e-3, storage="disk", path=path),
    }
    states = {name: tx.init(params) for name, tx in configs.items()}
    stepped = {name: {k: v.clone() for k, v in params.items()} for name in configs}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for rep in range(repeats + 1):  # the first round warms the page cache and the allocator
            for name, tx in configs.items():
                start = time.perf_counter()
                updates, states[name] = tx.update(grads, states[name], params)
                elapsed_update = time.perf_counter() - start
                del updates
                start = time.perf_counter()
                stepped[name], states[name] = fadam.step(tx, stepped[name], grads, states[name], donate=True)
                elapsed_step = time.perf_counter() - start
                if rep:
                    times.setdefault((name, "update"), []).append(elapsed_update)
                    times.setdefault((name, "step"), []).append(elapsed_step)
    finally:
        os.unlink(path)
    print(f"\nAdam, 16.8M fp32 params in 8 leaves, {repeats} interleaved repeats, {torch.get_num_threads()} threads")
    print(f"{'configuration':<12} {'update ms':>10} {'ratio':>7} {'step ms':>9} {'ratio':>7}")
    base = {kind: statistics.median(times[("in-memory", kind)]) for kind in ("update", "step")}
    for name in configs:
        update, step = (statistics.median(times[(name, kind)]) for kind in ("update", "step"))
        print(
            f"{name:<12} {update * 1e3:>10.1f} {update / base['update']:>7.2f} {step * 1e3:>9.1f} "
            f"{step / base['step']:>7.2f}"
        )
    print("target: paged update <= 1.3x the in-memory update (file in the page cache)")


def child(config: str, leaves: int, steps: int, path: str) -> None:
    """One training run; prints its peak RSS and seconds per step."""
    torch.manual_seed(0)
    params = [torch.randn(LEAF) for _ in range(leaves)]
    grad = torch.randn(LEAF) * 1e-3
    grads = [grad] * leaves  # one gradient buffer for every leaf: the baseline memory is the params
    if config == "sgd":
        tx = fadam.sgd(lr=1e-3)
    elif config == "adam-in-memory":
        tx = fadam.adam(lr=1e-3)
    else:
        tx = fadam.paged_adam(lr=1e-3, storage="disk", path=path)
    start = time.perf_counter()
    state = tx.init(params)
    init_s = time.perf_counter() - start
    rss_steps = []
    start = time.perf_counter()
    for _ in range(steps):
        params, state = fadam.step(tx, params, grads, state, donate=True)
        rss_steps.append(_rss_now())
    step_s = (time.perf_counter() - start) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"RESULT {peak} {init_s} {step_s} {max(rss_steps)}")


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss(state_gib: float, steps: int, with_in_memory: bool) -> None:
    leaves = max(1, round(state_gib * 2**30 / (8 * LEAF)))
    state_bytes = leaves * LEAF * 8
    path = os.path.join(tempfile.gettempdir(), f"fadam-bench-rss-{os.getpid()}.state")
    configs = ["sgd", "adam-paged-disk"] + (["adam-in-memory"] if with_in_memory else [])
    results = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        for config in configs:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    config,
                    "--leaves",
                    str(leaves),
                    "--steps",
                    str(steps),
                    "--path",
                    path,
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            line = next(x for x in out.splitlines() if x.startswith("RESULT"))
            peak, init_s, step_s, step_rss = line.split()[1:]
            results[config] = (int(peak), float(init_s), float(step_s), int(step_rss))
            if os.path.exists(path):
                os.unlink(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    gib = 2**30
    print(
        f"\nfp32 Adam state {state_bytes / gib:.2f} GiB ({leaves} leaves of {LEAF:,} params, "
        f"params {state_bytes / 2 / gib:.2f} GiB), {steps} steps of fadam.step(donate=True)"
    )
    print(f"{'configuration':<16} {'peak RSS GiB':>12} {'vs SGD GiB':>10} {'init s':>7} {'s/step':>7}")
    base = results["sgd"][0]
    for config, (peak, init_s, step_s, _) in results.items():
        print(f"{config:<16} {peak / gib:>12.3f} {(peak - base) / gib:>+10.3f} {init_s:>7.1f} {step_s:>7.2f}")
    print("target: adam-paged-disk peak RSS <= SGD + 0.5 GiB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["speed", "rss", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--state-gib", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--with-in-memory", action="store_true")
    parser.add_argument("--child")
    parser.add_argument("--leaves", type=int)
    parser.add_argument("--path")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.child:
        child(args.child, args.leaves, args.steps, args.path)
        return
    if args.part in ("speed", "all"):
        speed(args.repeats)
    if args.part in ("rss", "all"):
        rss(args.state_gib, args.steps, args.with_in_memory)


if __name__ == "__main__":
    main()
