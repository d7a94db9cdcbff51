"""Module-based training with fadam: a small MLP trained by ``fadam.Optimizer`` like any torch.optim optimizer.

Shows the pieces a real loop needs: a ``torch.optim.lr_scheduler`` driving the fadam transform's learning rate,
gradient clipping with ``torch.nn.utils.clip_grad_norm_``, mixed precision (``torch.autocast`` in bfloat16 on CPU;
float16 with ``torch.amp.GradScaler`` on CUDA), and a checkpoint of the optimizer state.

The task is generated on the fly: 16x16 images holding a noisy horizontal or vertical bar; the label is the
orientation and whether the bar lies in the upper/left or lower/right half (4 classes).

    python examples/train_module.py                 # ~2 s of training on one CPU thread
    python examples/train_module.py --steps 20      # a quick smoke run
"""

from __future__ import annotations

import argparse
import functools
import io
import time

import torch

import fadam


def make_batch(batch_size: int, generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, 4, (batch_size,), generator=generator)
    positions = torch.randint(0, 8, (batch_size,), generator=generator) + 8 * (labels % 2)
    on_bar = (torch.arange(16) == positions[:, None]).float()  # (batch, 16): the bar's row or column
    horizontal = (labels < 2).float()[:, None, None]
    bars = horizontal * on_bar[:, :, None] + (1 - horizontal) * on_bar[:, None, :]  # horizontal: a row of ones
    images = 0.3 * torch.randn(batch_size, 16, 16, generator=generator) + bars
    return images[:, None].to(device), labels.to(device)


class SmallMLP(torch.nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(16 * 16, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden)
        )
        self.head = torch.nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    amp_dtype = torch.float16 if on_cuda else torch.bfloat16
    model = SmallMLP().to(device)

    # Weight decay only on weight matrices, not on biases and norms: two param groups, each with its own transform.
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.dim() <= 1]
    optimizer = fadam.Optimizer(
        [{"params": decay}, {"params": no_decay, "tx": functools.partial(fadam.adamw, weight_decay=0.0)}],
        functools.partial(fadam.adamw, weight_decay=0.05),  # a factory: the scheduler's lr reaches it exactly
        lr=args.lr,
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.2, cycle_momentum=False
    )
    scaler = torch.amp.GradScaler(device.type, enabled=on_cuda)  # bfloat16 needs no loss scaling

    generator = torch.Generator().manual_seed(args.seed + 1)
    eval_x, eval_y = make_batch(512, torch.Generator().manual_seed(12345), device)
    start, losses, clipped = time.perf_counter(), [], 0
    for _ in range(args.steps):
        x, y = make_batch(args.batch_size, generator, device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        clipped += int(norm > args.max_grad_norm)
        scaler.step(optimizer)  # skipped if a gradient is not finite
        scaler.update()
        scheduler.step()
        losses.append(loss.item())

    with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype):
        accuracy = (model(eval_x).argmax(dim=1) == eval_y).float().mean().item()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)  # tensors and lists only: loads with weights_only=True
    window = max(1, min(20, args.steps // 5))
    summary = {
        "first_loss": sum(losses[:window]) / window,
        "final_loss": sum(losses[-window:]) / window,
        "accuracy": accuracy,
        "final_lr": optimizer.param_groups[0]["lr"],
        "steps": float(int(optimizer.tx_states[0][0].count)),
        "clipped_steps": float(clipped),
        "seconds": time.perf_counter() - start,
        "checkpoint_kib": buffer.getbuffer().nbytes / 1024,
    }
    print(
        f"device={device.type} amp={str(amp_dtype).removeprefix('torch.')} steps={int(summary['steps'])} "
        f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
        f"eval accuracy {accuracy:.1%} final lr {summary['final_lr']:.2e} "
        f"clipped {clipped}/{args.steps} checkpoint {summary['checkpoint_kib']:.0f} KiB in {summary['seconds']:.1f}s"
    )
    return summary


if __name__ == "__main__":
    main()
