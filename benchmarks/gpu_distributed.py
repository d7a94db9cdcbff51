"""GPU checks for ``fadam.pmap`` and model-parallel params; runs in well under a minute on one GPU.

    python benchmarks/gpu_distributed.py            # from the repository root; OUT=dir also writes dir/distributed.txt

On one GPU, ``pmap`` runs over ``[cuda:0, cuda:0]`` (two shards queued on the same device) and model-parallel leaves
are split across ``cuda:0`` and the CPU. Every check compares with a single-device run: bit for bit against ``vmap``
on one CUDA device, within 1e-6 against the CPU (CUDA kernels may round differently). ``pmap``'s steady-state step runs
under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host synchronization. Last, the FSDP2 example
runs on 1 GPU with NCCL via torchrun. Timings are medians of interleaved repeats in this process.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.func import vmap

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fadam  # noqa: E402

ROWS: list[tuple[str, str, str, str]] = []  # (check, result, detail, time)
# --dry-run-on-cpu runs every check with the CPU standing in for cuda:0 (no sync check, no example), to test this script
DRY_RUN = "--dry-run-on-cpu" in sys.argv
ACCEL = torch.device("cpu") if DRY_RUN else torch.device("cuda", 0)


def synchronize() -> None:
    if not DRY_RUN:
        torch.cuda.synchronize()


def set_sync_debug_mode(mode: str) -> None:
    if not DRY_RUN:
        torch.cuda.set_sync_debug_mode(mode)


OPTIMIZERS: dict[str, Callable[[], fadam.GradientTransformation]] = {
    "adam": lambda: fadam.adam(1e-2, amsgrad=True, weight_decay=0.1),
    "adamw": lambda: fadam.adamw(1e-2),
    "sgd-momentum": lambda: fadam.sgd(1e-2, momentum=0.9, nesterov=True),
    "clip+adamw": lambda: fadam.chain(fadam.clip_by_global_norm(0.1), fadam.adamw(1e-2)),
    "clip+sgd": lambda: fadam.chain(fadam.clip_by_global_norm(0.1), fadam.sgd(1e-2, momentum=0.9)),
}


def record(check: str, ok: bool, detail: str, seconds: float | None = None) -> None:
    ROWS.append((check, "PASS" if ok else "FAIL", detail, "" if seconds is None else f"{seconds * 1e3:.2f} ms"))


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].to("cpu", torch.float64) - b[k].to("cpu", torch.float64)).abs().max().item() for k in a)


def ensemble(n: int, device: torch.device) -> tuple[dict, list[dict]]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"w1": (256, 512), "b1": (256,), "w2": (10, 256)}
    params = {k: torch.randn(n, *s, generator=generator).to(device) for k, s in shapes.items()}
    grads = [{k: torch.randn(n, *s, generator=generator).to(device) for k, s in shapes.items()} for _ in range(3)]
    return params, grads


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_pmap() -> None:
    cuda = ACCEL
    devices = [cuda, cuda]
    for name, make in OPTIMIZERS.items():
        tx = make()
        params, grads = ensemble(8, cuda)
        init, update = fadam.pmap(tx.init, devices), fadam.pmap(tx.update, devices)
        apply = fadam.pmap(fadam.apply_updates, devices)
        state, p = init(params), params
        ref_state, ref = vmap(tx.init)(params), params
        cpu_state, cpu = vmap(tx.init)({k: v.cpu() for k, v in params.items()}), {k: v.cpu() for k, v in params.items()}
        for step, g in enumerate(grads):
            if step == 0:
                updates, state = update(g, state, p)
                p = apply(p, updates)
            else:  # steady state: no host synchronization allowed
                set_sync_debug_mode("error")
                try:
                    updates, state = update(g, state, p)
                    p = apply(p, updates)
                finally:
                    set_sync_debug_mode("default")
            ref_updates, ref_state = vmap(tx.update)(g, ref_state, ref)
            ref = vmap(fadam.apply_updates)(ref, ref_updates)
            cpu_updates, cpu_state = vmap(tx.update)({k: v.cpu() for k, v in g.items()}, cpu_state, cpu)
            cpu = vmap(fadam.apply_updates)(cpu, cpu_updates)
        gathered = fadam.gather(p)
        exact = all(torch.equal(gathered[k], ref[k]) for k in ref)
        cpu_diff = max_diff(gathered, cpu)
        record(
            f"pmap {name} [cuda:0, cuda:0] vs vmap cuda:0 / cpu",
            exact and cpu_diff <= 1e-6,
            f"bitwise={exact}, max|diff| vs cpu {cpu_diff:.1e}, no host sync in steps 2-3",
        )
    # timing: pmap over two shards of one device against vmap on it (the same work, plus the split)
    tx = OPTIMIZERS["adamw"]()
    params, grads = ensemble(8, cuda)
    update = fadam.pmap(tx.update, devices)
    state, ref_state = fadam.pmap(tx.init, devices)(params), vmap(tx.init)(params)
    state = update(grads[0], state, params)[1]
    pmap_times, vmap_times = [], []
    for _ in range(5):
        pmap_times.append(median_ms(lambda: update(grads[1], state, params), 5))
        vmap_times.append(median_ms(lambda: vmap(tx.update)(grads[1], ref_state, params), 5))
    p_ms, v_ms = statistics.median(pmap_times), statistics.median(vmap_times)
    record("pmap adamw update, 8 members x 134k params", True, f"vmap on cuda:0 {v_ms * 1e3:.2f} ms", p_ms)


def check_vmap() -> None:
    """Plain ``vmap`` of init/update on CUDA ensembles (step counts stay on the CPU) against the CPU."""
    cuda = ACCEL
    for name, make in OPTIMIZERS.items():
        tx = make()
        params, grads = ensemble(4, cuda)
        cpu = {k: v.cpu() for k, v in params.items()}
        state, cpu_state = vmap(tx.init)(params), vmap(tx.init)(cpu)
        for g in grads:
            updates, state = vmap(tx.update)(g, state, params)
            params = vmap(fadam.apply_updates)(params, updates)
            cpu_updates, cpu_state = vmap(tx.update)({k: v.cpu() for k, v in g.items()}, cpu_state, cpu)
            cpu = vmap(fadam.apply_updates)(cpu, cpu_updates)
        diff = max_diff(params, cpu)
        record(f"vmap {name} on cuda:0 vs cpu", diff <= 1e-6, f"max|diff| {diff:.1e}")


def split_model(devices: list[torch.device]) -> tuple[dict, list[dict]]:
    generator = torch.Generator().manual_seed(3)
    shapes = {"embed": (1000, 64), "block.w": (256, 64), "block.b": (256,), "head": (10, 256), "scale": (1,)}
    params = {k: torch.randn(s, generator=generator).to(devices[i % 2]) for i, (k, s) in enumerate(shapes.items())}
    grads = [{k: torch.randn(v.shape, generator=generator).to(v.device) for k, v in params.items()} for _ in range(3)]
    return params, grads


def check_model_parallel() -> None:
    devices = [ACCEL, torch.device("cpu")]
    for name, make in OPTIMIZERS.items():
        for path in ("update", "step"):
            tx = make()
            params, grads = split_model(devices)
            ref = {k: v.cpu() for k, v in params.items()}
            state, ref_state = tx.init(params), tx.init(ref)
            device_of = {tuple(p.shape): p.device for p in params.values()}  # the shapes are distinct
            placed = all(
                leaf.device == device_of[tuple(leaf.shape)]
                for leaf in fadam._tree.tree_leaves(state)
                if leaf is not None and leaf.dim() > 0
            )
            for g in grads:
                if path == "step":
                    params, state = fadam.step(tx, params, g, state)
                else:
                    updates, state = tx.update(g, state, params)
                    params = fadam.apply_updates(params, updates)
                ref_updates, ref_state = tx.update({k: v.cpu() for k, v in g.items()}, ref_state, ref)
                ref = fadam.apply_updates(ref, ref_updates)
            placed = placed and all(params[k].device == device_of[tuple(params[k].shape)] for k in params)
            diff = max_diff(params, ref)
            ok = placed and diff <= 1e-6
            record(f"model parallel {name} ({path}) cuda:0+cpu vs cpu", ok, f"max|diff| {diff:.1e}")
    params, _ = split_model(devices)
    norm = fadam.tree_global_norm(params)
    expected = torch.cat([p.cpu().flatten() for p in params.values()]).norm()
    diff = abs(norm.item() - expected.item())
    record("tree_global_norm over cuda:0+cpu", diff <= 1e-6 * expected.item(), f"{norm.item():.6f} on {norm.device}")


def check_fsdp_example() -> None:
    if DRY_RUN:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    start = time.perf_counter()
    try:
        result = subprocess.run(
            [*command, str(ROOT / "examples" / "fsdp_transformer.py"), "--steps", "60"],
            capture_output=True,
            text=True,
            timeout=40,
            env=env,
            check=False,
        )
        final = [line for line in result.stdout.splitlines() if "final loss" in line]
        ok = result.returncode == 0 and bool(final)
        detail = final[0] if ok else (result.stdout + result.stderr)[-300:].replace("\n", " | ")
    except subprocess.TimeoutExpired:
        ok, detail = False, "timed out after 40 s"
    record("examples/fsdp_transformer.py, 1 GPU, nccl, 60 steps", ok, detail, time.perf_counter() - start)


def main() -> None:
    if not torch.cuda.is_available() and not DRY_RUN:
        print("no CUDA device: nothing to check here (tests/test_distributed.py covers CPU device lists)")
        return
    started = time.perf_counter()
    for check in (check_vmap, check_pmap, check_model_parallel, check_fsdp_example):
        try:
            check()
        except Exception as error:  # a failing check is reported in the table, the others still run
            record(check.__name__, False, f"{type(error).__name__}: {error}"[:300])
    width = max(len(row[0]) for row in ROWS)
    lines = [
        f"torch {torch.__version__}, {'CPU dry run' if DRY_RUN else torch.cuda.get_device_name(0)}, "
        f"{time.perf_counter() - started:.1f} s in all",
        f"{'check':<{width}}  result  time       detail",
    ]
    lines += [f"{check:<{width}}  {result:<6}  {t:<9}  {detail}" for check, result, detail, t in ROWS]
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "distributed.txt").write_text(table + "\n")
    sys.exit(0 if all(row[1] == "PASS" for row in ROWS) else 1)


if __name__ == "__main__":
    main()
