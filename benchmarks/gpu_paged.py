"""Paged optimizer state on a CUDA GPU: correctness, device residency, transfer overlap and step-time ratios.

    python benchmarks/gpu_paged.py          # < 90 s on one GPU; writes $OUT/paged.txt when $OUT is set

1. bit-identity: paged Adam (pinned host state, and disk state) vs on-device Adam, update and fused step paths;
2. residency: extra device memory during a paged step, in chunks (target: at most 2);
3. optimizer step alone: on-device fused Adam vs paged host state, with the pure transfer times (overlap check:
   the paged step should cost about max(H2D, D2H), not their sum);
4. training step (bf16 autocast MLP, forward + backward + optimizer): paged host state vs on-device state, at a few
   batch sizes (target: <= 1.2x). The transfers run after backward, so the ratio falls as compute per step grows.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fadam

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_identity(dev: torch.device) -> None:
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.randn(n, device=dev, generator=gen) for n in (1 << 20, 4096, 3 << 18, 77)]
    path = os.path.join(tempfile.gettempdir(), "fadam-gpu-identity.state")
    for storage in ("host", "disk"):
        for mode in ("update", "step"):
            ref_tx = fadam.adamw(lr=1e-3)
            tx = fadam.paged_adamw(
                lr=1e-3, storage=storage, path=path if storage == "disk" else None, chunk_bytes=1 << 22
            )
            ref_p = [p.clone() for p in params]
            our_p = [p.clone() for p in params]
            ref_s, our_s = ref_tx.init(ref_p), tx.init(our_p)
            for _ in range(4):
                grads = [torch.randn(p.shape, device=dev, generator=gen) for p in params]
                if mode == "update":
                    u, ref_s = ref_tx.update(grads, ref_s, ref_p)
                    ref_p = fadam.apply_updates(ref_p, u)
                    u, our_s = tx.update(grads, our_s, our_p)
                    our_p = fadam.apply_updates(our_p, u)
                else:
                    ref_p, ref_s = fadam.step(ref_tx, ref_p, grads, ref_s, donate=True)
                    our_p, our_s = fadam.step(tx, our_p, grads, our_s, donate=True)
            same = all(torch.equal(a, b) for a, b in zip(ref_p, our_p))
            say(f"bit-identical to on-device AdamW, {storage:<4} {mode:<6} 4 steps, {len(our_s.chunks)} chunks: {same}")
    if os.path.exists(path):
        os.unlink(path)


def _on_device_step(params: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
    tx = fadam.adam(lr=1e-3)
    box = [[p.clone() for p in params], None]
    box[1] = tx.init(box[0])

    def step() -> None:
        box[0], box[1] = fadam.step(tx, box[0], grads, box[1], donate=True)

    return timed(step, 10)


def _paged_step(params: list[torch.Tensor], grads: list[torch.Tensor], chunk_bytes: int) -> tuple[float, int, int]:
    tx = fadam.paged_adam(lr=1e-3, chunk_bytes=chunk_bytes)
    box = [params, tx.init(params)]

    def step() -> None:
        box[0], box[1] = fadam.step(tx, box[0], grads, box[1], donate=True)

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    return timed(step, 5), extra, len(box[1].chunks)


def _copy_times(nbytes: int, dev: torch.device) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = timed(lambda: on_dev.copy_(host, non_blocking=True), 5)
    d2h = timed(lambda: host.copy_(on_dev, non_blocking=True), 5)
    return h2d, d2h


def residency_and_step(dev: torch.device) -> None:
    n_leaves, leaf = 32, 1 << 23  # 256M params, 1 GiB; Adam state 2 GiB
    params = [torch.randn(leaf, device=dev) for _ in range(n_leaves)]
    grads = [torch.randn(leaf, device=dev) * 1e-3 for _ in range(n_leaves)]
    state_bytes = n_leaves * leaf * 8
    state_gib = state_bytes / 2**30
    t_dev = _on_device_step(params, grads)
    torch.cuda.empty_cache()
    t_paged, extra, n_chunks = _paged_step(params, grads, 64 << 20)
    chunk = state_bytes / n_chunks
    say(
        f"device memory above params+grads during a paged step: {extra / 2**20:.0f} MiB = {extra / chunk:.2f} chunks "
        f"of {chunk / 2**20:.0f} MiB (target <= 2)"
    )
    torch.cuda.empty_cache()
    t_h2d, t_d2h = _copy_times(state_bytes, dev)
    say()
    say(f"optimizer step alone, Adam over {n_leaves * leaf / 1e6:.0f}M fp32 params ({state_gib:.1f} GiB state)")
    say(f"{'path':<34} {'ms':>8} {'vs on-device':>12}")
    say(f"{'on-device fused Adam':<34} {t_dev * 1e3:>8.2f} {1.0:>12.2f}")
    say(f"{'paged host (pinned), fused/chunk':<34} {t_paged * 1e3:>8.2f} {t_paged / t_dev:>12.2f}")
    say(f"{'state H2D copy alone':<34} {t_h2d * 1e3:>8.2f}   ({state_gib / t_h2d:.1f} GiB/s)")
    say(f"{'state D2H copy alone':<34} {t_d2h * 1e3:>8.2f}   ({state_gib / t_d2h:.1f} GiB/s)")
    say(
        f"overlap: paged / (H2D + D2H) = {t_paged / (t_h2d + t_d2h):.2f} (1.0 = serial, "
        f"{max(t_h2d, t_d2h) / (t_h2d + t_d2h):.2f} = fully overlapped)"
    )


def training_step(dev: torch.device) -> None:
    width, depth = 4096, 8
    say()
    say(
        f"training step: {depth} x Linear({width}, {width}) MLP, bf16 autocast, fp32 params "
        f"({depth * width * width / 1e6:.0f}M params, Adam state {depth * width * width * 8 / 2**30:.2f} GiB)"
    )
    say(f"{'tokens/step':>11} {'on-device ms':>13} {'paged host ms':>14} {'ratio':>7}")
    torch.manual_seed(0)
    weights = [torch.randn(width, width, device=dev) / width**0.5 for _ in range(depth)]
    for tokens in (4096, 16384, 65536):
        x = torch.randn(tokens, width, device=dev)
        results = {}
        for name, tx in (("device", fadam.adam(lr=1e-4)), ("paged", fadam.paged_adam(lr=1e-4))):
            params = [w.clone() for w in weights]
            state = tx.init(params)

            def train_step(tx=tx, x=x):
                nonlocal params, state
                leaves = [p.requires_grad_() for p in params]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    h = x
                    for w in leaves:
                        h = torch.relu(h @ w)
                    loss = h.float().square().mean()
                grads = torch.autograd.grad(loss, leaves)
                params, state = fadam.step(tx, [p.detach() for p in leaves], list(grads), state, donate=True)

            results[name] = timed(train_step, 5)
            del params, state
        say(
            f"{tokens:>11} {results['device'] * 1e3:>13.2f} {results['paged'] * 1e3:>14.2f} "
            f"{results['paged'] / results['device']:>7.2f}"
        )


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    dev = torch.device("cuda")
    start = time.perf_counter()
    say(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    check_identity(dev)
    residency_and_step(dev)
    training_step(dev)
    say(f"\ntotal {time.perf_counter() - start:.0f} s")
    out = os.environ.get("OUT")
    if out:
        Path(out, "paged.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
