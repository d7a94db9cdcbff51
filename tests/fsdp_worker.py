"""One rank of the FSDP2 / DTensor / DCP checks in ``tests/test_fsdp.py`` (run with torchrun, gloo on CPU).

For every optimizer in ``CASES`` it trains a small model sharded with ``fully_shard`` for a few steps (each rank sees
the same full batch, so FSDP's gradient averaging is exact and any difference from a single process comes from the
optimizer), checks that the state has the params' placements, and records the full trained params. It also runs each
optimizer alone on DTensor params and fixed DTensor gradients (no FSDP), for an exact comparison. It then saves the
states of ``DCP_CASES`` with ``torch.distributed.checkpoint``, loads them back into 2 ranks sharded along another
dimension, records the full states so that the test can also load the checkpoint into one process, and trains on
from both the saved and the reloaded state on fixed gradients (``continued``). Quantized state is compared through
its dequantized values (``dense``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import optree
import torch

import fadam
from tests.conformance.table import ALL_ROWS

STEPS = 3

# Quantized rows run with blocks that match one process: a shard along dim 0 has the one-process blocks when it starts
# at a multiple of block_size elements. With min_size=100 the quantized leaves are the (80, 64) and (64, 80) weights
# (shards of 2560 = 20 blocks of 128) and the (3, 64) head (rows split 2 + 1: a 128-element block, then the ragged
# 64-element tail, as in one process); biases and the LayerNorm keep float32 state.
ALIGNED_BLOCKS = {"min_size": 100, "block_size": 128}
QUANTIZED_ROWS = {"adam8bit", "adamw8bit", "adam4bit", "adamw4bit", "sgd8bit", "lion8bit", "ademamix8bit"}


def _factory(row: object) -> Callable[[], fadam.GradientTransformation]:
    if row.name in QUANTIZED_ROWS:
        return lambda: row.make(**{**row.kwargs, **ALIGNED_BLOCKS})
    return row.build


# name -> factory; every conformance row is included, so rows added later are checked on FSDP too
CASES: dict[str, Callable[[], fadam.GradientTransformation]] = {
    row.name: _factory(row) for row in ALL_ROWS if row.sharded
} | {
    "clip+adamw": lambda: fadam.chain(fadam.clip_by_global_norm(0.05), fadam.adamw(1e-2)),
    "clip+sgd": lambda: fadam.chain(fadam.clip_by_global_norm(0.05), fadam.sgd(1e-2, momentum=0.9)),
    "masked-adam": lambda: fadam.masked(fadam.adam(1e-2), lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    "partition": lambda: fadam.partition(
        {"adam": fadam.adamw(1e-2), "sgd": fadam.sgd(1e-2, momentum=0.5)},
        lambda p: {k: "adam" if k.startswith("0.") else "sgd" for k in p},
    ),
}
# blocks that straddle shards: every leaf quantized (min_size=0) in blocks of 256, so a bias of 80 is one block in one
# process and two blocks of 40 on 2 ranks; it trains, but only within the quantization error of one process
UNALIGNED_CASES: dict[str, Callable[[], fadam.GradientTransformation]] = {
    "adamw8bit-unaligned": lambda: fadam.adamw8bit(1e-2, weight_decay=0.1, min_size=0),
}
# optimizers with a global norm: their sharded sum of squares rounds differently from one process
# lamb: per-leaf norms for its trust ratio; adafactor: row/column means over a sharded dim add the ranks' partial sums;
# mars: per-leaf norms for its clipping; sam-sgd: normalize's global norm (prodigy adds its sums in float64, whose
# rounding does not reach its float32 updates here)
GLOBAL_NORM_CASES = {"clip+adamw", "clip+sgd", "lamb", "adafactor", "mars-all-leaves", "sam-sgd", "lars-nesterov"}
# optimizers whose state reduces a param over a dim: a statistic that reduced a sharded dim (or a 1-element
# placeholder) is replicated on the params' mesh instead of sharded like the param; SOAP, Shampoo and PSGD Kron keep
# all of a leaf's state replicated (matrices over whole dims, and moments they precondition whole)
REPLICATED_STATE_CASES = {"adafactor", "soap-vectors", "shampoo-adam-grafting", "psgd-kron"}
# optimizers whose state goes through a DCP save and a load into 2 ranks and into 1 process
DCP_CASES = ["adamw", "clip+sgd", "adamw8bit"]


def make_model() -> torch.nn.Module:
    """80x64 = 5120 elements: above the 4096 under which quantized state stays fp32, but each of 2 shards is below it.
    The last layer has 3 rows, split unevenly (2 + 1) over 2 ranks."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 80), torch.nn.GELU(), torch.nn.Linear(80, 64), torch.nn.LayerNorm(64)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 64, generator=generator), torch.randn(16, 3, generator=generator)


