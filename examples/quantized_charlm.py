"""Train a small character-level transformer on the Python standard library's own source, with fp32, 8-bit and 4-bit
Adam state, from the same seed on the same batches, and compare validation loss and optimizer-state bytes per param.

    python examples/quantized_charlm.py                 # default size: a few minutes on a laptop CPU
    python examples/quantized_charlm.py --steps 20 --tiny --out results.json

Everything is offline: the text is the ``.py`` files next to the ``os`` module, read in sorted order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import optree
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import fadam


def stdlib_text(max_chars: int) -> bytes:
    root = Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_chars:
            break
    return b"".join(chunks)[:max_chars]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def batches(data: torch.Tensor, batch: int, context: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - context - 1, (steps, batch), generator=g)
    return [torch.stack([data[s : s + context + 1] for s in row.tolist()]) for row in starts]


def train(name: str, tx: fadam.GradientTransformation, cfg: argparse.Namespace, data: dict) -> dict:
    torch.manual_seed(cfg.seed)
    model = CharLM(cfg.dim, cfg.layers, cfg.heads, cfg.context)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = tx.init(params)
    state_bytes = sum(t.numel() * t.element_size() for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor))
    n_params = sum(p.numel() for p in params.values())

    def loss_fn(p: dict, chunk: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (chunk[:, :-1],))
        return F.cross_entropy(logits.reshape(-1, 256), chunk[:, 1:].reshape(-1))

    def evaluate(p: dict) -> float:
        with torch.no_grad():
            return sum(loss_fn(p, chunk).item() for chunk in data["val"]) / len(data["val"])

    curve, start = [], time.perf_counter()
    for step, chunk in enumerate(data["train"]):
        p = {k: v.requires_grad_(True) for k, v in params.items()}
        grads = dict(zip(p, torch.autograd.grad(loss_fn(p, chunk), list(p.values()))))
        p = {k: v.detach() for k, v in p.items()}
        if cfg.pure:  # the chain, no fused kernels (no compilation)
            updates, state = tx.update(grads, state, p)
            params = fadam.apply_updates(p, updates)
        else:
            params, state = fadam.step(tx, p, grads, state, donate=True)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == len(data["train"]):
            curve.append((step + 1, evaluate(params)))
            print(f"{name:>6} step {step + 1:5d} val loss {curve[-1][1]:.4f} ({time.perf_counter() - start:.0f} s)")
    return {"curve": curve, "final_val_loss": curve[-1][1], "state_bytes_per_param": state_bytes / n_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pure", action="store_true", help="tx.update + apply_updates instead of fadam.step")
    parser.add_argument("--out", type=Path, default=None, help="write the curves and figures as JSON")
    cfg = parser.parse_args()
    if cfg.tiny:
        cfg.dim, cfg.layers, cfg.heads, cfg.context, cfg.batch = 64, 1, 2, 32, 8
    torch.set_num_threads(cfg.threads)
    text = torch.frombuffer(bytearray(stdlib_text(2_000_000 if not cfg.tiny else 200_000)), dtype=torch.uint8).long()
    split = int(0.9 * text.numel())
    data = {
        "train": batches(text[:split], cfg.batch, cfg.context, cfg.steps, cfg.seed + 1),
        "val": batches(text[split:], cfg.batch, cfg.context, 8 if cfg.tiny else 24, cfg.seed + 2),
    }
    schedule = cfg.lr
    optimizers = {
        "fp32": fadam.adamw(lr=schedule, weight_decay=0.01),
        "8bit": fadam.adamw8bit(lr=schedule, weight_decay=0.01),
        "4bit": fadam.adamw4bit(lr=schedule, weight_decay=0.01),
    }
    results = {name: train(name, tx, cfg, data) for name, tx in optimizers.items()}
    base = results["fp32"]["final_val_loss"]
    for name, r in results.items():
        r["relative_to_fp32"] = r["final_val_loss"] / base - 1
        print(
            f"{name:>6}: final val loss {r['final_val_loss']:.4f} ({100 * r['relative_to_fp32']:+.2f}% vs fp32), "
            f"optimizer state {r['state_bytes_per_param']:.3f} bytes/param"
        )
    if cfg.out:
        config = {k: v for k, v in vars(cfg).items() if k != "out"}
        cfg.out.write_text(json.dumps({"config": config, "results": results}, indent=1))
    assert all(math.isfinite(r["final_val_loss"]) for r in results.values())


if __name__ == "__main__":
    main()
