"""Train a small transformer language model with FSDP2 (``fully_shard``) and fadam's 8-bit AdamW.

Every parameter is sharded across the ranks as a DTensor, and so is the optimizer state: ``tx.init`` builds the state
with the params' placements, and ``fadam.adamw8bit`` stores the moments of every param of at least ``--min-8bit-size``
elements as 8-bit codes sharded like the param, with one float32 scale per block of 256 elements of each rank's shard
(smaller params keep float32 moments). The AdamW math runs on each rank's shards without communication, and the
global gradient norm of ``clip_by_global_norm`` is reduced across ranks. ``fadam.step(..., donate=True)`` writes the
new values into the sharded params in place. The data is synthetic (token t+1 = (5 * token t + 3) mod vocab from a
random start, a rule the model learns in a few dozen steps); each rank draws its own batches, and FSDP averages the
gradients.

Run with fadam installed (``pip install -e .``), or from the repository root with ``PYTHONPATH=.`` in front:

    # 2 CPU processes (gloo)
    torchrun --standalone --nproc-per-node 2 examples/fsdp_transformer.py --device cpu

    # N GPUs of one machine (nccl), a bigger model
    torchrun --standalone --nproc-per-node N examples/fsdp_transformer.py --dim 512 --layers 8 --steps 500

``--checkpoint DIR`` saves the model and optimizer state with ``torch.distributed.checkpoint`` at the end, and resumes
from DIR when it already holds one (with any number of ranks: DCP reshards on load). The optimizer state goes through
``fadam.state_to_dict``/``fadam.state_from_dict``, since DCP does not look inside tuples (see ``fadam.distributed``);
8-bit moments are saved dequantized (float32, sharded like the params) and requantized in the new ranks' blocks.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fadam


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(args: argparse.Namespace, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    tokens = [torch.randint(args.vocab, (args.batch,), generator=generator)]
    for _ in range(args.seq):
        tokens.append((5 * tokens[-1] + 3) % args.vocab)
    return torch.stack(tokens, dim=1).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when available")
    parser.add_argument("--min-8bit-size", type=int, default=4096, help="smaller params keep float32 moments")
    parser.add_argument("--checkpoint", type=Path, default=None, help="resume from / save to this DCP directory")
    args = parser.parse_args()

    # The LM head's output is a view (nn.Linear on a 3-d input); this loop never writes into it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    model = TransformerLM(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())

    tx = fadam.chain(
        fadam.clip_by_global_norm(1.0), fadam.adamw8bit(lr=args.lr, weight_decay=0.01, min_size=args.min_8bit_size)
    )
    state = tx.init(params)  # codes and float32 moments sharded like the params; scales and step counts are local

    if args.checkpoint is not None and (args.checkpoint / ".metadata").exists():
        target = {"model": model.state_dict(), "optim": fadam.state_to_dict(state)}
        dcp.load(target, checkpoint_id=args.checkpoint)
        model.load_state_dict(target["model"])
        state = fadam.state_from_dict(state, target["optim"])
        if rank == 0:
            print(f"resumed from {args.checkpoint}")

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    started, loss_sum, first_loss = time.perf_counter(), torch.zeros((), device=device), None
    for step in range(1, args.steps + 1):
        tokens = batch(args, generator, device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        with torch.no_grad():
            grads = {name: p.grad for name, p in params.items()}
            params, state = fadam.step(tx, params, grads, state, donate=True)
        model.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss_sum)  # the mean over ranks of the losses since the last line
            mean = loss_sum.item() / (world * (args.log_every if step % args.log_every == 0 else step % args.log_every))
            loss_sum.zero_()
            first_loss = mean if first_loss is None else first_loss
            if rank == 0:
                print(f"step {step:5d}  loss {mean:.4f}  ({time.perf_counter() - started:.1f} s)", flush=True)

    if args.checkpoint is not None:
        dcp.save({"model": model.state_dict(), "optim": fadam.state_to_dict(state)}, checkpoint_id=args.checkpoint)
    if rank == 0:
        print(f"uniform guess {math.log(args.vocab):.4f}; first logged loss {first_loss:.4f}; final loss {mean:.4f}")
        quantized = sum(p.numel() >= args.min_8bit_size for p in params.values())
        print(f"{world} ranks, {sum(p.numel() for p in params.values())} parameters, state sharded like the params")
        print(f"8-bit moments for {quantized} of {len(params)} parameter tensors")
    dist.barrier()  # gloo can abort a rank whose peer tore the group down first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
