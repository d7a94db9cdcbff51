"""Quantized optimizer state: memory, accuracy and CPU speed, against fp32 fadam and bitsandbytes (when importable).

    python benchmarks/bench_quantized.py            # all three tables
    python benchmarks/bench_quantized.py --quick    # smaller sizes (a smoke run)

1. Optimizer-state bytes per parameter on a real model (a GPT-style transformer, every tensor it has).
2. Relative L2 error of the Adam update direction m / (sqrt(v) + eps) after one quantize round trip of real Adam
   moments (a 1024x1024 layer after 100 Adam steps), fadam vs bitsandbytes' blockwise scheme at the same block size.
3. CPU time of one optimizer step on 16M parameters: fadam fp32 (fused torch kernel and the pure chain), fadam 8-bit
   (fused step on the C++ kernel and, for comparison, on the torch.compile kernel it replaces on the CPU; ``update`` +
   ``apply_updates``, which runs the C++ kernel out of place), fadam 4-bit fused, fadam steps under torch.compile,
   torch.optim.AdamW and bitsandbytes Adam8bit; medians of interleaved runs, and ratios. Then the fused steps alone,
   interleaved among themselves, for the target's ratio: on the one tensor, on as many params in 200 tensors (whole
   blocks, then each with a ragged last block) and on a GPT-2-style model of 16M params (64 tensors). Also the
   first-step build and compile times and a check that changing the learning rate never recompiles.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fadam
from fadam.quantization import _native, dequantize_blockwise, quantize_blockwise

try:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF
except Exception:  # any import failure means "not available"
    bnb = None


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor))


def gpt_params(dim: int, layers: int, vocab: int, context: int) -> dict[str, torch.Tensor]:
    """The parameter tensors of a GPT-2-style model (shapes only matter here)."""
    shapes = {"wte": (vocab, dim), "wpe": (context, dim), "ln_f.w": (dim,), "ln_f.b": (dim,)}
    for i in range(layers):
        shapes |= {
            f"h{i}.ln1.w": (dim,), f"h{i}.ln1.b": (dim,), f"h{i}.attn.w": (dim, 3 * dim), f"h{i}.attn.b": (3 * dim,),
            f"h{i}.proj.w": (dim, dim), f"h{i}.proj.b": (dim,), f"h{i}.ln2.w": (dim,), f"h{i}.ln2.b": (dim,),
            f"h{i}.fc.w": (dim, 4 * dim), f"h{i}.fc.b": (4 * dim,),
            f"h{i}.out.w": (4 * dim, dim), f"h{i}.out.b": (dim,),
        }  # fmt: skip
    return {k: torch.zeros(s) for k, s in shapes.items()}


def memory_table(quick: bool) -> list[str]:
    dim, layers = (256, 2) if quick else (768, 12)
    params = gpt_params(dim, layers, 50257 if not quick else 8192, 1024)
    n = sum(p.numel() for p in params.values())
    rows = [f"## 1. optimizer state bytes/param, GPT-2-style model ({n / 1e6:.1f}M params, {len(params)} tensors)"]
    rows.append("| optimizer | bytes/param | target |")
    rows.append("|---|---|---|")
    for name, tx, target in (
        ("fadam.adamw (fp32)", fadam.adamw(), "8.0"),
        ("fadam.adamw8bit", fadam.adamw8bit(), "<= 2.04"),
        ("fadam.adamw4bit", fadam.adamw4bit(), "<= 1.07"),
    ):
        rows.append(f"| {name} | {state_bytes(tx.init(params)) / n:.4f} | {target} |")
    if bnb is not None:
        p = torch.nn.Parameter(torch.zeros(1 << 20))
        p.grad = torch.zeros_like(p)
        opt = bnb.optim.Adam8bit([p])
        opt.step()
        own = sum(t.numel() * t.element_size() for t in opt.state[p].values() if isinstance(t, torch.Tensor))
        rows.append(f"| bitsandbytes Adam8bit (one 1M tensor, incl. its 2 maps) | {own / p.numel():.4f} | - |")
    return rows


def real_moments(size: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam moments of the first layer of a 2-layer MLP regressing a random teacher, after ``steps`` fp32 steps."""
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(size, size, generator=g) / size**0.5).requires_grad_()
    w2 = (torch.randn(size, 64, generator=g) / size**0.5).requires_grad_()
    teacher = torch.randn(size, 64, generator=g) / size**0.5
    opt = torch.optim.Adam([w1, w2], lr=1e-3)
    for _ in range(steps):
        x = torch.randn(256, size, generator=g)
        loss = ((torch.relu(x @ w1) @ w2 - torch.tanh(x @ teacher)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = opt.state[w1]
    return state["exp_avg"].clone(), state["exp_avg_sq"].clone()


def direction_error(m: torch.Tensor, v: torch.Tensor, m_hat: torch.Tensor, v_hat: torch.Tensor) -> float:
    u, u_hat = m / (v.sqrt() + 1e-8), m_hat / (v_hat.sqrt() + 1e-8)
    return ((u_hat - u).norm() / u.norm()).item()


def accuracy_table(quick: bool) -> list[str]:
    size, steps = (256, 30) if quick else (1024, 100)
    m, v = real_moments(size, steps)
    rows = [f"## 2. update-direction relative L2 error after one round trip (real Adam moments {size}x{size}, "
            f"{steps} steps)"]  # fmt: skip
    rows.append("| scheme | block | fadam | bitsandbytes |")
    rows.append("|---|---|---|---|")

    def ours(bits: int, block: int) -> float:
        rt = lambda x: dequantize_blockwise(quantize_blockwise(x, bits, block), x.shape, bits, block)  # noqa: E731
        return direction_error(m, v, rt(m), rt(v))

    for bits, block in ((8, 256), (8, 2048), (4, 128)):
        theirs = "-"
        if bnb is not None and bits == 8:
            signed, unsigned = bnbF.create_dynamic_map(signed=True), bnbF.create_dynamic_map(signed=False)
            qm, sm = bnbF.quantize_blockwise(m, code=signed, blocksize=block)
            qv, sv = bnbF.quantize_blockwise(v, code=unsigned, blocksize=block)
            theirs = (
                f"{direction_error(m, v, bnbF.dequantize_blockwise(qm, sm), bnbF.dequantize_blockwise(qv, sv)):.4%}"
            )
        rows.append(f"| {bits}-bit | {block} | {ours(bits, block):.4%} | {theirs} |")
    return rows


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def interleaved(runners: dict[str, Callable[[int], None]], names: list[str], reps: int) -> dict[str, list[float]]:
    """Seconds of each named step, ``reps`` times. Interleaved, so that machine noise hits every row alike; each timed
    step follows an untimed one of the same optimizer, as in training: timed right after another row's step, fused
    fp32 Adam took 18 ms instead of 12."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(reps):
        for name in names:
            runners[name](2 * i)
            start = time.perf_counter()
            runners[name](2 * i + 1)
            times[name].append(time.perf_counter() - start)
    return times


def _fused_step_runner(tx, params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]):
    box = {"p": {k: v.clone() for k, v in params.items()}}
    box["s"] = tx.init(box["p"])

    def run(i: int) -> None:
        box["p"], box["s"] = fadam.step(tx, box["p"], grads[i % 2], box["s"], donate=True)

    return run


def _torch_fused_runner(params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]):
    torch_params = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = torch.optim.AdamW(torch_params, lr=1e-3, fused=True)

    def run(i: int) -> None:
        for p, g in zip(torch_params, grads[i % 2].values()):
            p.grad = g
        opt.step()

    return run


def many_tensors_rows(n: int, reps: int) -> list[str]:
    """The fused steps on about ``n`` params as a model holds them: in 200 tensors, where each 8-bit leaf costs Python
    and a leaf whose size is not a multiple of 256 ends in a ragged block; and as a GPT-2-style model, most of whose
    tensors (norms, biases) are under min_size and keep float32 moments."""
    rows = []
    whole = (n // 200) // 256 * 256
    dim = 512 if n >= 1 << 24 else 128  # 16.0M params (5 layers) or 1.0M
    models = {
        f"200 tensors of {whole} (whole blocks)": {f"w{k}": (whole,) for k in range(200)},
        f"200 tensors of {whole + 100} (a ragged 100 at the end)": {f"w{k}": (whole + 100,) for k in range(200)},
    }
    gpt = {k: tuple(v.shape) for k, v in gpt_params(dim, 5, 256, 256).items()}
    small = sum(torch.Size(shape).numel() < 4096 for shape in gpt.values())
    gpt_n = sum(torch.Size(shape).numel() for shape in gpt.values())
    models[f"a GPT-2-style model ({gpt_n / 1e6:.1f}M params, {len(gpt)} tensors, {small} under min_size)"] = gpt
    for label, shapes in models.items():
        torch.manual_seed(0)
        params = {k: torch.randn(shape) for k, shape in shapes.items()}
        grads = [{k: torch.randn(v.shape) * 1e-2 for k, v in params.items()} for _ in range(2)]
        runners = {
            "fadam adamw fp32, fused step": _fused_step_runner(fadam.adamw(lr=1e-3), params, grads),
            "torch.optim.AdamW(fused=True)": _torch_fused_runner(params, grads),
            "fadam adamw8bit, fused step (C++ kernel)": _fused_step_runner(fadam.adamw8bit(lr=1e-3), params, grads),
        }
        for runner in runners.values():
            runner(0)
        medians = {name: median_ms(ts) for name, ts in interleaved(runners, list(runners), reps).items()}
        fp32, fused = medians["fadam adamw fp32, fused step"], medians["torch.optim.AdamW(fused=True)"]
        rows.append(f"the fused steps on {label}, interleaved ({reps} reps; as above):")
        for name, ms in medians.items():
            rows.append(f"  {name}: {ms:.1f} ms, {ms / fp32:.2f}x | {ms / fused:.2f}x")
        step, kernel = _kernel_share(runners["fadam adamw8bit, fused step (C++ kernel)"], reps)
        rows.append(f"  of the 8-bit step's {step:.1f} ms, the C++ kernel's call: {kernel:.1f} ms (the rest is Python)")
    return rows


def _kernel_share(runner: Callable[[int], None], reps: int) -> tuple[float, float]:
    """Median ms of a step and of the C++ kernel's call inside it."""
    calls: list[float] = []
    run = _native._run_table  # both ways of reading a step's leaves call it

    def timed(*args) -> None:
        start = time.perf_counter()
        run(*args)
        calls.append(time.perf_counter() - start)

    steps = []
    with mock.patch.object(_native, "_run_table", timed):
        for i in range(reps):
            start = time.perf_counter()
            runner(i)
            steps.append(time.perf_counter() - start)
    return median_ms(steps), median_ms(calls)


def speed_table(quick: bool, reps: int) -> list[str]:
    n = (1 << 20) if quick else (1 << 24)
    torch.manual_seed(0)
    base = torch.randn(n)
    grads = [{"w": torch.randn(n) * 1e-2} for _ in range(2)]
    rows = [f"## 3. CPU step time, one tensor of {n / 1e6:.1f}M params, {torch.get_num_threads()} threads (median ms)"]

    runners = {}

    def fadam_runner(tx, fused: bool, native: bool = True):
        box = {"p": {"w": base.clone()}}
        box["s"] = tx.init(box["p"])

        def run(i: int) -> None:
            # native=False: the torch.compile kernel, which the C++ one replaces on the CPU (kept for comparison)
            with contextlib.nullcontext() if native else mock.patch.object(_native, "available", return_value=False):
                if fused:
                    box["p"], box["s"] = fadam.step(tx, box["p"], grads[i % 2], box["s"], donate=True)
                else:
                    updates, box["s"] = tx.update(grads[i % 2], box["s"], box["p"])
                    box["p"] = fadam.apply_updates(box["p"], updates)

        return run

    runners["fadam adamw fp32, fused step"] = fadam_runner(fadam.adamw(lr=1e-3), True)
    runners["fadam adamw fp32, pure update"] = fadam_runner(fadam.adamw(lr=1e-3), False)
    schedule = lambda count: 1e-3 * (1 + count.to(torch.float32)) ** -0.5  # noqa: E731 - a changing lr
    tx8 = fadam.adamw8bit(lr=schedule)
    runners["fadam adamw8bit, fused step (C++ kernel)"] = fadam_runner(tx8, True)
    runners["fadam adamw8bit, fused step (torch.compile kernel)"] = fadam_runner(tx8, True, native=False)
    runners["fadam adamw8bit, pure update"] = fadam_runner(tx8, False)
    runners["fadam adamw4bit, fused step (C++ kernel)"] = fadam_runner(fadam.adamw4bit(lr=schedule), True)

    def compiled_runner(tx):  # a whole donated step under torch.compile: inductor's code for the chain
        box = {"p": {"w": base.clone()}}
        box["s"] = tx.init(box["p"])
        train_step = torch.compile(functools.partial(fadam.step, tx, donate=True), fullgraph=True)

        def run(i: int) -> None:
            box["p"], box["s"] = train_step(box["p"], grads[i % 2], box["s"])

        return run

    runners["fadam adamw fp32, step under torch.compile"] = compiled_runner(fadam.adamw(lr=1e-3))
    runners["fadam adamw8bit, step under torch.compile"] = compiled_runner(fadam.adamw8bit(lr=1e-3))

    def torch_runner(**flags):
        p = torch.nn.Parameter(base.clone())
        opt = torch.optim.AdamW([p], lr=1e-3, **flags)

        def run(i: int) -> None:
            p.grad = grads[i % 2]["w"]
            opt.step()

        return run

    runners["torch.optim.AdamW (CPU default: for-loop)"] = torch_runner()
    runners["torch.optim.AdamW(fused=True)"] = torch_runner(fused=True)
    if bnb is not None:
        p = torch.nn.Parameter(base.clone())
        opt = bnb.optim.AdamW8bit([p], lr=1e-3, weight_decay=1e-2)

        def run_bnb(i: int) -> None:
            p.grad = grads[i % 2]["w"]
            opt.step()

        runners["bitsandbytes AdamW8bit"] = run_bnb

    from torch._dynamo.utils import counters

    start = time.perf_counter()
    runners["fadam adamw8bit, fused step (C++ kernel)"](0)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    runners["fadam adamw8bit, fused step (torch.compile kernel)"](0)
    compile_s = time.perf_counter() - start
    for name in runners:
        if "under torch.compile" in name:
            runners[name](0)  # compiled here, so that the recompilation count below is the 8-bit kernels' alone
    graphs = counters["stats"]["unique_graphs"]
    for run in runners.values():
        run(1)  # warm up

    times = interleaved(runners, list(runners), reps)
    # The target's ratio from the fused steps alone: in the full cycle a fused step also pays for what the step before
    # its untimed one (a pure update, bitsandbytes) left in the caches, which moves the fp32 row by up to 25% per run.
    head_names = [
        "fadam adamw fp32, fused step",
        "torch.optim.AdamW(fused=True)",
        "fadam adamw8bit, fused step (C++ kernel)",
        "fadam adamw4bit, fused step (C++ kernel)",
    ]
    head = {name: median_ms(ts) for name, ts in interleaved(runners, head_names, 3 * reps).items()}
    recompiled = counters["stats"]["unique_graphs"] - graphs
    fp32 = median_ms(times["fadam adamw fp32, fused step"])
    fp32_pure = median_ms(times["fadam adamw fp32, pure update"])
    rows.append("| optimizer | ms | vs fp32 fused step | vs fp32 pure update |")
    rows.append("|---|---|---|---|")
    for name, ts in times.items():
        rows.append(
            f"| {name} | {median_ms(ts):.1f} | {median_ms(ts) / fp32:.2f}x | {median_ms(ts) / fp32_pure:.2f}x |"
        )
    rows.append(f"fused steps alone, interleaved ({3 * reps} reps; median ms, and against fadam's fp32 fused step | "
                "torch.optim.AdamW(fused=True)):")  # fmt: skip
    for name, ms in head.items():
        rows.append(f"  {name}: {ms:.1f} ms, {ms / head[head_names[0]]:.2f}x | {ms / head[head_names[1]]:.2f}x")
    rows += many_tensors_rows(n, 3 * reps)
    if bnb is not None:
        ours = median_ms(times["fadam adamw8bit, fused step (C++ kernel)"])
        ratio = ours / median_ms(times["bitsandbytes AdamW8bit"])
        rows.append(f"fadam 8-bit fused step / bitsandbytes AdamW8bit: {ratio:.2f}x")
    rows.append(f"first 8-bit step incl. building the C++ kernel: {build_s:.1f} s (0 when ~/.cache/torch_extensions "
                f"has it: set TORCH_EXTENSIONS_DIR to an empty folder to measure); incl. torch.compile: "
                f"{compile_s:.1f} s; graphs compiled while the lr changed every step: {recompiled}")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=["memory", "accuracy", "speed"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, bitsandbytes {bnb.__version__ if bnb else 'not installed'}")
    tables = {"memory": memory_table, "accuracy": accuracy_table}
    for name, fn in tables.items():
        if args.only in (None, name):
            print("\n".join(fn(args.quick)), "\n", flush=True)
    if args.only in (None, "speed"):
        print("\n".join(speed_table(args.quick, args.reps)), flush=True)


if __name__ == "__main__":
    main()
