"""Step time of Adafactor (factored second moments) against torch.optim.Adafactor and AdamW, and the bandwidth bound.

Two workloads of fp32 matrices: (a) one of 4096 x 4096 (16.78M elements), (b) 200 of 256 x 328 (16.79M). Every
variant runs interleaved in one process (round-robin, one step each per round, after two warm-up steps), as
``bench_chains.py`` runs its rows; the medians are compared as ``ratio = variant ms / torch Adafactor ms``. fadam's
steps are donated, ``fadam.step(tx, params, grads, state, donate=True)``, with fixed grads (``randn * 1e-2``):

- ``fadam.adafactor``: optax's Adafactor, ``chain(scale_by_factored_rms, clip_by_block_rms, scale_by_learning_rate,
  scale_by_param_block_rms, scale(-1))``: the row and column means by torch ops, then three kernel passes (the
  factored scaling, the RMS clip and learning rate, the param-scaled step), each after its per-leaf reduction;
- ``fadam.adafactor_torch``: torch.optim.Adafactor's algorithm, its row and column means by torch ops, then two
  kernel passes (the factored scaling; the RMS clip and relative step, after the update's and the params' norms);
- the anchors: ``torch.optim.Adafactor(foreach=True)`` and ``AdamW(fused=True)`` (for scale).

The bound is what an Adafactor step must move at the least, over the in-place bandwidth measured here: read the
gradient for its row and column means, read it again for the update's RMS, read the params for theirs, then read
both and write the params: 24 bytes an element.

Run: ``python benchmarks/bench_factored.py [--rounds 15] [--threads 2]``
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from bench_adam import inplace_bandwidth_gbs  # benchmarks/, the script's folder
from bench_chains import Variant, call, print_machine

import fadam

BOUND_BYTES = 24
ANCHOR = "torch Adafactor foreach"


def variants(shapes: list[tuple[int, int]]) -> dict[str, Variant]:
    torch.manual_seed(0)
    params0 = [torch.randn(shape) for shape in shapes]
    grads = [torch.randn(shape) * 1e-2 for shape in shapes]

    def fadam_variant(tx: fadam.GradientTransformation) -> Variant:
        holder = {"params": [p.clone() for p in params0]}
        holder["state"] = tx.init(holder["params"])

        def run() -> None:
            holder["params"], holder["state"] = fadam.step(tx, holder["params"], grads, holder["state"], donate=True)

        return Variant(run)

    def torch_variant(cls: type[torch.optim.Optimizer], **kwargs) -> Variant:
        params = [p.clone() for p in params0]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return Variant(cls(params, **kwargs).step)

    return {
        "fadam adafactor": fadam_variant(fadam.adafactor(1e-3)),
        "fadam adafactor_torch": fadam_variant(fadam.adafactor_torch(1e-2)),
        ANCHOR: torch_variant(torch.optim.Adafactor, lr=1e-2, foreach=True),
        "torch AdamW fused": torch_variant(torch.optim.AdamW, lr=1e-3, fused=True),
    }


def measure(shapes: list[tuple[int, int]], rounds: int) -> dict[str, float]:
    found = variants(shapes)
    for variant in found.values():  # warm up: state allocation, kernel builds, first-step branches
        call(variant)
        call(variant)
    times: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(rounds):
        for name, variant in found.items():
            times[name].append(call(variant))
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bandwidth = inplace_bandwidth_gbs(max(args.rounds, 5))
    print_machine(args.threads, bandwidth)
    workloads = {"(a) 1 x 4096x4096": [(4096, 4096)], "(b) 200 x 256x328": [(256, 328)] * 200}
    print(f"median ms per step over {args.rounds} interleaved rounds; ratio = variant / {ANCHOR}")
    print(f"{'variant':<26}{'workload':<20}{'ms':>8}{'ratio':>8}{'bound ms':>10}")
    for workload, shapes in workloads.items():
        bound_ms = BOUND_BYTES * sum(rows * columns for rows, columns in shapes) / (bandwidth * 1e9) * 1e3
        medians = measure(shapes, args.rounds)
        for name, ms in medians.items():
            print(f"{name:<26}{workload:<20}{ms:8.1f}{ms / medians[ANCHOR]:8.2f}{bound_ms:10.1f}")
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
