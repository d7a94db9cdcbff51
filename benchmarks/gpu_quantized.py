"""Quantized optimizer state on a GPU: correctness against the CPU and throughput against torch's fused AdamW.

    python benchmarks/gpu_quantized.py          # < 90 s on one GPU; writes $OUT/quantized.txt when $OUT is set

On CUDA tensors the generated kernel does not apply (it takes CPU tensors): ``fadam.step`` runs the chain's eager
torch ops, the codec's table encoder included.

1. Correctness: 5 steps of fadam.adamw8bit / adamw4bit with ``fadam.step`` on CUDA against ``tx.update`` +
   ``apply_updates`` on the CPU (the generated kernel), from the same params and gradients; and ``tx.update`` +
   ``apply_updates`` on CUDA against the CUDA step, which should be bit for bit.
2. Throughput on 100M params (8 tensors of 12.5M, fp32): torch.optim.AdamW(fused=True), fadam.adamw fp32 (torch's fused
   kernel), fadam.adamw8bit and adamw4bit donated steps, adamw8bit's update + apply_updates; ms per step (CUDA events,
   median), the ratio torch-fused-time / ours, state bytes per param and the first step's time.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fadam
from fadam.quantization import QuantizedArray, dequantize_blockwise

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def moments(state, params, bits):
    block = 256 if bits == 8 else 128
    inner = next(s for s in state if isinstance(s, fadam.QuantizedState)).inner_state
    out = []
    for tree in (inner.mu, inner.nu):
        for k, p in params.items():
            q = tree[k]
            out.append(
                dequantize_blockwise(q, p.shape, bits, block).cpu() if isinstance(q, QuantizedArray) else q.cpu()
            )
    return out


def correctness() -> None:
    say("## 1. correctness: CUDA step vs CPU update + apply_updates, 5 steps; CUDA update + apply_updates vs CUDA step")
    say(
        "| optimizer | max abs param diff | max rel moment diff (L2) | state on cuda | update == step (params, state) |"
    )
    say("|---|---|---|---|---|")
    torch.manual_seed(0)
    params = {"w": torch.randn(1000, 1037), "b": torch.randn(1000), "c": torch.randn(4096 * 3 + 5)}
    grads = [{k: torch.randn_like(v) * 1e-2 for k, v in params.items()} for _ in range(5)]
    for name, make, bits in (("adamw8bit", fadam.adamw8bit, 8), ("adamw4bit", fadam.adamw4bit, 4)):
        tx = make(lr=1e-2)
        cpu_p, cpu_s = params, tx.init(params)
        gpu_p = {k: v.cuda() for k, v in params.items()}
        gpu_s = tx.init(gpu_p)
        upd_p, upd_s = gpu_p, gpu_s
        same = True
        for g in grads:
            updates, cpu_s = tx.update(g, cpu_s, cpu_p)
            cpu_p = fadam.apply_updates(cpu_p, updates)
            g_cuda = {k: v.cuda() for k, v in g.items()}
            updates, upd_s = tx.update(g_cuda, upd_s, upd_p)
            upd_p = fadam.apply_updates(upd_p, updates)
            gpu_p, gpu_s = fadam.step(tx, gpu_p, g_cuda, gpu_s)
            same &= all(
                torch.equal(a, b)
                for a, b in zip(optree.tree_leaves((upd_p, upd_s)), optree.tree_leaves((gpu_p, gpu_s)))
            )
        torch.cuda.synchronize()
        dp = max((gpu_p[k].cpu() - cpu_p[k]).abs().max().item() for k in params)
        dm = max(
            ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            for a, b in zip(moments(gpu_s, params, bits), moments(cpu_s, params, bits))
        )
        on_cuda = all(t.is_cuda for t in optree.tree_leaves(gpu_s) if t.dim() > 0)
        say(f"| {name} | {dp:.2e} | {dm:.2e} | {on_cuda} | {same} |")


def time_steps(step, reps: int) -> float:
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def torch_fused_ms(base: list[torch.Tensor], grads: list[list[torch.Tensor]], reps: int) -> float:
    ps = [torch.nn.Parameter(b.clone()) for b in base]
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2, fused=True)

    def torch_step(i: int) -> None:
        for p, g in zip(ps, grads[i % 2]):
            p.grad = g
        opt.step()

    return time_steps(torch_step, reps)


def throughput(reps: int = 20) -> None:
    n_tensors, size = 8, 12_500_000
    say(f"## 2. step time on {n_tensors * size / 1e6:.0f}M fp32 params ({n_tensors} tensors), median of {reps}")
    torch.manual_seed(0)
    base = [torch.randn(size, device="cuda") for _ in range(n_tensors)]
    grads = [[torch.randn(size, device="cuda") * 1e-2 for _ in range(n_tensors)] for _ in range(2)]
    results = {}

    results["torch.optim.AdamW(fused=True)"] = (torch_fused_ms(base, grads, reps), None)
    for name, tx, pure in (
        ("fadam.adamw fp32 (step)", fadam.adamw(lr=1e-3), False),
        ("fadam.adamw8bit (step)", fadam.adamw8bit(lr=1e-3), False),
        ("fadam.adamw4bit (step)", fadam.adamw4bit(lr=1e-3), False),
        ("fadam.adamw8bit (update + apply_updates)", fadam.adamw8bit(lr=1e-3), True),
    ):
        box = {"p": {str(i): b.clone() for i, b in enumerate(base)}}
        box["s"] = tx.init(box["p"])
        gs = [{str(i): g for i, g in enumerate(gl)} for gl in grads]

        def step(i: int, box=box, gs=gs, tx=tx, pure=pure) -> None:
            if pure:
                updates, box["s"] = tx.update(gs[i % 2], box["s"], box["p"])
                box["p"] = fadam.apply_updates(box["p"], updates)
            else:
                box["p"], box["s"] = fadam.step(tx, box["p"], gs[i % 2], box["s"], donate=True)

        start = time.perf_counter()
        step(0)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ms = time_steps(step, reps)
        nbytes = sum(t.numel() * t.element_size() for t in optree.tree_leaves(box["s"]))
        results[name] = (ms, f"{nbytes / (n_tensors * size):.3f} B/param; first step {first:.1f} s")
        del box
        torch.cuda.empty_cache()
    ref = results["torch.optim.AdamW(fused=True)"][0]
    say("| optimizer | ms/step | throughput vs torch fused AdamW | notes |")
    say("|---|---|---|---|")
    for name, (ms, note) in results.items():
        say(f"| {name} | {ms:.2f} | {ref / ms:.3f}x | {note or ''} |")


def main() -> None:
    if not torch.cuda.is_available():
        say("no CUDA device: nothing to measure")
        return
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for section in (correctness, throughput):
        try:
            section()
        except Exception:  # report and go on: one failing section must not hide the other's numbers
            say(f"{section.__name__} FAILED:\n```\n{traceback.format_exc()}```")
        say()
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "quantized.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