def train(model: torch.nn.Module, tx: fadam.GradientTransformation) -> tuple[dict, object]:
    """``STEPS`` steps alternating ``update`` + ``apply_updates`` and ``fadam.step(donate=True)``."""
    x, y = batch()
    params = dict(model.named_parameters())
    state = tx.init(params)
    for step in range(STEPS):
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            grads = {name: p.grad for name, p in params.items()}
            if step % 2:
                new, state = fadam.step(tx, params, grads, state, donate=True)
                for p, value in zip(params.values(), new.values()):
                    # DTensors are written in place (the sharded module trains on); the reference copies
                    assert value is p or not fadam._dispatch.is_dtensor(p), "donated DTensors are updated in place"
                    if value is not p:
                        p.copy_(value)
            else:
                updates, state = tx.update(grads, state, params)
                for p, value in zip(params.values(), fadam.apply_updates(params, updates).values()):
                    p.copy_(value)
        model.zero_grad(set_to_none=True)
    return params, state


def dtensor_grads() -> list[dict[str, torch.Tensor]]:
    """Fixed full gradients for ``STEPS`` steps, shaped like ``make_model``'s params."""
    generator = torch.Generator().manual_seed(2)
    shapes = {name: p.shape for name, p in make_model().named_parameters()}
    return [{k: torch.randn(shape, generator=generator) for k, shape in shapes.items()} for _ in range(STEPS)]


def train_on_grads(params: dict, grads: list[dict], tx: fadam.GradientTransformation) -> dict:
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = fadam.apply_updates(params, updates)
    return params


def _full(tree: object) -> object:
    """Every DTensor leaf as its full tensor (a collective: all ranks call it)."""
    return fadam.tree_map(lambda x: x.full_tensor() if fadam._dispatch.is_dtensor(x) else x, tree)


def dense(state: object) -> object:
    """The state with every quantized leaf dequantized (sharded ones as DTensors), for comparing values."""
    from fadam.quantization._sharded import dequantize_sharded, is_sharded, sharded_bits, sharded_block_size

    def one(leaf: object) -> object:
        if is_sharded(leaf):
            return dequantize_sharded(leaf, sharded_bits(leaf), sharded_block_size(leaf))
        if isinstance(leaf, fadam.QuantizedArray):
            raise AssertionError("dense() is for the worker's sharded states")
        return leaf

    return optree.tree_map(one, state, is_leaf=lambda x: isinstance(x, fadam.QuantizedArray), none_is_leaf=True)


def continue_training(params: dict, state: object, tx: fadam.GradientTransformation, grads: list[dict]) -> dict:
    """``tx`` from ``state`` on fixed gradients (laid out like ``params``): how a loaded state trains on."""
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = fadam.apply_updates(params, updates)
    return params


def _shard_dim1(param: torch.nn.Parameter) -> object:
    from torch.distributed.tensor import Shard

    return Shard(1) if param.ndim == 2 else Shard(0)


