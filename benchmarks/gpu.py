"""fadam on one GPU: the generated kernels against eager, host syncs, CUDA-graph capture, and step times.

One command on a machine with one CUDA GPU, torch and no network: ``python benchmarks/gpu.py``. fadam is imported
from this checkout (no install); ``optree`` must be importable (``pip install --target DIR optree`` where pip works,
then ``PYTHONPATH=DIR``). Each part is guarded: one that fails prints its error and the others still run. Everything
printed also goes to ``$OUT/gpu.txt`` when ``OUT`` is set. Parts:

1. *kernels*: for each chain and dtype, one step on the default backend (torch's fused kernel where the chain is
   its), on ``fadam.backend("kernel")`` (the generated kernel: Triton's on CUDA) and ``fadam.backend("triton")``
   against ``fadam.backend("eager")``: the largest difference in units of the eager result's last place, and the
   backend ``fadam.explain`` names on ``"triton"``;
2. *syncs*: the same steps under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host sync, and
   the steps of ``fadam.capturable(clip+adamw)`` and of AdamW through ``fadam.Optimizer(capturable=True)``;
3. *graphs*: a donated step captured in a CUDA graph and replayed, against eager steps: each chain as it is, then
   ``fadam.capturable(clip+adamw)``, AdamW through ``fadam.Optimizer(capturable=True)`` (a tensor lr on the GPU) and
   ``torch.optim.AdamW(capturable=True)`` for comparison;
4. *times*: median step time over interleaved rounds (CUDA events) as a ratio to ``torch.optim.AdamW(fused=True)``,
   on 1 tensor of 100M elements and on a GPT-2-sized model (124M params in 148 tensors), with bitsandbytes' 8-bit
   AdamW where it imports.

``--device cpu --small`` runs every part on the CPU at small sizes (Triton through its interpreter when
``TRITON_INTERPRET=1``): the test suite runs it so, and so this script is known to start; parts 2 and 3 need CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fadam, not an installed one

import torch

import fadam

lines: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    lines.append(text)


def chains() -> dict[str, Callable[[], fadam.GradientTransformation]]:
    return {
        "adamw": lambda: fadam.adamw(1e-3, weight_decay=1e-2),
        "clip+adamw": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-3, weight_decay=1e-2)),
        "lion": lambda: fadam.lion(1e-4),
        "sgd nesterov": lambda: fadam.sgd(1e-2, momentum=0.9, nesterov=True),
        "adamw8bit": lambda: fadam.adamw8bit(1e-3, weight_decay=1e-2),
        "lion8bit": lambda: fadam.lion8bit(1e-4),
    }


def model_shapes(small: bool) -> dict[str, list[tuple[int, ...]]]:
    """One large tensor, and GPT-2 small's parameter shapes (12 layers of width 768, a 50257-token vocabulary)."""
    if small:
        return {"1 tensor of 65k": [(1 << 16,)], "a small model": [(64, 32), (32,), (32, 32), (32,)] * 3}
    width, layer = 768, []
    layer += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
    layer += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    gpt2 = [(50257, width), (1024, width), *layer * 12, (width,), (width,)]
    return {"1 tensor of 100M": [(100_000_000,)], "GPT-2 small (124M, 148 tensors)": gpt2}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` in units of the last place of ``b``'s dtype."""
    if a.numel() == 0 or torch.equal(a, b):
        return 0
    wide_a, wide_b = a.double(), b.double()
    spacing = torch.finfo(b.dtype).eps * wide_b.abs().clamp(min=torch.finfo(b.dtype).tiny)
    return int(((wide_a - wide_b).abs() / spacing).nan_to_num(nan=float(1 << 62)).max().ceil())


def _stepped(tx: fadam.GradientTransformation, params: list, grads: list, name: str) -> list[torch.Tensor]:
    with fadam.backend(name):
        return fadam.step(tx, params, grads, tx.init(params))[0]


def kernels(device: torch.device, small: bool) -> None:
    say("## 1. generated kernels against eager: one step, largest difference in ulps of the eager params")
    shapes = [(5000,), (64, 33), (1025,)] if small else [(1 << 20,), (4096, 33), (1025,)]
    for dtype in (torch.float32,) if small else (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
        grads = [(torch.randn(s, generator=gen) * 1e-2).to(device, dtype) for s in shapes]
        for name, make in chains().items():
            tx = make()
            eager = _stepped(tx, params, grads, "eager")
            found = []
            for backend in ("auto", "kernel", "triton"):
                stepped = _stepped(tx, params, grads, backend)
                found.append(f"{backend} {max(_ulps(a, b) for a, b in zip(stepped, eager))}")
            with fadam.backend("triton"):
                taken = sorted({line.split(": ")[1] for line in fadam.explain(tx, params, grads).splitlines()})
            say(f"  {name:13} {dtype!s:15} {', '.join(found):27} triton backend: {'; '.join(taken)}")


def capturable_chains() -> dict[str, Callable[[], fadam.GradientTransformation]]:
    """The chains whose steps are checked for syncs and captured with their state on the GPU."""
    return {"capturable clip+adamw": lambda: fadam.capturable(chains()["clip+adamw"]())}


def _optimizer(
    make: Callable[..., torch.optim.Optimizer], params: list, grads: list, capturable: bool
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """An AdamW optimizer (``make``: ``fadam.Optimizer`` over ``fadam.adamw``, or ``torch.optim.AdamW``) over copies of
    ``params`` holding ``grads``, and the copies; with ``capturable``, its lr a tensor on their device, as torch.optim's
    capturable mode takes one that a scheduler changes."""
    tensors = [p.clone() for p in params]
    for p, g in zip(tensors, grads):
        p.grad = g
    lr = torch.tensor(1e-3, device=params[0].device) if capturable else 1e-3
    return make(tensors, lr=lr, weight_decay=1e-2, capturable=capturable), tensors


def _fadam_adamw(tensors: list, **options: object) -> torch.optim.Optimizer:
    return fadam.Optimizer(tensors, fadam.adamw, **options)


def _synced(name: str, run: Callable[[], None]) -> None:
    """Runs ``run`` once (kernels load), then once under ``set_sync_debug_mode("error")``; says whether it synced."""
    try:
        run()
        torch.cuda.synchronize()
    except Exception as err:  # a report: the reason is the result
        say(f"  {name:40} did not run: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
        say(f"  {name:40} no host sync")
    except RuntimeError as err:
        say(f"  {name:40} syncs: {str(err).splitlines()[0][:100]}")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def syncs(device: torch.device, small: bool) -> None:
    say("## 2. host syncs: steps under torch.cuda.set_sync_debug_mode('error')")
    if device.type != "cuda":
        say("  needs CUDA")
        return
    params = [torch.randn(s, device=device) for s in [(4096,), (64, 64)]]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    for name, make in {**chains(), **capturable_chains()}.items():
        _synced(name, _fadam_variant(make(), params, grads))
    for capturable in (False, True):
        opt, _ = _optimizer(_fadam_adamw, params, grads, capturable)
        _synced(f"Optimizer(capturable={capturable}) adamw", opt.step)


def _replayed(name: str, run: Callable[[], None], params: list, expected: list) -> None:
    """Runs ``run`` once outside a capture (kernels load), captures it in a CUDA graph, replays that 3 times and says
    how far ``params`` then are from ``expected``, the params after 4 eager steps; or why it did not capture."""
    try:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        worst = max(_ulps(a, b) for a, b in zip(params, expected))
        say(f"  {name:40} captured; after 3 replays {worst} ulps from eager steps")
    except Exception as err:  # a report: the reason is the result
        say(f"  {name:40} not capturable: {type(err).__name__}: {str(err).splitlines()[0][:100]}")


def _donated(tx: fadam.GradientTransformation, params: list, grads: list) -> Callable[[], None]:
    """A donated step of ``tx``, which writes ``params`` in place (and, under ``fadam.capturable``, its state too);
    the state is kept between calls."""
    holder = {"state": tx.init(params)}

    def run() -> None:
        _, holder["state"] = fadam.step(tx, params, grads, holder["state"], donate=True)

    return run


def _eager_steps(tx: fadam.GradientTransformation, params: list, grads: list, steps: int = 4) -> list[torch.Tensor]:
    expected, state = [p.clone() for p in params], tx.init(params)
    for _ in range(steps):
        expected, state = fadam.step(tx, expected, grads, state)
    return expected


def graphs(device: torch.device, small: bool) -> None:
    say("## 3. CUDA graphs: a donated step captured once and replayed 3 times, against 4 eager steps")
    if device.type != "cuda":
        say("  needs CUDA")
        return
    shapes = [(4096,), (64, 64)]
    for name, make in {**chains(), **capturable_chains()}.items():
        tx = make()
        params = [torch.randn(s, device=device) for s in shapes]
        grads = [torch.randn_like(p) * 1e-2 for p in params]
        expected = _eager_steps(tx, params, grads)
        _replayed(name, _donated(tx, params, grads), params, expected)
    params = [torch.randn(s, device=device) for s in shapes]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    for name, make in (("fadam.Optimizer", _fadam_adamw), ("torch.optim.AdamW", torch.optim.AdamW)):
        reference, expected = _optimizer(make, params, grads, capturable=False)
        for _ in range(4):
            reference.step()
        opt, tensors = _optimizer(make, params, grads, capturable=True)
        _replayed(f"{name}(capturable=True) adamw", opt.step, tensors, expected)


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    def cuda_ms(run: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def cpu_ms(run: Callable[[], None]) -> float:
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3

    return cuda_ms if device.type == "cuda" else cpu_ms


def _fadam_variant(tx: fadam.GradientTransformation, params: list, grads: list) -> Callable[[], None]:
    holder = {"params": [p.clone() for p in params]}
    holder["state"] = tx.init(holder["params"])

    def run() -> None:
        holder["params"], holder["state"] = fadam.step(tx, holder["params"], grads, holder["state"], donate=True)

    return run


def _torch_variant(make: Callable[[list], torch.optim.Optimizer], params: list, grads: list) -> Callable[[], None]:
    tensors = [p.clone() for p in params]
    for p, g in zip(tensors, grads):
        p.grad = g
    return make(tensors).step


def variants(device: torch.device, params: list, grads: list) -> dict[str, Callable[[], None]]:
    found = {"torch AdamW(fused=True)": _torch_variant(lambda p: torch.optim.AdamW(p, fused=True), params, grads)}
    for name, make in chains().items():
        found[f"fadam {name}"] = _fadam_variant(make(), params, grads)
    found["fadam paged adamw (host)"] = _fadam_variant(
        fadam.page_state(fadam.adamw(1e-3, weight_decay=1e-2), storage="host", per_leaf=True), params, grads
    )
    if device.type == "cuda":
        try:
            import bitsandbytes

            found["bitsandbytes AdamW8bit"] = _torch_variant(bitsandbytes.optim.AdamW8bit, params, grads)
        except ImportError:
            say("  (bitsandbytes is not importable: no row for it)")
    return found


def times(device: torch.device, small: bool, rounds: int) -> None:
    say(f"## 4. step time: median of {rounds} interleaved rounds, ratio to torch AdamW(fused=True)")
    timer = _timer(device)
    for label, shapes in model_shapes(small).items():
        params = [torch.randn(s, device=device) for s in shapes]
        grads = [torch.randn_like(p) * 1e-2 for p in params]
        runs, failed = variants(device, params, grads), []
        measured: dict[str, list[float]] = {name: [] for name in runs}
        for round_number in range(rounds + 2):  # two warm-up rounds: kernels load and compile
            for name, run in runs.items():
                if name in failed:
                    continue
                try:
                    elapsed = timer(run)
                except Exception as err:  # one variant's failure is reported, the others go on
                    failed.append(name)
                    say(f"  {name} failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                    continue
                if round_number >= 2:
                    measured[name].append(elapsed)
        anchor = statistics.median(measured["torch AdamW(fused=True)"])
        say(f"  {label}: torch AdamW(fused=True) {anchor:.3f} ms")
        for name, found in measured.items():
            if found:
                say(f"    {name:40} {statistics.median(found):9.3f} ms {statistics.median(found) / anchor:6.2f}x")
        del params, grads, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small sizes (a check that every part runs)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    say(f"fadam GPU run: torch {torch.__version__}, device {device}")
    if device.type == "cuda":
        say(f"  {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}")
    failures = 0
    for part in (kernels, syncs, graphs, lambda d, s: times(d, s, args.rounds)):
        try:
            part(device, args.small)
        except Exception:  # each part is guarded, so that one failure does not lose the rest
            failures += 1
            say(traceback.format_exc())
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu.txt").write_text("\n".join(lines) + "\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
