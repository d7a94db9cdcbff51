"""Core Adam on CUDA: parity with torch.optim and step time against torch's foreach and fused kernels.

Needs a CUDA device. Times with CUDA events, all variants interleaved; prints a table and writes it to
``$OUT/core.txt`` when ``OUT`` is set. Run: ``python benchmarks/gpu_core.py``
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch

import fadam

ELEMENTS = 64 * 1024 * 1024
lines: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    lines.append(text)


def cuda_time_ms(run: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def copy_bandwidth_gbs() -> float:
    x = torch.empty(ELEMENTS * 4, device="cuda")
    y = torch.empty_like(x)
    times = [cuda_time_ms(lambda: y.copy_(x)) for _ in range(20)]
    return 2 * x.numel() * 4 / (statistics.median(times[5:]) * 1e-3) / 1e9


def parity(steps: int = 100) -> None:
    torch.manual_seed(0)
    shapes = [(1000, 300), (4097,), (64, 3, 3, 3)]
    params0 = [torch.randn(s, device="cuda") for s in shapes]
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(steps)]
    for name, make, torch_cls, kwargs in [
        ("adam", fadam.adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
        ("adamw", fadam.adamw, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        ("sgd", fadam.sgd, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    ]:
        for path in ("update+apply", "step donate"):
            reference = [p.clone().requires_grad_() for p in params0]
            opt = torch_cls(reference, foreach=False, **kwargs)
            tx = make(**kwargs)
            params = [p.clone() for p in params0]
            state = tx.init(params)
            worst = 0.0
            for gs in grads:
                for p, g in zip(reference, gs, strict=True):
                    p.grad = g.clone()
                opt.step()
                if path == "update+apply":
                    updates, state = tx.update(gs, state, params)
                    params = fadam.apply_updates(params, updates)
                else:
                    params, state = fadam.step(tx, params, gs, state, donate=True)
                for a, b in zip(params, reference, strict=True):
                    worst = max(worst, ((a - b.detach()).abs().max() / b.detach().abs().max()).item())
            say(f"parity {name:6} {path:13} vs torch for-loop on CUDA, {steps} steps: max rel diff {worst:.2e}")


def timing(shapes: list[tuple[int, ...]], label: str, bound_ms: float, rounds: int = 30) -> None:
    torch.manual_seed(0)
    params0 = [torch.randn(s, device="cuda") for s in shapes]
    grads = [torch.randn(s, device="cuda") * 1e-2 for s in shapes]
    variants: dict[str, Callable[[], None]] = {}
    for name, kwargs in [("torch foreach", {"foreach": True}), ("torch fused", {"fused": True})]:
        ps = [p.clone() for p in params0]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g
        variants[name] = torch.optim.Adam(ps, lr=1e-3, **kwargs).step
    tx = fadam.adam(lr=1e-3)
    holders = {}
    for name in ("fadam step, donating", "fadam step, pure", "fadam update+apply, pure"):
        holder = {"params": [p.clone() for p in params0]}
        holder["state"] = tx.init(holder["params"])
        holders[name] = holder

    def donating() -> None:
        h = holders["fadam step, donating"]
        h["params"], h["state"] = fadam.step(tx, h["params"], grads, h["state"], donate=True)

    def pure_step() -> None:
        h = holders["fadam step, pure"]
        h["params"], h["state"] = fadam.step(tx, h["params"], grads, h["state"])

    def pure_update() -> None:
        h = holders["fadam update+apply, pure"]
        updates, h["state"] = tx.update(grads, h["state"], h["params"])
        h["params"] = fadam.apply_updates(h["params"], updates)

    variants.update({"fadam step, donating": donating, "fadam step, pure": pure_step})
    variants["fadam update+apply, pure"] = pure_update
    for run in variants.values():
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(cuda_time_ms(run))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    say(f"{label}: median ms per step over {rounds} interleaved rounds (CUDA events)")
    say(f"  {'variant':<26}{'ms':>8}{'/ fused':>9}{'/ foreach':>11}{'/ bound':>9}")
    for name, ms in medians.items():
        say(
            f"  {name:<26}{ms:8.3f}{ms / medians['torch fused']:9.2f}{ms / medians['torch foreach']:11.2f}"
            f"{ms / bound_ms:9.2f}"
        )


def main() -> None:
    assert torch.cuda.is_available(), "needs CUDA"
    say(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    bandwidth = copy_bandwidth_gbs()
    bound_ms = 28 * ELEMENTS / (bandwidth * 1e9) * 1e3
    say(f"device copy bandwidth {bandwidth:.0f} GB/s; fp32 Adam bound over {ELEMENTS:,} elements {bound_ms:.3f} ms")
    parity()
    timing([(ELEMENTS,)], f"(a) 1 x {ELEMENTS / 1e6:.0f}M", bound_ms)
    timing([(ELEMENTS // 200,)] * 199 + [(ELEMENTS - 199 * (ELEMENTS // 200),)], "(b) 200 tensors", bound_ms)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "core.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
