"""GPU checks for fadam.Optimizer and the new aliases on CUDA, against torch.optim.

    python benchmarks/gpu_bridge.py          # < 90 s on one GPU; writes $OUT/bridge.txt when $OUT is set

1. Parity: fadam.Optimizer(adam / adamw factory + CosineAnnealingLR / sgd) vs torch.optim fused, bit for bit
   expected (same kernels), and nadam/radam/rmsprop/adagrad/adamax vs torch's default CUDA path (foreach) over
   200 steps (max relative error).
2. Mixed precision: examples/train_module.py on CUDA (float16 autocast + GradScaler) and a step with an inf gradient
   that GradScaler must skip.
3. Speed: median ms per optimizer.step() on 200 fp32 tensors / 16.8M params, fadam.Optimizer vs torch.optim
   (fused and foreach), interleaved.
"""

from __future__ import annotations

import functools
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fadam  # noqa: E402

LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def model(device: torch.device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).to(device)


def train(net, opt, steps, device, scheduler=None):
    gen = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (32,), generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def max_rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        float((p.detach() - q.detach()).abs().max() / q.detach().abs().max())
        for p, q in zip(a.parameters(), b.parameters())
    )


def parity(device: torch.device) -> None:
    emit("== parity on CUDA (max relative param difference after N steps)")
    cases = [
        (
            "adam vs Adam(fused)",
            lambda ps: fadam.Optimizer(ps, fadam.adam(lr=1e-3), lr=1e-3),
            lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
            None,
            0.0,
        ),
        (
            "adamw factory+cosine vs AdamW(fused)+cosine",
            lambda ps: fadam.Optimizer(ps, functools.partial(fadam.adamw, weight_decay=0.1), lr=1e-3),
            lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
            "cosine",
            0.0,
        ),
        (
            "sgd momentum vs SGD(fused)",
            lambda ps: fadam.Optimizer(ps, functools.partial(fadam.sgd, momentum=0.9), lr=1e-2),
            lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
            None,
            0.0,
        ),
        (
            "adam vs Adam(foreach)",
            lambda ps: fadam.Optimizer(ps, fadam.adam(lr=1e-3), lr=1e-3),
            lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
            None,
            1e-5,
        ),
    ]
    for name, cls in [
        ("nadam", torch.optim.NAdam),
        ("radam", torch.optim.RAdam),
        ("rmsprop", torch.optim.RMSprop),
        ("adagrad", torch.optim.Adagrad),
        ("adamax", torch.optim.Adamax),
    ]:
        cases.append(
            (
                f"{name} vs {cls.__name__}(default)",
                lambda ps, n=name: fadam.Optimizer(ps, getattr(fadam, n), lr=1e-3),
                lambda ps, c=cls: c(ps, lr=1e-3),
                None,
                1e-5,
            )
        )
    steps = 200
    for name, ours, theirs, sched, tol in cases:
        a, b = model(device), model(device)
        oa, ob = ours(a.parameters()), theirs(b.parameters())
        sa = sb = None
        if sched == "cosine":
            sa = torch.optim.lr_scheduler.CosineAnnealingLR(oa, T_max=steps)
            sb = torch.optim.lr_scheduler.CosineAnnealingLR(ob, T_max=steps)
        train(a, oa, steps, device, sa)
        train(b, ob, steps, device, sb)
        err = max_rel(a, b)
        verdict = "ok" if err <= tol else f"MISMATCH (tol {tol:.0e})"
        emit(f"{name:46s} {steps} steps  {err:.2e}  {verdict}")


def mixed_precision(device: torch.device) -> None:
    emit("== mixed precision on CUDA")
    main = runpy.run_path(str(ROOT / "examples" / "train_module.py"))["main"]
    summary = main(["--device", "cuda", "--steps", "300"])
    emit(
        f"train_module.py: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
        f"accuracy {summary['accuracy']:.1%}, steps taken {int(summary['steps'])}/300, {summary['seconds']:.1f}s"
    )
    net = model(device)
    opt = fadam.Optimizer(net.parameters(), fadam.adam(lr=1e-3), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    x = torch.randn(8, 64, device=device)
    for poison in (False, True):
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = net(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if poison:
            net[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(p.detach(), q) for p, q in zip(net.parameters(), before))
        emit(
            f"GradScaler step with {'an inf' if poison else 'finite'} gradient: params moved={moved}, "
            f"count={int(opt.tx_states[0][0].count)}, scale={scaler.get_scale():.0f} "
            f"({'ok' if moved != poison else 'WRONG'})"
        )


def speed(device: torch.device) -> None:
    emit("== speed on CUDA: 200 fp32 tensors, 16.8M params, median ms per step (interleaved, 30 steps)")

    def params():
        ps = [torch.nn.Parameter(torch.randn(84_000, device=device)) for _ in range(200)]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-2
        return ps

    def timed(opt):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    variants = {
        "fadam.Optimizer(adam)": lambda ps: fadam.Optimizer(ps, fadam.adam(lr=1e-3), lr=1e-3),
        "fadam.Optimizer(adamw factory)": lambda ps: fadam.Optimizer(ps, fadam.adamw, lr=1e-3),
        "torch Adam(fused)": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
        "torch Adam(foreach)": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
        "fadam.Optimizer(nadam)": lambda ps: fadam.Optimizer(ps, fadam.nadam, lr=1e-3),
        "torch NAdam(foreach)": lambda ps: torch.optim.NAdam(ps, lr=1e-3, foreach=True),
    }
    opts = {name: make(params()) for name, make in variants.items()}
    for opt in opts.values():
        opt.step()
    times = {name: [] for name in opts}
    for _ in range(30):
        for name, opt in opts.items():
            times[name].append(timed(opt))
    base = statistics.median(times["torch Adam(fused)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        emit(f"{name:34s} {med:8.3f} ms   x{med / base:5.2f} vs torch Adam(fused)")


def main() -> None:
    if not torch.cuda.is_available():
        emit("no CUDA device: nothing to check")
        return
    device = torch.device("cuda")
    emit(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    start = time.perf_counter()
    for part in (parity, mixed_precision, speed):
        try:
            part(device)
        except Exception as error:  # report and go on: one failure should not hide the other checks
            emit(f"{part.__name__} FAILED: {type(error).__name__}: {error}")
    emit(f"total {time.perf_counter() - start:.1f}s")
    out = os.environ.get("OUT")
    if out:
        Path(out, "bridge.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
