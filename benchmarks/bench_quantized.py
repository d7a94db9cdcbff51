"""Quantized optimizer state: memory, accuracy and CPU speed, against fp32 fadam and bitsandbytes (when importable).

    python benchmarks/bench_quantized.py            # all three tables
    python benchmarks/bench_quantized.py --quick    # smaller sizes (a smoke run)
    python benchmarks/bench_quantized.py --only phases   # where the 8-bit kernels' time goes

1. Optimizer-state bytes per parameter on a real model (a GPT-style transformer, every tensor it has).
2. Relative L2 error of the Adam update direction m / (sqrt(v) + eps) after one quantize round trip of real Adam
   moments (a 1024x1024 layer after 100 Adam steps), fadam vs bitsandbytes' blockwise scheme at the same block size.
3. CPU time of one optimizer step, as a ratio to torch.optim.AdamW(fused=True)'s: a donated ``fadam.step`` of
   adamw8bit, adamw4bit and lion8bit (the generated C++ kernel, which decodes and re-encodes the quantized state block
   by block), adamw8bit's pure path (``tx.update`` + ``fadam.apply_updates``), fadam.adamw with full-precision state
   and torch's fused AdamW; round-robin in one process, medians. On 16.8M float32 params in one tensor and in 200
   tensors, and in one bfloat16 tensor. Then the first 8-bit step in an empty kernel cache (``$FADAM_CACHE_DIR``),
   which generates and compiles its kernel, and the kernels built while the learning rate changes every step.
4. Where the generated kernel's time goes on 8-bit state (``--only phases``, not part of the default run): the
   adamw8bit and lion8bit kernels timed as generated and with phases knocked out of their source (the decode's
   table reads, the encode's table reads, the block absmax), on the same rows, round-robin, one thread; a phase's
   share is the time its removal saves. The knocked-out kernels compute garbage; only their times mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fadam
import fadam._cpu_kernel as cpu_kernel
from fadam.quantization import dequantize_blockwise, quantize_blockwise

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


Runner = Callable[[int], None]  # runs step number i (it picks the gradients from i)


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def interleaved(runners: dict[str, Runner], reps: int) -> dict[str, float]:
    """Median ms of each runner's step over ``reps`` round-robin rounds, so that machine noise hits every row alike.
    Each timed step follows an untimed one of the same optimizer, as in training: otherwise a step would pay for the
    caches the previous row's step left behind."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(reps):
        for name, run in runners.items():
            run(2 * i)
            start = time.perf_counter()
            run(2 * i + 1)
            times[name].append(time.perf_counter() - start)
    return {name: median_ms(ts) for name, ts in times.items()}


Params = dict[str, torch.Tensor]


def fadam_step(tx: fadam.GradientTransformation, params: Params, grads: list[Params]) -> Runner:
    """A donated ``fadam.step``: the params and state are updated in place."""
    box = {"p": {k: v.clone() for k, v in params.items()}}
    box["s"] = tx.init(box["p"])

    def run(i: int) -> None:
        box["p"], box["s"] = fadam.step(tx, box["p"], grads[i % 2], box["s"], donate=True)

    return run


def fadam_pure(tx: fadam.GradientTransformation, params: Params, grads: list[Params]) -> Runner:
    """``tx.update`` + ``fadam.apply_updates``: new params, state and updates every step."""
    box = {"p": {k: v.clone() for k, v in params.items()}}
    box["s"] = tx.init(box["p"])

    def run(i: int) -> None:
        updates, box["s"] = tx.update(grads[i % 2], box["s"], box["p"])
        box["p"] = fadam.apply_updates(box["p"], updates)

    return run


def torch_fused(params: Params, grads: list[Params]) -> Runner:
    torch_params = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = torch.optim.AdamW(torch_params, lr=1e-3, fused=True)

    def run(i: int) -> None:
        for p, g in zip(torch_params, grads[i % 2].values()):
            p.grad = g
        opt.step()

    return run


REFERENCE = "torch.optim.AdamW(fused=True)"


