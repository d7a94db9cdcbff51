"""Quantized state of DTensor params, on a one-rank gloo group in this process (two ranks: tests/test_fsdp.py)."""

from pathlib import Path

import pytest
import torch

import fadam
from fadam.quantization import QuantizedArray, dequantize_blockwise, quantize_blockwise
from fadam.quantization._codec import unpack_codes
from fadam.quantization._sharded import (
    dequantize_sharded,
    is_sharded,
    quantize_sharded,
    sharded_bits,
    sharded_block_size,
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> object:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _shard(x: torch.Tensor, mesh: object) -> object:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(x, mesh, [Shard(0)])


def _params(mesh: object) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": _shard(torch.randn(40, 64, generator=g), mesh), "b": _shard(torch.randn(8, generator=g), mesh)}


def _grads(mesh: object, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": _shard(torch.randn(40, 64, generator=g), mesh), "b": _shard(torch.randn(8, generator=g), mesh)}


def test_a_shard_is_quantized_like_a_plain_tensor_with_codes_sharded_like_it(mesh: object) -> None:
    x = _shard(torch.randn(10, 30, generator=torch.Generator().manual_seed(1)), mesh)
    q = quantize_sharded(x, 8, 64)
    plain = quantize_blockwise(x.to_local(), 8, 64)
    assert is_sharded(q) and (q.codes.shape, q.codes.placements, q.codes.dtype) == (x.shape, x.placements, torch.uint8)
    assert torch.equal(q.codes.to_local().reshape(-1), plain.codes) and torch.equal(q.absmax, plain.absmax)
    assert q.absmax.shape == (5,) and int(q.map_id) == int(plain.map_id)  # 300 elements: 4 blocks of 64 and a tail
    values = dequantize_sharded(q, 8, 64)
    assert values.placements == x.placements and values.dtype == torch.float32
    torch.testing.assert_close(values.full_tensor(), x.full_tensor(), rtol=0.02, atol=0.02 * float(x.abs().max()))


@pytest.mark.parametrize(("n", "block"), [(300, 64), (256, 256), (257, 256), (2560, 128), (5, 256), (1, 2)])
def test_block_size_is_recovered_from_a_shard(mesh: object, n: int, block: int) -> None:
    q = quantize_sharded(_shard(torch.randn(n), mesh), 8, block)
    recovered = sharded_block_size(q)
    # a single block: any size covering the shard splits it the same way
    assert recovered == block or (q.absmax.numel() == 1 and recovered >= n)
    assert torch.equal(dequantize_sharded(q, 8, recovered).to_local(), dequantize_sharded(q, 8, block).to_local())


def _train_both(tx, reference, mesh, params, state, plain, plain_state):
    """Three steps on the same gradients: ``fadam.step(tx)`` on the DTensors (donating every other step) and
    ``reference.update`` + ``apply_updates`` on the plain tensors."""
    for seed in range(3):
        grads = _grads(mesh, seed)
        params, state = fadam.step(tx, params, grads, state, donate=seed % 2 == 1)
        updates, plain_state = reference.update({k: v.full_tensor() for k, v in grads.items()}, plain_state, plain)
        plain = fadam.apply_updates(plain, updates)
    return params, state, plain, plain_state


def test_adamw8bit_on_one_rank_dtensors_equals_plain_tensors(mesh: object) -> None:
    """One rank holds the one-process blocks, so the math is the same bit for bit: DTensors run the eager chain, plain
    tensors the generated kernel, which equals it."""
    tx = fadam.adamw8bit(1e-2, min_size=100, block_size=128)
    chain = fadam.adamw8bit(1e-2, min_size=100, block_size=128)
    params = _params(mesh)
    plain = {k: v.full_tensor() for k, v in params.items()}
    state, plain_state = tx.init(params), tx.init(plain)
    assert is_sharded(state[0].inner_state.mu["w"]) and type(state[0].inner_state.mu["b"]).__name__ == "DTensor"
    params, state, plain, plain_state = _train_both(tx, chain, mesh, params, state, plain, plain_state)
    for key in plain:
        assert torch.equal(params[key].full_tensor(), plain[key]), key
    assert torch.equal(
        state[0].inner_state.nu["w"].codes.to_local().reshape(-1), plain_state[0].inner_state.nu["w"].codes
    )


def test_odd_block_sizes_are_refused_on_dtensors(mesh: object) -> None:
    params = _params(mesh)
    with pytest.raises(ValueError, match=r"block_size must be a power of two on DTensor params .*, got 96"):
        fadam.adamw8bit(min_size=100, block_size=96).init(params)


def test_four_bit_shards_keep_one_code_per_byte_and_decode_like_packed_codes(mesh: object) -> None:
    x = _shard(torch.randn(7, 9, generator=torch.Generator().manual_seed(3)), mesh)  # 63 elements: an odd count
    q = quantize_sharded(x, 4, 16)
    plain = quantize_blockwise(x.to_local(), 4, 16)
    assert (q.codes.shape, q.codes.placements, q.codes.dtype) == (x.shape, x.placements, torch.uint8)
    assert int(q.codes.to_local().max()) <= 15 and plain.codes.numel() == 32  # unpacked: 63 bytes instead of 32
    assert sharded_bits(q) == 4 and sharded_bits(quantize_sharded(x, 8, 16)) == 8
    assert sharded_bits(quantize_sharded(x.abs(), 4, 16)) == 4  # the non-negative 4-bit map too
    assert torch.equal(dequantize_sharded(q, 4, 16).to_local(), dequantize_blockwise(plain, x.shape, 4, 16))


def test_adamw4bit_on_one_rank_dtensors_equals_plain_tensors_and_reloads(mesh: object) -> None:
    tx = fadam.adamw4bit(1e-2, amsgrad=True, min_size=100, block_size=128)
    params = _params(mesh)
    plain = {k: v.full_tensor() for k, v in params.items()}
    state, plain_state = tx.init(params), tx.init(plain)
    params, state, plain, plain_state = _train_both(tx, tx, mesh, params, state, plain, plain_state)
    for key in plain:
        assert torch.equal(params[key].full_tensor(), plain[key]), key
    for field in ("mu", "nu", "nu_max"):
        sharded, packed = (getattr(s[0].inner_state, field)["w"] for s in (state, plain_state))
        assert torch.equal(sharded.codes.to_local().reshape(-1), unpack_codes(packed.codes, 4).to(torch.uint8)), field
    restored = fadam.state_from_dict(tx.init(params), fadam.state_to_dict(state))
    for old, new in zip(state[0].inner_state.nu.values(), restored[0].inner_state.nu.values()):
        old, new = (x.codes if isinstance(x, QuantizedArray) else x for x in (old, new))
        assert torch.equal(new.to_local(), old.to_local())


def test_an_update_laid_out_unlike_the_state_is_refused(mesh: object) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    tx = fadam.adamw8bit(min_size=100, block_size=128)
    params = _params(mesh)
    state = tx.init(params)
    plain = {k: v.full_tensor() for k, v in _grads(mesh, 0).items()}
    with pytest.raises(
        ValueError, match=r"state at \[1\]\['w'\] is sharded as DTensor \(40, 64\).*update is a plain tensor"
    ):
        tx.update(plain, state, params)
    replicated = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in plain.items()}
    with pytest.raises(ValueError, match=r"update is a DTensor \(40, 64\) \(Replicate\(\),\)"):
        tx.update(replicated, state, params)
    with pytest.raises(
        ValueError, match=r"state at \[1\]\['w'\] was made for a plain param, but its update is a DTensor"
    ):
        tx.update(_grads(mesh, 0), tx.init(plain), plain)


def test_checkpoint_dict_holds_float32_values_and_reloads_the_same_codes(mesh: object) -> None:
    tx = fadam.adamw8bit(1e-2, min_size=100, block_size=128)
    params = _params(mesh)
    state = tx.init(params)
    for seed in range(2):
        params, state = fadam.step(tx, params, _grads(mesh, seed), state)
    d = fadam.state_to_dict(state)
    values = d["0"]["inner_state"]["mu"]["w"]
    assert list(values) == ["values"] and values["values"].dtype == torch.float32
    assert values["values"].placements == params["w"].placements
    like = tx.init(params)
    restored = fadam.state_from_dict(like, d)
    for field in ("mu", "nu"):
        old, new = state[0].inner_state._asdict()[field]["w"], restored[0].inner_state._asdict()[field]["w"]
        assert isinstance(new, QuantizedArray) and is_sharded(new)
        # the same blocks: requantizing the dequantized values gives back the same codes and scales
        assert torch.equal(new.codes.to_local(), old.codes.to_local()) and torch.equal(new.absmax, old.absmax), field
    # a full plain tensor (e.g. from torch.save of the gathered values) is sharded like the template
    d["0"]["inner_state"]["mu"]["w"]["values"] = values["values"].full_tensor()
    again = fadam.state_from_dict(like, d)[0].inner_state.mu["w"]
    assert torch.equal(again.codes.to_local(), state[0].inner_state.mu["w"].codes.to_local())
    d["0"]["inner_state"]["mu"]["w"]["values"] = torch.zeros(40, 32)
    with pytest.raises(ValueError, match=r"\['mu'\]\['w'\]\['values'\]: expected float32 values of shape \(40, 64\)"):
        fadam.state_from_dict(like, d)


def test_dcp_round_trip_on_one_rank(mesh: object, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    tx = fadam.adamw8bit(1e-2, min_size=100, block_size=128)
    params = _params(mesh)
    state = tx.init(params)
    params, state = fadam.step(tx, params, _grads(mesh, 0), state)
    dcp.save({"optim": fadam.state_to_dict(state)}, checkpoint_id=tmp_path / "ckpt")
    like = tx.init(_params(mesh))
    target = {"optim": fadam.state_to_dict(like)}
    dcp.load(target, checkpoint_id=tmp_path / "ckpt")
    loaded = fadam.state_from_dict(like, target["optim"])
    new, _ = fadam.step(tx, params, _grads(mesh, 1), loaded)
    expected, _ = fadam.step(tx, params, _grads(mesh, 1), state)
    for key in expected:
        assert torch.equal(new[key].full_tensor(), expected[key].full_tensor()), key
