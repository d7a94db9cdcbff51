"""Step time of fadam's chains and aliases against their closest torch.optim anchors, and against the bandwidth bound.

Two workloads of 16.8M fp32 elements: (a) one tensor, (b) 200 tensors (the shapes of ``bench_adam.py``). Every variant
runs interleaved in one process (round-robin, one step each per round, after two warm-up steps) so that machine noise
hits them alike; the medians are compared as ``ratio = fadam ms / anchor ms``. fadam variants are donated steps,
``fadam.step(tx, params, grads, state, donate=True)``, on their own clones of the same initial params with fixed grads
(``randn * 1e-2``); row 7 is the pure path, ``tx.update`` + ``fadam.apply_updates``. The torch anchor of rows 1-2
clips its ``.grad`` in place, so its grads are re-copied from the fixed grads outside the timed region before each of
its steps. The bound is the bytes per element the fadam variant must move (``BYTES`` below) over the in-place
bandwidth (``mul_`` on 64M floats, timed as one more variant of the same rounds, so that it sees the machine as the
rows do), shown in ms and as a fraction of the anchor's time. A "first step (s)" table gives each variant's first step
after ``init`` (cold: includes any kernel build, so workload (b) sees whatever (a) already built). A fadam variant
that raises is skipped with a printed note.

Run: ``python benchmarks/bench_chains.py [--rounds 20] [--threads 2]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fadam

ELEMENTS = 16_777_216
PROBE = "in-place mul_ (bandwidth)"
PROBE_ELEMENTS = 64 * 1024 * 1024

# Bytes per element the fadam variant must move at the least, fp32 tensors (4 bytes), 8-bit codes (1 byte) and one
# fp32 absmax per 256-element block and moment (4 / 256 bytes, read + written: 2 * 4 / 256 per 8-bit moment).
ADAMW = 28  # read p, g, m, v (16); write p, m, v (12)
CLIP_ADAMW = 32  # the global norm is one more read of g before the AdamW pass
LION = 20  # read p, g, m (12); write p, m (8)
SGD_MOMENTUM = 20  # read p, g, m (12); write p, m (8)
ADAMW_8BIT = 16 + 2 * 2 * 4 / 256  # read p, g (8) + codes of m, v (2); write p (4) + codes (2); absmax of m and v
LION_8BIT = 14 + 2 * 4 / 256  # read p, g (8) + code of m (1); write p (4) + code (1); absmax of m
ADAM_PURE = 36  # update: read g, m, v, write m', v', u (24); apply_updates: read p, u, write p' (12)
BYTES = {
    "1 clip+adamw chain": CLIP_ADAMW,
    "2 optax-style chain": CLIP_ADAMW,  # add_decayed_weights and the schedule fold into the same pass
    "3 lion": LION,
    "4 sgd nesterov": SGD_MOMENTUM,
    "5 adamw alias": ADAMW,
    "6 adamw8bit": ADAMW_8BIT,
    "6 lion8bit": LION_8BIT,
    "7 adam update+apply": ADAM_PURE,
    "8 page_state host": ADAMW,  # paging's copies to and from storage are overhead over the in-memory bound
    "8 page_state disk": ADAMW,
    "8 paged_adamw8bit": ADAMW_8BIT,
    "8 paged_adamw8bit disk": ADAMW_8BIT,
}
# Each row's anchor: a torch variant, or (rows 8) the in-memory fadam variant it pages.
ANCHOR = {
    "1 clip+adamw chain": "torch clip_grad_norm_ + AdamW fused",
    "2 optax-style chain": "torch clip_grad_norm_ + AdamW fused",
    "3 lion": "torch AdamW fused",
    "4 sgd nesterov": "torch SGD nesterov fused",
    "5 adamw alias": "torch AdamW fused",
    "6 adamw8bit": "torch AdamW fused",
    "6 lion8bit": "torch AdamW fused",
    "7 adam update+apply": "torch Adam foreach",
    "8 page_state host": "5 adamw alias",
    "8 page_state disk": "5 adamw alias",
    "8 paged_adamw8bit": "6 adamw8bit",
    "8 paged_adamw8bit disk": "6 adamw8bit",
}


@dataclass
class Variant:
    run: Callable[[], None]
    prepare: Callable[[], None] | None = None  # runs before each step, outside the timed region


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name":
            return value.strip()
    return platform.processor() or "unknown CPU"


def print_machine(threads: int, bandwidth: float | None, workloads: str = "") -> None:
    """The header of a benchmark's table: the CPU, torch, the threads, the bandwidth where it was measured first
    (then ``workloads``) and the load."""
    print(f"{cpu_model()}, torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    measured = "" if bandwidth is None else f", in-place bandwidth {bandwidth:.1f} GB/s"
    print(f"{threads} threads{measured}{workloads}")
    print(f"load average at start {os.getloadavg()[0]:.2f} (other processes on the machine skew every figure)\n")


def fadam_txs(disk_dir: Path) -> dict[str, Callable[[], fadam.GradientTransformation]]:
    """The fadam transforms, built lazily so that a missing or failing one only skips its own row."""
    return {
        "1 clip+adamw chain": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-3, weight_decay=1e-2)),
        "2 optax-style chain": lambda: fadam.chain(
            fadam.clip_by_global_norm(1.0),
            fadam.scale_by_adam(),
            fadam.add_decayed_weights(1e-2),
            fadam.scale_by_learning_rate(fadam.cosine_decay_schedule(1e-3, 10_000)),
        ),
        "3 lion": lambda: fadam.lion(1e-4, weight_decay=1e-2),
        "4 sgd nesterov": lambda: fadam.sgd(1e-3, momentum=0.9, nesterov=True),
        "5 adamw alias": lambda: fadam.adamw(1e-3, weight_decay=1e-2),
        "6 adamw8bit": lambda: fadam.adamw8bit(1e-3, weight_decay=1e-2),
        "6 lion8bit": lambda: fadam.lion8bit(1e-4, weight_decay=1e-2),
        "7 adam update+apply": lambda: fadam.adam(1e-3),
        # AdamW's declaration shows that it treats each leaf on its own, so by default it streams chunk by chunk
        "8 page_state host": lambda: fadam.page_state(fadam.adamw(1e-3), storage="host"),
        "8 page_state disk": lambda: fadam.page_state(fadam.adamw(1e-3), storage="disk", path=disk_dir / "adamw.state"),
        "8 paged_adamw8bit": lambda: fadam.paged_adamw8bit(1e-3, weight_decay=1e-2),
        "8 paged_adamw8bit disk": lambda: fadam.paged_adamw8bit(
            1e-3, weight_decay=1e-2, storage="disk", path=disk_dir / "adamw8bit.state"
        ),
    }


def fadam_variant(
    name: str, tx: fadam.GradientTransformation, params0: list[torch.Tensor], grads: list[torch.Tensor]
) -> Variant:
    holder: dict[str, Any] = {"params": [p.clone() for p in params0]}
    holder["state"] = tx.init(holder["params"])
    if name.startswith("7 "):  # the pure path: nothing passed in is modified

        def run() -> None:
            updates, holder["state"] = tx.update(grads, holder["state"], holder["params"])
            holder["params"] = fadam.apply_updates(holder["params"], updates)

    else:

        def run() -> None:
            holder["params"], holder["state"] = fadam.step(tx, holder["params"], grads, holder["state"], donate=True)

    return Variant(run)


def torch_variants(params0: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, Variant]:
    def optimizer(cls: type[torch.optim.Optimizer], own_grads: bool, **kwargs: Any) -> torch.optim.Optimizer:
        params = [p.clone() for p in params0]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone() if own_grads else g
        return cls(params, **kwargs)

    clipped = optimizer(torch.optim.AdamW, True, lr=1e-3, weight_decay=1e-2, fused=True)
    clipped_params = clipped.param_groups[0]["params"]

    def clip_step() -> None:
        torch.nn.utils.clip_grad_norm_(clipped_params, 1.0, foreach=True)
        clipped.step()

    def refill() -> None:
        torch._foreach_copy_([p.grad for p in clipped_params], grads)

    adamw = optimizer(torch.optim.AdamW, False, lr=1e-3, weight_decay=1e-2, fused=True)
    sgd = optimizer(torch.optim.SGD, False, lr=1e-3, momentum=0.9, nesterov=True, fused=True)
    adam = optimizer(torch.optim.Adam, False, lr=1e-3, foreach=True)
    return {
        "torch clip_grad_norm_ + AdamW fused": Variant(clip_step, refill),
        "torch AdamW fused": Variant(adamw.step),
        "torch SGD nesterov fused": Variant(sgd.step),
        "torch Adam foreach": Variant(adam.step),
    }


def call(variant: Variant) -> float:
    if variant.prepare is not None:
        variant.prepare()
    start = time.perf_counter()
    variant.run()
    return time.perf_counter() - start


def measure(shapes: list[tuple[int, ...]], rounds: int, disk_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Builds every variant, times its first step, then ``rounds`` interleaved rounds: (first-step s, median ms)."""
    torch.manual_seed(0)
    params0 = [torch.randn(shape) for shape in shapes]
    grads = [torch.randn(shape) * 1e-2 for shape in shapes]
    variants = torch_variants(params0, grads)
    # the bandwidth of the bounds, measured in the same rounds as the rows, so that it sees the same machine
    probe = torch.ones(PROBE_ELEMENTS)
    variants[PROBE] = Variant(lambda: probe.mul_(1.0000001))
    first: dict[str, float] = {}
    for name, make_tx in fadam_txs(disk_dir).items():
        try:
            variants[name] = fadam_variant(name, make_tx(), params0, grads)
            first[name] = call(variants[name])
        except Exception:
            variants.pop(name, None)
            print(f"note: skipping {name!r}, it raised:\n{traceback.format_exc()}")
    for name, variant in variants.items():
        if name not in first:
            first[name] = call(variant)
    for variant in variants.values():  # warm up: state allocation, first-step branches
        call(variant)
        call(variant)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, variant in list(variants.items()):
            try:
                times[name].append(call(variant))
            except Exception:
                del variants[name], times[name]
                print(f"note: dropping {name!r}, a timed step raised:\n{traceback.format_exc()}")
    return first, {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print_machine(args.threads, None, f", {ELEMENTS:,} fp32 elements per workload")
    workloads = {
        "(a) 1 x 16.8M": [(ELEMENTS,)],
        "(b) 200 tensors": [(ELEMENTS // 200,)] * 199 + [(ELEMENTS - 199 * (ELEMENTS // 200),)],
    }
    firsts: dict[str, dict[str, float]] = {}
    medians: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="fadam-bench-chains-") as tmp:
        for workload, shapes in workloads.items():
            disk_dir = Path(tmp) / workload[1]
            disk_dir.mkdir()
            firsts[workload], medians[workload] = measure(shapes, args.rounds, disk_dir)

    # one read and one write of each element of the probe
    bandwidths = {workload: 2 * PROBE_ELEMENTS * 4 / (ms[PROBE] / 1e3) / 1e9 for workload, ms in medians.items()}
    measured = ", ".join(f"{workload[:3]} {gbs:.1f}" for workload, gbs in bandwidths.items())
    print(f"median ms per step over {args.rounds} interleaved rounds; ratio = fadam / anchor")
    print(f"bound = bytes per element / in-place bandwidth measured in the same rounds ({measured} GB/s)")
    print(f"{'row':<24}{'workload':<17}{'fadam ms':>9}{'anchor ms':>10}{'ratio':>7}{'bound ms':>9}{'bound/anchor':>13}")
    for row, nbytes in BYTES.items():
        for workload, ms in medians.items():
            if row not in ms or ANCHOR[row] not in ms:
                print(f"{row:<24}{workload:<17}  skipped (it or its anchor raised)")
                continue
            fadam_ms, anchor_ms = ms[row], ms[ANCHOR[row]]
            bound_ms = nbytes * ELEMENTS / (bandwidths[workload] * 1e9) * 1e3
            print(
                f"{row:<24}{workload:<17}{fadam_ms:9.1f}{anchor_ms:10.1f}{fadam_ms / anchor_ms:7.2f}"
                f"{bound_ms:9.1f}{bound_ms / anchor_ms:13.2f}"
            )
    print("\nanchors:")
    for row in BYTES:
        print(f"  {row:<24}{ANCHOR[row]}")

    print("\nfirst step (s): the first step after init, before warm-up")
    names = list(dict.fromkeys(name for first in firsts.values() for name in first if name != PROBE))
    print(f"  {'variant':<37}" + "".join(f"{workload:>17}" for workload in firsts))
    for name in names:
        cells = "".join(f"{first[name]:17.3f}" if name in first else f"{'-':>17}" for first in firsts.values())
        print(f"  {name:<37}{cells}")
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
