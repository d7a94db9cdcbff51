"""GPU checks for schedules, inject_hyperparams and the robustness wrappers, in one process.

    python benchmarks/gpu_training_wrappers.py            # on a CUDA machine, < 90 s
    python benchmarks/gpu_training_wrappers.py --device cpu   # dry run of the same checks

Checks (each prints ok/FAIL): schedules on a device step tensor equal the CPU values; inject_hyperparams(adam) with a
scheduled lr through fadam.step is bit-identical to plain adam (both fused); apply_if_finite skips a NaN step with
params and inner state unchanged; MultiSteps(adam, 4) equals adam stepping on the means. Then host synchronisations
per step (torch.cuda.set_sync_debug_mode) and per-step medians against plain fused adam. Writes the table to
$OUT/training_wrappers.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import fadam

LINES: list[str] = []


def report(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_syncs(device: torch.device, fn: Callable[[], object]) -> int | str:
    """Host synchronisations caused by ``fn`` (CUDA only)."""
    if device.type != "cuda":
        return "n/a"
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def median_ms(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--leaves", type=int, default=20)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.time()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report(f"fadam training wrappers on {name}, torch {torch.__version__}, {args.leaves} x {args.size} float32")
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = {f"p{i}": torch.randn(args.size, generator=gen).to(device) for i in range(args.leaves)}

    def grads(step: int, bad: bool = False) -> dict:
        g = torch.Generator(device="cpu").manual_seed(100 + step)
        out = {k: torch.randn(args.size, generator=g).to(device) for k in params}
        if bad:
            out["p0"][7] = float("nan")
        return out

    def guarded_check(label: str, fn: Callable[[], bool]) -> None:
        """Runs one check; an exception is reported as a failure with its message, and the script goes on."""
        try:
            result = "ok" if fn() else "FAIL"
        except Exception as err:  # report and continue: one run on the GPU machine must show every check
            result = f"FAIL ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        report(f"{label}: {result}")

    lr = fadam.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 50)
    guarded_check(f"schedules on a {device.type} step tensor equal the CPU values", lambda: check_schedules(device, lr))
    guarded_check(
        "inject_hyperparams(adam)(lr=schedule) == adam(lr=schedule), 5 fused steps",
        lambda: check_inject(params, grads, lr),
    )
    guarded_check("apply_if_finite skips a NaN step (fused and update paths)", lambda: check_finite(params, grads))
    guarded_check("MultiSteps(adam, 4) equals adam on the means", lambda: check_multisteps(params, grads))
    timings(device, params, grads(0), lr, args.repeats)
    report(f"total {time.time() - started:.1f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "training_wrappers.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")


def check_schedules(device: torch.device, lr: fadam.Schedule) -> bool:
    ok = True
    for schedule in (
        lr,
        fadam.linear_onecycle_schedule(100, 1.0),
        fadam.sgdr_schedule([{"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 3, "decay_steps": 20}] * 2),
    ):
        for step in (0, 3, 17, 40, 99):
            on_device = schedule(torch.tensor(step, dtype=torch.int32, device=device))
            ok &= on_device.device.type == device.type
            ok &= abs(float(on_device) - float(schedule(torch.tensor(step, dtype=torch.int32)))) <= 1e-12
    return ok


def check_inject(params: dict, grads: Callable[..., dict], lr: fadam.Schedule) -> bool:
    plain, injected = fadam.adam(lr=lr), fadam.inject_hyperparams(fadam.adam)(lr=lr)
    p_a, s_a, p_b, s_b = params, plain.init(params), params, injected.init(params)
    for step in range(5):
        p_a, s_a = fadam.step(plain, p_a, grads(step), s_a)
        p_b, s_b = fadam.step(injected, p_b, grads(step), s_b)
    return same(p_a, p_b)


def check_finite(params: dict, grads: Callable[..., dict]) -> bool:
    guarded = fadam.apply_if_finite(fadam.adam(lr=1e-3), 3)
    state = guarded.init(params)
    p1, state = fadam.step(guarded, params, grads(0), state)
    p2, state2 = fadam.step(guarded, p1, grads(1, bad=True), state)
    skipped = same(p1, p2) and int(state2.total_notfinite) == 1 and int(state2.inner_state[0].count) == 1
    updates, state3 = guarded.update(grads(1, bad=True), state, p1)  # the update path too
    skipped &= all(torch.equal(u, torch.zeros_like(u)) for u in updates.values()) and int(state3.total_notfinite) == 1
    return skipped


def check_multisteps(params: dict, grads: Callable[..., dict]) -> bool:
    multi = fadam.MultiSteps(fadam.adam(lr=1e-3), 4).gradient_transformation()
    p_m, s_m, p_r, s_r = params, multi.init(params), params, fadam.adam(lr=1e-3).init(params)
    for outer in range(2):
        gs = [grads(4 * outer + i) for i in range(4)]
        for g in gs:
            p_m, s_m = fadam.step(multi, p_m, g, s_m)
        mean = {k: sum(g[k] for g in gs) / 4 for k in params}
        p_r, s_r = fadam.step(fadam.adam(lr=1e-3), p_r, mean, s_r)
    return all(torch.allclose(p_m[k], p_r[k], rtol=1e-5, atol=1e-6) for k in params)


def timings(device: torch.device, params: dict, g0: dict, lr: fadam.Schedule, repeats: int) -> None:
    """Host synchronisations per step and per-step medians against plain fused adam."""
    variants = {
        "adam (fused)": (fadam.adam(lr=1e-3), False),
        "inject(adam) lr=schedule": (fadam.inject_hyperparams(fadam.adam)(lr=lr), False),
        "apply_if_finite(adam)": (fadam.apply_if_finite(fadam.adam(lr=1e-3), 3), False),
        "apply_if_finite(adam) update": (fadam.apply_if_finite(fadam.adam(lr=1e-3), 3), True),
        "MultiSteps(adam, k=1)": (fadam.MultiSteps(fadam.adam(lr=1e-3), 1).gradient_transformation(), False),
    }
    report(f"{'variant':30} {'syncs/step':>10} {'ms/step':>9} {'vs adam':>8}")
    base = None
    for label, (tx, via_update) in variants.items():
        state = tx.init(params)

        def run(tx=tx, state=state, via_update=via_update) -> None:
            if via_update:
                updates, _ = tx.update(g0, state, params)
                fadam.apply_updates(params, updates)
            else:
                fadam.step(tx, params, g0, state)

        run()
        syncs = count_syncs(device, run)
        ms = median_ms(device, run, repeats)
        base = base or ms
        report(f"{label:30} {syncs!s:>10} {ms:9.3f} {ms / base:7.2f}x")


if __name__ == "__main__":
    main()
