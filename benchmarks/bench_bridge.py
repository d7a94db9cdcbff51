"""Step time of fadam.Optimizer against torch.optim on the same params, interleaved in one process.

    python benchmarks/bench_bridge.py [--numel 4000000] [--tensors 50] [--repeats 15]

Prints the median ms per ``optimizer.step()`` (gradients already in ``.grad``) and the ratio to torch's own
optimizer in the same mode. The bridge's fused path runs the same torch kernel as ``fused=True``; the general path
(transforms without a fused kernel, or a rescaled learning rate) runs the pure per-leaf update then adds in place.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import fadam


def make_params(numel: int, tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    size = numel // tensors
    params = [torch.nn.Parameter(torch.randn(size, generator=gen)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(size, generator=gen) * 1e-2
    return params


CASES = {
    # name: (fadam optimizer factory, torch optimizer factory)
    "adam (fused kernel)": (
        lambda ps: fadam.Optimizer(ps, fadam.adam(lr=1e-3), lr=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    ),
    "adam factory lr (fused kernel)": (
        lambda ps: fadam.Optimizer(ps, fadam.adam, lr=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    ),
    "adam rescaled lr (general path)": (
        lambda ps: _rescaled(fadam.Optimizer(ps, fadam.adam(lr=1e-3), lr=1e-3)),
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
    ),
    "adamw (fused kernel)": (
        lambda ps: fadam.Optimizer(ps, functools.partial(fadam.adamw, weight_decay=0.01), lr=1e-3),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
    ),
    "sgd momentum (fused kernel)": (
        lambda ps: fadam.Optimizer(ps, functools.partial(fadam.sgd, momentum=0.9), lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True),
    ),
    "nadam (general path)": (
        lambda ps: fadam.Optimizer(ps, fadam.nadam, lr=1e-3),
        lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    ),
    "rmsprop (general path)": (
        lambda ps: fadam.Optimizer(ps, fadam.rmsprop, lr=1e-3),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    ),
    "adagrad (fused kernel)": (
        lambda ps: fadam.Optimizer(ps, fadam.adagrad, lr=1e-3),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-3, fused=True),
    ),
}


def _rescaled(opt: fadam.Optimizer) -> fadam.Optimizer:
    opt.param_groups[0]["lr"] *= 0.5  # a scheduler moved the lr: updates are rescaled, no fused kernel
    return opt


def time_step(opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"{args.tensors} fp32 tensors, {args.numel / 1e6:.1f}M params, median of {args.repeats} steps (ms)")
    print(f"{'case':34s} {'fadam':>8s} {'torch':>8s} {'ratio':>6s}")
    for name, (make_ours, make_theirs) in CASES.items():
        ours, theirs = (
            make_ours(make_params(args.numel, args.tensors)),
            make_theirs(make_params(args.numel, args.tensors)),
        )
        for opt in (ours, theirs):  # warm up: state allocation, first kernel calls
            opt.step()
        times = {"fadam": [], "torch": []}
        for _ in range(args.repeats):  # interleaved so that machine noise hits both alike
            times["fadam"].append(time_step(ours))
            times["torch"].append(time_step(theirs))
        a, b = statistics.median(times["fadam"]), statistics.median(times["torch"])
        print(f"{name:34s} {a:8.2f} {b:8.2f} {a / b:6.2f}")


if __name__ == "__main__":
    main()
