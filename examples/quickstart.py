"""fadam quick start: a purely functional training loop.

An MLP learns to separate two interleaved spirals (data generated here, no download). The model is used through
``torch.func.functional_call``; gradients come from ``torch.func.grad``; the optimizer is a value: ``tx.init`` makes
its state, ``fadam.step`` returns new params and state. Nothing is mutated in place.

Run: ``python examples/quickstart.py [--steps 600]``
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn
from torch.func import functional_call, grad
from tqdm import tqdm

import fadam


def two_spirals(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points on each of two interleaved spirals, with a little noise; labels 0 and 1."""
    t = torch.rand(n, generator=generator) * 3 * math.pi + 0.5
    arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1) / (3 * math.pi)
    noise = 0.02 * torch.randn(2 * n, 2, generator=generator)
    x = torch.cat([arm, -arm]) + noise
    y = torch.cat([torch.zeros(n), torch.ones(n)]).long()
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description="fadam functional quick start")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    x_train, y_train = two_spirals(1000, generator)
    x_test, y_test = two_spirals(500, generator)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    grad_fn = grad(loss_fn)
    tx = fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(lr=args.lr, weight_decay=1e-4))
    state = tx.init(params)

    start = time.perf_counter()
    progress = tqdm(range(args.steps), desc="training", unit="step")
    for step in progress:
        grads = grad_fn(params, x_train, y_train)
        params, state = fadam.step(tx, params, grads, state)
        if step % 50 == 0:
            progress.set_postfix(loss=f"{loss_fn(params, x_train, y_train).item():.4f}")
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        logits = functional_call(model, params, (x_test,))
        accuracy = (logits.argmax(dim=1) == y_test).float().mean().item()
        test_loss = nn.functional.cross_entropy(logits, y_test).item()
    print(f"\n{args.steps} steps in {elapsed:.1f} s ({elapsed / args.steps * 1e3:.1f} ms/step)")
    print(f"final train loss {loss_fn(params, x_train, y_train).item():.4f}")
    print(f"test loss {test_loss:.4f}, test accuracy {accuracy:.1%}")


if __name__ == "__main__":
    main()