def runners(params: Params, grads: list[Params]) -> dict[str, Runner]:
    return {
        "fadam.adamw8bit, step (generated kernel)": fadam_step(fadam.adamw8bit(lr=1e-3), params, grads),
        "fadam.adamw4bit, step (generated kernel)": fadam_step(fadam.adamw4bit(lr=1e-3), params, grads),
        "fadam.lion8bit, step (generated kernel)": fadam_step(fadam.lion8bit(lr=1e-4), params, grads),
        "fadam.adamw8bit, update + apply_updates": fadam_pure(fadam.adamw8bit(lr=1e-3), params, grads),
        "fadam.adamw (unquantized state), step": fadam_step(fadam.adamw(lr=1e-3), params, grads),
        REFERENCE: torch_fused(params, grads),
    }


def layouts(n: int) -> dict[str, tuple[int, int, torch.dtype]]:
    """Column label: (tensors, elements each, dtype), about ``n`` params in all."""
    m = f"{n / 1e6:.1f}M"
    return {
        f"1 x {m} fp32": (1, n, torch.float32),
        f"200 x {n // 200} fp32": (200, n // 200, torch.float32),
        f"1 x {m} bf16": (1, n, torch.bfloat16),
    }


def layout_medians(tensors: int, size: int, dtype: torch.dtype, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    params = {f"w{k}": torch.randn(size).to(dtype) for k in range(tensors)}
    grads = [{k: (torch.randn(size) * 1e-2).to(dtype) for k in params} for _ in range(2)]
    steps = runners(params, grads)
    for run in steps.values():
        run(0)  # builds or loads the kernels and allocates the state outside the timed steps
    return interleaved(steps, reps)


@contextlib.contextmanager
def fresh_kernel_cache() -> Iterator[Path]:
    """``$FADAM_CACHE_DIR`` set to a new empty folder inside the block, restored after it."""
    before = os.environ.get("FADAM_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="fadam-cache-") as folder:
        os.environ["FADAM_CACHE_DIR"] = folder
        try:
            yield Path(folder)
        finally:
            if before is None:
                del os.environ["FADAM_CACHE_DIR"]
            else:
                os.environ["FADAM_CACHE_DIR"] = before


def cold_start(n: int) -> str:
    """The first adamw8bit step of the process in an empty kernel cache, then 4 steps with a learning rate that
    changes every step. Must run before any other step of the process: kernels it has loaded are not built again."""
    schedule = lambda count: 1e-3 * (1 + count.to(torch.float32)) ** -0.5  # noqa: E731 - changes every step
    params = {"w": torch.randn(n)}
    grads = [{"w": torch.randn(n) * 1e-2} for _ in range(2)]
    with fresh_kernel_cache() as folder:
        run = fadam_step(fadam.adamw8bit(lr=schedule), params, grads)
        start = time.perf_counter()
        run(0)
        cold_s = time.perf_counter() - start
        for i in range(1, 5):
            run(i)
        built = len(list(folder.rglob("*.so")))
    return (
        f"first adamw8bit step in an empty FADAM_CACHE_DIR (generates and compiles its kernel): {cold_s:.2f} s; "
        f"kernels built in 5 steps with the lr changing every step: {built}"
    )


def speed_table(quick: bool, reps: int) -> list[str]:
    n = (1 << 20) if quick else (1 << 24)
    cold = cold_start(n)
    columns = {label: layout_medians(*layout, reps) for label, layout in layouts(n).items()}
    rows = [
        f"## 3. CPU step time / {REFERENCE}'s, {torch.get_num_threads()} threads "
        f"(medians of {reps} round-robin rounds; ms in brackets)",
        "| optimizer | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in next(iter(columns.values())):
        cells = [f"{ms[name] / ms[REFERENCE]:.2f}x ({ms[name]:.1f})" for ms in columns.values()]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    rows.append(cold)
    return rows


# Knock-outs of the generated source (regex, replacement): each must match, or the emitter changed and so must they
KNOCKOUTS = {
    "decode reads": (r"m(\d+)\[(c\1\[at\]|u\1\[j\]) \+ o\1\]", r"float(\2)"),
    "encode reads": (r"fadam_codes\d+\[(static_cast<int32_t>\(m >> 16\) - \d+)\]", r"(uint32_t(\1) * 77u)"),
    "absmax": (r"top(\d+) = top\1 < q\1_bits \? q\1_bits : top\1;", ""),
}


def captured_kernel(tx: fadam.GradientTransformation, n: int) -> tuple[str, list[torch.Tensor], list, list]:
    """The source of the kernel a donated step of ``tx`` on one ``n``-element leaf runs, and that call's row (its
    outputs, which alias its inputs in a donated step, on buffers of their own) and scalars."""
    texts, calls = [], []
    load_source, run = cpu_kernel._load_source, cpu_kernel.Kernel.run

    def spy_load(text: str, streamed: bool = False):
        texts.append(text)
        return load_source(text, streamed)

    def spy_run(self, leaves, scalars, leaf_scalars):
        calls.append(([t.clone() for t in leaves[0]], [p.data_ptr() for p in leaves[0]], scalars, leaf_scalars))
        return run(self, leaves, scalars, leaf_scalars)

    params = [torch.randn(n)]
    state = tx.init(params)
    cpu_kernel._load_source, cpu_kernel.Kernel.run = spy_load, spy_run
    try:
        for _ in range(3):
            params, state = fadam.step(tx, params, [torch.randn(n) * 1e-2], state, donate=True)
    finally:
        cpu_kernel._load_source, cpu_kernel.Kernel.run = load_source, run
    row, pointers, scalars, leaf_scalars = calls[-1]
    seen: set[int] = set()
    own = []
    for tensor, pointer in zip(row, pointers):
        own.append(torch.empty_like(tensor) if pointer in seen else tensor)
        seen.add(pointer)
    return texts[-1], own, scalars, leaf_scalars


def kernel_medians(kernels: dict, call: tuple, calls: int, reps: int) -> dict[str, float]:
    """Median ms per call of each kernel on one row, round-robin; each sample averages ``calls`` calls."""
    row, scalars, leaf_scalars = call
    times: dict[str, list[float]] = {label: [] for label in kernels}
    for _ in range(reps):
        for label, kernel in kernels.items():
            kernel.run([row], scalars, leaf_scalars)
            start = time.perf_counter()
            for _ in range(calls):
                kernel.run([row], scalars, leaf_scalars)
            times[label].append((time.perf_counter() - start) / calls)
    return {label: median_ms(ts) for label, ts in times.items()}


def phase_table(quick: bool, reps: int) -> list[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = [
        "## 4. generated 8-bit kernels: ms per call, one thread, as generated and with phases knocked out",
        "| kernel | elements | as generated | " + " | ".join(f"no {k}" for k in KNOCKOUTS) + " | all three |",
        "|---|---|---|" + "---|" * (len(KNOCKOUTS) + 1),
    ]
    try:
        for name, tx in (("adamw8bit", fadam.adamw8bit(lr=1e-3)), ("lion8bit", fadam.lion8bit(lr=1e-4))):
            for n in (1 << 17, 1 << 20 if quick else 1 << 24):  # in the L2 cache, and in memory
                text, row, scalars, leaf_scalars = captured_kernel(tx, n)
                variants = {"as generated": text}
                for label, (pattern, replacement) in KNOCKOUTS.items():
                    variants[label], found = re.subn(pattern, replacement, text)
                    if not found:
                        raise RuntimeError(f"knock-out {label!r} matches nothing: update KNOCKOUTS")
                everything = text
                for pattern, replacement in KNOCKOUTS.values():
                    everything = re.sub(pattern, replacement, everything)
                variants["all three"] = everything
                kernels = {label: cpu_kernel._load_source(source) for label, source in variants.items()}
                ms = kernel_medians(kernels, (row, scalars, leaf_scalars), max(1, (1 << 21) // n), reps)
                cells = [f"{ms[label]:.3f}" for label in kernels]
                rows.append(f"| {name} | {n:,} | " + " | ".join(cells) + " |")
    finally:
        torch.set_num_threads(threads)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=["memory", "accuracy", "speed", "phases"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, bitsandbytes {bnb.__version__ if bnb else 'not installed'}")
    tables = {"memory": memory_table, "accuracy": accuracy_table}
    for name, fn in tables.items():
        if args.only in (None, name):
            print("\n".join(fn(args.quick)), "\n", flush=True)
    if args.only in (None, "speed"):
        print("\n".join(speed_table(args.quick, args.reps)), flush=True)
    if args.only == "phases":
        print("\n".join(phase_table(args.quick, args.reps)), flush=True)


if __name__ == "__main__":
    main()
