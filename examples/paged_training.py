"""Train an MLP with its AdamW state paged to disk, and compare the resident memory with in-memory state.

    python examples/paged_training.py                 # both runs, a table of resident memory per step
    python examples/paged_training.py --plot rss.png  # and a plot (needs matplotlib)

Each run is its own process, so its resident set size (RSS, read from /proc) is its own: the in-memory run holds
params + gradients + two AdamW moments; the paged run holds params + gradients + about two chunks of state, the rest
living in a file that doubles as the checkpoint (``resume=True`` reopens it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fadam

PAGED = fadam.paged_adamw  # the paged optimizer under test (8-bit state: fadam.paged_adamw8bit)
IN_MEMORY = fadam.adamw
LABELS = {"memory": "AdamW state in memory", "disk": "AdamW state paged to disk"}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_model(width: int, depth: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(width, width, generator=gen) / width**0.5 for i in range(depth)}


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for w in params.values():
        h = torch.tanh(h @ w)
    return (h - y).square().mean()


def train(storage: str, steps: int, width: int, depth: int) -> dict:
    """One training run; returns the loss and RSS (MiB) after each step."""
    params = make_model(width, depth)
    if storage == "disk":
        path = os.path.join(tempfile.gettempdir(), f"fadam-example-{os.getpid()}.state")
        tx = PAGED(lr=1e-3, storage="disk", path=path, chunk_bytes=16 << 20)
    else:
        path, tx = None, IN_MEMORY(lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, width, generator=gen), torch.randn(64, width, generator=gen)
    rss = [rss_mib()]
    state = tx.init(params)
    rss.append(rss_mib())
    losses = []
    start = time.perf_counter()
    try:
        for _ in range(steps):
            leaves = {k: v.requires_grad_() for k, v in params.items()}
            loss = loss_fn(leaves, x, y)
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
            params = {k: v.detach() for k, v in leaves.items()}
            params, state = fadam.step(tx, params, grads, state, donate=True)
            losses.append(loss.item())
            rss.append(rss_mib())
    finally:
        if path is not None and os.path.exists(path):
            os.unlink(path)
    return {"storage": storage, "loss": losses, "rss_mib": rss, "seconds": time.perf_counter() - start}


def run_both(steps: int, width: int, depth: int) -> list[dict]:
    """Each configuration in a fresh process, so that each RSS curve is its own."""
    results = []
    for storage in ("memory", "disk"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                storage,
                "--steps",
                str(steps),
                "--width",
                str(width),
                "--depth",
                str(depth),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results.append(json.loads(out.splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--plot")
    parser.add_argument("--child", choices=["memory", "disk"])
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.child:
        print(json.dumps(train(args.child, args.steps, args.width, args.depth)))
        return
    results = run_both(args.steps, args.width, args.depth)
    n_params = args.width * args.width * args.depth
    print(
        f"{n_params / 1e6:.1f}M params ({n_params * 4 / 2**20:.0f} MiB), "
        f"AdamW state {n_params * 8 / 2**20:.0f} MiB; RSS in MiB after init and each step"
    )
    print(f"{'step':>5} " + " ".join(f"{r['storage']:>8}" for r in results))
    labels = ["start", "init"] + [str(i + 1) for i in range(args.steps)]
    for i, label in enumerate(labels):
        print(f"{label:>5} " + " ".join(f"{r['rss_mib'][i]:>8.0f}" for r in results))
    same = results[0]["loss"] == results[1]["loss"]
    print(f"identical losses: {same}; seconds: " + ", ".join(f"{r['storage']} {r['seconds']:.1f}" for r in results))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in results:
            growth = [x - r["rss_mib"][0] for x in r["rss_mib"]]
            ax.plot(range(-1, args.steps + 1), growth, marker="o", label=LABELS[r["storage"]])
        ax.axhline(n_params * 8 / 2**20, color="gray", linestyle=":", label="size of the AdamW state")
        ax.set(xlabel="step (-1: start, 0: after init)", ylabel="resident memory added (MiB)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
