"""``fadam.pmap`` across devices and model-parallel params, checked against single-device runs.

Device lists of CPUs stand in for accelerators here (values are exact either way); when CUDA is visible the same
checks also run on CUDA device lists. ``benchmarks/gpu_distributed.py`` runs them on a GPU machine with timings.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.func import vmap

import fadam
from fadam.distributed import Sharded
from tests.conformance.table import VALUE_ROWS

CPU = torch.device("cpu")
PMAP_DEVICES = [[CPU], [CPU] * 2, [CPU] * 3]
SPLIT_DEVICES = [[CPU, CPU]]  # model parallel: the leaves of one model dealt round-robin over these
if torch.cuda.is_available():
    PMAP_DEVICES += [[torch.device("cuda", 0)] * 2, [torch.device("cuda", 0), CPU]]
    SPLIT_DEVICES += [[torch.device("cuda", 0), CPU]]

N_MEMBERS = 5  # 5 over 2 or 3 devices gives uneven shards
CASES = [pytest.param(row.build, id=row.name) for row in VALUE_ROWS] + [
    pytest.param(lambda: fadam.chain(fadam.clip_by_global_norm(0.1), fadam.adamw(1e-2)), id="clip+adamw"),
    pytest.param(
        lambda: fadam.masked(fadam.sgd(1e-2, momentum=0.9), lambda p: {k: v.ndim > 1 for k, v in p.items()}),
        id="masked-sgd",
    ),
]


def _ensemble() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(N_MEMBERS, 8, 3, generator=generator),
        "b": torch.randn(N_MEMBERS, 3, generator=generator),
        "c": torch.randn(N_MEMBERS, 2, generator=generator, dtype=torch.float64),
    }
    grads = [{k: torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in params.items()} for _ in range(3)]
    return params, grads


def _leaves(tree: object) -> list[torch.Tensor]:
    return [leaf for leaf in fadam._tree.tree_leaves(tree) if leaf is not None]


@pytest.mark.parametrize("devices", PMAP_DEVICES, ids=lambda ds: "+".join(str(d) for d in ds))
@pytest.mark.parametrize("make", CASES)
def test_pmap_equals_vmap_on_one_device(make: Callable[[], fadam.GradientTransformation], devices: list) -> None:
    tx = make()
    params, grads = _ensemble()
    init, update, apply = (fadam.pmap(f, devices) for f in (tx.init, tx.update, fadam.apply_updates))

    state, sharded = init(params), params
    ref_state, ref = vmap(tx.init)(params), params
    for g in grads:
        updates, state = update(g, state, sharded)
        sharded = apply(sharded, updates)
        ref_updates, ref_state = vmap(tx.update)(g, ref_state, ref)
        ref = vmap(fadam.apply_updates)(ref, ref_updates)

    for name, leaf in sharded.items():
        assert isinstance(leaf, Sharded) and leaf.devices == tuple(devices)
        assert torch.equal(leaf.gather(CPU), ref[name]), name
    gathered_state = _leaves(fadam.gather(state, CPU))
    assert len(gathered_state) == len(_leaves(ref_state))
    for a, b in zip(gathered_state, _leaves(ref_state)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_sharded_inputs_are_used_where_they_live() -> None:
    x = Sharded([torch.arange(3.0), torch.arange(3.0, 5.0)])
    out = fadam.pmap(lambda t: t, [CPU, CPU])(x)
    assert [s.data_ptr() for s in out.shards] == [s.data_ptr() for s in x.shards]
    # another split (3 devices) gathers and splits again
    out3 = fadam.pmap(lambda t: t * 2, [CPU] * 3)(x)
    assert out3.sizes == (2, 2, 1) and torch.equal(out3.gather(), torch.arange(5.0) * 2)


def test_unsplit_arguments_and_keywords_reach_every_device() -> None:
    def fn(x: torch.Tensor, scale: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return x * scale + shift

    out = fadam.pmap(fn, [CPU] * 2, in_dims=(0, None))(torch.ones(4, 2), torch.tensor(3.0), shift=torch.tensor(1.0))
    assert torch.equal(out.gather(), torch.full((4, 2), 4.0))


def test_out_dims_and_in_dims_other_than_zero() -> None:
    x = torch.arange(12.0).reshape(3, 4)  # map over axis 1: 4 entries
    out = fadam.pmap(lambda col: col.sum(0, keepdim=True), [CPU] * 2, in_dims=1, out_dims=1)(x)
    assert out.dim == 1 and out.sizes == (2, 2)
    assert torch.equal(out.gather(), x.sum(0, keepdim=True))


def test_sharded_shape_and_gather() -> None:
    x = Sharded([torch.zeros(2, 3), torch.ones(1, 3)])
    assert x.shape == (3, 3) and x.dtype == torch.float32 and x.devices == (CPU, CPU)
    assert "shape=(3, 3)" in repr(x)
    gathered = fadam.gather({"x": x, "skip": None}, "cpu")
    assert gathered["skip"] is None and torch.equal(gathered["x"], torch.cat([torch.zeros(2, 3), torch.ones(1, 3)]))
    with pytest.raises(ValueError, match="shard 1"):
        Sharded([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="at least one"):
        Sharded([])


def test_bad_inputs_are_named() -> None:
    cpus = [CPU] * 2
    with pytest.raises(ValueError, match=r"argument 1 leaf at \['b'\] has 3 entries along axis 0 but argument 0"):
        fadam.pmap(lambda a, b: a, cpus)(torch.ones(4), {"b": torch.ones(3)})
    with pytest.raises(ValueError, match="cannot be split across 3 devices"):
        fadam.pmap(lambda a: a, [CPU] * 3)(torch.ones(2))
    with pytest.raises(TypeError, match=r"argument 0 leaf at \['lr'\] is a float"):
        fadam.pmap(lambda a: a, cpus)({"x": torch.ones(2), "lr": 0.1})
    with pytest.raises(ValueError, match="in_dims has 1 entries but the function got 2"):
        fadam.pmap(lambda a, b: a, cpus, in_dims=(0,))(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="no argument has a tensor to split"):
        fadam.pmap(lambda a: a, cpus, in_dims=None)(torch.ones(2))
    with pytest.raises(ValueError, match="no axis 1"):
        fadam.pmap(lambda a: a, cpus, in_dims=1)(torch.ones(2))


def test_default_devices_are_every_visible_cuda_device() -> None:
    if torch.cuda.is_available():
        out = fadam.pmap(lambda t: t)(torch.ones(torch.cuda.device_count()))
        assert out.devices == tuple(torch.device("cuda", i) for i in range(torch.cuda.device_count()))
    else:
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            fadam.pmap(lambda t: t)


# --- model parallel: one model, leaves on several devices ---------------------------------------------------------


def _split_model(devices: list[torch.device]) -> tuple[dict, list[dict]]:
    generator = torch.Generator().manual_seed(3)
    shapes = {"embed": (6, 4), "block.w": (4, 4), "block.b": (4,), "head": (4, 2), "scale": (1,)}
    params = {
        name: torch.randn(shape, generator=generator).to(devices[i % len(devices)])
        for i, (name, shape) in enumerate(shapes.items())
    }
    grads = [{k: torch.randn(v.shape, generator=generator).to(v.device) for k, v in params.items()} for _ in range(3)]
    return params, grads


MODEL_PARALLEL_CASES = [
    *CASES,
    pytest.param(lambda: fadam.chain(fadam.clip_by_global_norm(0.5), fadam.sgd(1e-2, momentum=0.9)), id="clip+sgd"),
]


@pytest.mark.parametrize("devices", SPLIT_DEVICES, ids=lambda ds: "+".join(str(d) for d in ds))
@pytest.mark.parametrize("make", MODEL_PARALLEL_CASES)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "step"])
def test_model_parallel_equals_one_device(
    make: Callable[[], fadam.GradientTransformation], devices: list, fused: bool
) -> None:
    tx = make()
    params, grads = _split_model(devices)
    ref = {k: v.to(CPU) for k, v in params.items()}
    state, ref_state = tx.init(params), tx.init(ref)
    for state_leaf, leaf in zip(_leaves(state), _leaves(tx.init(params))):
        assert state_leaf.device == leaf.device
    for g in grads:
        if fused:
            params, state = fadam.step(tx, params, g, state)
        else:
            updates, state = tx.update(g, state, params)
            params = fadam.apply_updates(params, updates)
        ref_updates, ref_state = tx.update({k: v.to(CPU) for k, v in g.items()}, ref_state, ref)
        ref = fadam.apply_updates(ref, ref_updates)
    for name, p in params.items():
        assert p.device == _split_model(devices)[0][name].device
        # the CUDA kernels may round differently from the CPU ones; on CPU lists the runs are identical
        torch.testing.assert_close(p.to(CPU), ref[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("devices", SPLIT_DEVICES, ids=lambda ds: "+".join(str(d) for d in ds))
def test_global_norm_across_devices(devices: list) -> None:
    params, _ = _split_model(devices)
    expected = torch.cat([p.to(CPU).flatten() for p in params.values()]).norm()
    norm = fadam.tree_global_norm(params)
    assert norm.device == next(iter(params.values())).device
    torch.testing.assert_close(norm.to(CPU), expected, rtol=1e-6, atol=0)