def main(out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from fadam.quantization._sharded import is_sharded

    results: dict[str, object] = {"params": {}, "dtensor": {}, "states": {}, "continued": {}}
    for name, make in (CASES | UNALIGNED_CASES).items():
        model = make_model()
        fully_shard(model)
        tx = make()
        params = dict(model.named_parameters())
        initial = tx.init(params)
        if isinstance(initial, fadam.PagedState):  # the storage holds local shards; the layout keeps the placements
            initial = initial.layout
        for leaf in optree.tree_leaves(initial, is_leaf=is_sharded, none_is_leaf=True):
            leaf = leaf.codes if is_sharded(leaf) else leaf  # quantized: the codes are sharded like the param
            if leaf is not None and leaf.dim() > 0:  # moments: DTensors sharded like their params
                assert fadam._dispatch.is_dtensor(leaf), name
                reference = params["0.weight"]
                assert leaf.device_mesh == reference.device_mesh, name
                replicated = name in REPLICATED_STATE_CASES and all(q.is_replicate() for q in leaf.placements)
                assert leaf.placements == reference.placements or replicated, name
        params, state = train(model, tx)
        results["params"][name] = _full(params)
        # the optimizer alone on DTensors (sharded along dim 0, uneven where the size is odd), on fixed gradients
        mesh = params["0.weight"].device_mesh
        shard = [Shard(0)]
        plain = {k: v.detach() for k, v in make_model().named_parameters()}
        distributed = {k: distribute_tensor(v, mesh, shard) for k, v in plain.items()}
        grads = [{k: distribute_tensor(v, mesh, shard) for k, v in g.items()} for g in dtensor_grads()]
        results["dtensor"][name] = _full(train_on_grads(distributed, grads, tx))
        if name in DCP_CASES:
            dcp.save({"optim": fadam.state_to_dict(state)}, checkpoint_id=out / f"ckpt-{name}")
            full_state = _full(dense(state))
            results["states"][name] = fadam.state_to_dict(full_state)
            # load into 2 ranks whose matrices are sharded along dim 1 instead of dim 0 (resharding)
            other = make_model()
            fully_shard(other, shard_placement_fn=_shard_dim1)
            like = tx.init(dict(other.named_parameters()))
            target = {"optim": fadam.state_to_dict(like)}
            dcp.load(target, checkpoint_id=out / f"ckpt-{name}")
            loaded = fadam.state_from_dict(like, target["optim"])
            for leaf in fadam._tree.tree_leaves(loaded):
                if fadam._dispatch.is_dtensor(leaf) and leaf.ndim == 2:
                    assert leaf.placements[0].dim == 1, f"{name}: loaded state keeps the template's sharding"
            leaves = fadam._tree.tree_leaves
            quantized = [is_sharded(x) for x in optree.tree_leaves(state, is_leaf=is_sharded, none_is_leaf=True)]
            for path, a, b, requantized in zip(
                fadam.tree_paths(full_state), leaves(_full(dense(loaded))), leaves(full_state), quantized, strict=True
            ):
                if requantized:  # in the blocks of the dim-1 shards: one more 8-bit rounding of each value
                    # measured at most 0.6 % of the leaf's largest value (2.5 % of the value's own block's)
                    torch.testing.assert_close(a, b, rtol=0, atol=0.05 * float(b.abs().max()), msg=f"{name} {path}")
                else:
                    assert (a is None and b is None) or torch.equal(a, b), f"{name} {path} differs after a reload"
            # both states train on identically: the original (dim-0 shards) and the reloaded one (dim-1 shards)
            trained = _full(params)
            later = dtensor_grads()
            for key, state_, module in (("saved", state, model), ("reloaded", loaded, other)):
                placed = {k: p.placements for k, p in module.named_parameters()}
                start = {k: distribute_tensor(v.detach(), mesh, placed[k]) for k, v in trained.items()}
                grads_ = [{k: distribute_tensor(v, mesh, placed[k]) for k, v in g.items()} for g in later]
                results["continued"][(name, key)] = _full(continue_training(start, state_, tx, grads_))
    mesh = params["0.weight"].device_mesh
    sharded_grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in dtensor_grads()[0].items()}
    all_reduce, reductions = funcol.all_reduce, []

    def counted(*args: object, **kwargs: object) -> object:
        reductions.append(1)
        return all_reduce(*args, **kwargs)

    funcol.all_reduce = counted
    try:
        results["global_norm"] = fadam.tree_global_norm(sharded_grads)  # a collective, on every rank
    finally:
        funcol.all_reduce = all_reduce
    results["global_norm_reductions"] = (len(sharded_grads), len(reductions))
    if rank == 0:
        torch.save(results, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {len(CASES) + len(UNALIGNED_CASES)} optimizers trained, {len(DCP_CASES)} checkpoints reloaded")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
