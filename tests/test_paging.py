"""page_state: bit-identical to the unpaged chain, bounded residency, purity, checks."""

from __future__ import annotations

import collections
import gc
import os
import weakref
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import fadam
from fadam.paging import _storage, _wrapper


def _params() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 32, generator=gen),
        "blocks": [
            {"w": torch.randn(32, 32, generator=gen), "b": torch.randn(32, generator=gen)},
            {"w": torch.randn(32, 32, generator=gen), "b": torch.randn(32, generator=gen)},
        ],
        "z": torch.randn(5, dtype=torch.complex64, generator=gen),
        "scale": torch.randn(3, generator=gen).to(torch.bfloat16),
    }


def _grads(params: dict, step: int, drop: str | None = None) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    grads = fadam.tree_map(lambda p: torch.randn(p.shape, dtype=p.dtype, generator=gen), params)
    if drop is not None:
        grads[drop] = None
    return grads


INNERS = {
    "adam": (lambda: fadam.adam(lr=1e-2), True),
    "adamw-amsgrad": (lambda: fadam.adamw(lr=1e-2, amsgrad=True, weight_decay=0.1), True),
    "sgd-nesterov": (lambda: fadam.sgd(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3), True),
    "adam-nesterov-schedule": (
        lambda: fadam.chain(fadam.scale_by_adam(nesterov=True), fadam.scale_by_learning_rate(lambda t: 1e-2 / (t + 1))),
        True,
    ),
    "masked-callable-bf16-moments": (
        lambda: fadam.masked(
            fadam.chain(fadam.scale_by_adam(mu_dtype=torch.bfloat16), fadam.scale(-1e-2)),
            lambda params: fadam.tree_map(lambda p: p.ndim > 1, params),
        ),
        True,
    ),
    "codes-and-absmax": (lambda: _toy_quantized(), True),
    # couples leaves, or needs the params' tree structure: one chunk with the params as they are
    "clip-global-adam": (lambda: fadam.chain(fadam.clip_by_global_norm(0.5), fadam.adam(lr=1e-2)), False),
    "masked-prefix-adam": (
        lambda: fadam.masked(fadam.adam(lr=1e-2), {"embed": False, "blocks": True, "z": True, "scale": False}),
        False,
    ),
}


class _ToyQuantizedState(NamedTuple):
    count: torch.Tensor  # int32
    codes: list  # uint8, one per element
    absmax: list  # fp32, one per block of 64
    seen: list  # bool


def _toy_quantized() -> fadam.GradientTransformation:
    """State shaped like 8-bit optimizers' (uint8 codes, fp32 block absmax, int32 count, a bool mask): whatever the
    dtypes, paging must carry them bit for bit."""

    def real(x):
        return torch.view_as_real(x).reshape(-1) if x.is_complex() else x.reshape(-1)

    def init(params):
        flat = [real(p) for p in fadam._tree.tree_leaves(params)]
        return _ToyQuantizedState(
            torch.zeros([], dtype=torch.int32),
            [torch.zeros(p.numel(), dtype=torch.uint8) for p in flat],
            [torch.zeros(-(-p.numel() // 64)) for p in flat],
            [torch.zeros(p.numel(), dtype=torch.bool) for p in flat],
        )

    def update(updates, state, params=None, **_):
        leaves, spec = fadam._tree.tree_flatten(updates)
        out, codes, absmax, seen = [], [], [], []
        for g, c, a, s in zip(leaves, state.codes, state.absmax, state.seen):
            if g is None:
                out.append(None), codes.append(c), absmax.append(a), seen.append(s)
                continue
            gr = real(g).float()
            padded = torch.nn.functional.pad(gr.abs(), (0, a.numel() * 64 - gr.numel()))
            a_new = torch.maximum(a * 0.9, padded.reshape(-1, 64).amax(1))
            scale = a_new.repeat_interleave(64)[: gr.numel()]
            c_new = (c.float() * 0.5 + 63.75 * (gr / scale.clamp_min(1e-12) + 1)).round().to(torch.uint8)
            s_new = s | (gr > 0)
            u = (c_new.float() - 127.5) / 127.5 * scale * s_new.float() - state.count.float() * 1e-3
            u = torch.view_as_complex(u.reshape(*g.shape, 2)) if g.is_complex() else u.reshape(g.shape)
            out.append(u.to(g.dtype)), codes.append(c_new), absmax.append(a_new), seen.append(s_new)
        return spec.unflatten(out), _ToyQuantizedState(state.count + 1, codes, absmax, seen)

    return fadam.GradientTransformation(init, update)


def _paged(make, per_leaf: bool, storage: str, tmp_path, chunk_bytes: int = 6_000, resume: bool = False):
    path = tmp_path / "state.bin" if storage == "disk" else None
    return fadam.page_state(make(), storage, path, chunk_bytes, per_leaf=per_leaf, resume=resume)


@pytest.mark.parametrize("storage", ["host", "disk"])
@pytest.mark.parametrize("name", list(INNERS))
def test_update_is_bit_identical_to_unpaged(name, storage, tmp_path):
    make, per_leaf = INNERS[name]
    reference, paged = make(), _paged(make, per_leaf, storage, tmp_path)
    params = _params()
    ref_params, paged_params = params, params
    ref_state, paged_state = reference.init(params), paged.init(params)
    if per_leaf:
        assert len(paged_state.chunks) > 1
    for step in range(4):
        if storage == "disk" and step == 2:  # the file's checksums agree with what the updates wrote
            paged = _paged(make, per_leaf, storage, tmp_path, resume=True)
            paged_state = paged.init(params)
        grads = _grads(params, step, drop="embed" if step == 2 else None)
        ref_updates, ref_state = reference.update(grads, ref_state, ref_params)
        updates, paged_state = paged.update(grads, paged_state, paged_params)
        for u, v in zip(fadam._tree.tree_leaves(updates), fadam._tree.tree_leaves(ref_updates)):
            assert (u is None and v is None) or torch.equal(u, v)
        ref_params = fadam.apply_updates(ref_params, ref_updates)
        paged_params = fadam.apply_updates(paged_params, updates)


@pytest.mark.parametrize("storage", ["host", "disk"])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", ["adam", "adamw-amsgrad", "sgd-nesterov"])
def test_step_is_bit_identical_and_honours_donation(name, donate, storage, tmp_path):
    make, _ = INNERS[name]
    reference, paged = make(), _paged(make, True, storage, tmp_path)
    params = _params()
    ref_params = fadam.tree_map(torch.clone, params)
    paged_params = fadam.tree_map(torch.clone, params)
    ref_state, paged_state = reference.init(params), paged.init(params)
    for step in range(3):
        if storage == "disk" and step == 2:  # the file's checksums agree with what the fused steps wrote
            paged = _paged(make, True, storage, tmp_path, resume=True)
            paged_state = paged.init(params)
        grads = _grads(params, step, drop="z" if step == 1 else None)
        before = fadam.tree_map(torch.clone, paged_params)
        # a disk-paged step writes its new state into the file's other slot, which torch's fused kernels (in place)
        # cannot: it takes the generated kernel, whose numbers are the eager path's
        with fadam.backend("kernel" if storage == "disk" else "auto"):
            ref_params, ref_state = fadam.step(reference, ref_params, grads, ref_state, donate=donate)
        new_params, paged_state = fadam.step(paged, paged_params, grads, paged_state, donate=donate)
        if not donate:  # the params passed in are untouched
            for a, b in zip(fadam._tree.tree_leaves(paged_params), fadam._tree.tree_leaves(before)):
                assert torch.equal(a, b)
        paged_params = new_params
        for a, b in zip(fadam._tree.tree_leaves(paged_params), fadam._tree.tree_leaves(ref_params)):
            assert torch.equal(a, b)


def test_paged_aliases_match_torch_optim():
    params = _params()
    del params["z"]  # torch.optim and fadam agree on complex; keep this one quick
    flat = [p.float().clone().requires_grad_() for p in fadam._tree.tree_leaves(params)]
    for alias, cls, kwargs in [
        (fadam.paged_adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
        (fadam.paged_adamw, torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    ]:
        tx = alias(**kwargs, chunk_bytes=10_000)
        torch_params = [p.detach().clone().requires_grad_() for p in flat]
        opt = cls(torch_params, **kwargs, foreach=False)
        ours = [p.detach().clone() for p in flat]
        state = tx.init(ours)
        for step in range(3):
            grads = [g.float() for g in fadam._tree.tree_leaves(_grads(params, step))]
            for p, g in zip(torch_params, grads):
                p.grad = g.clone()
            opt.step()
            ours, state = fadam.step(tx, ours, grads, state)
        for a, b in zip(ours, torch_params):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("storage", ["host", "disk"])
@pytest.mark.parametrize("name", ["ademamix", "ademamix8bit"])
def test_paged_ademamix_steps_as_its_unpaged_update(name, storage, tmp_path):
    """bitsandbytes' PagedAdEMAMix and PagedAdEMAMix8bit: the unpaged alias's numbers, chunk by chunk."""
    make, paged = getattr(fadam, name), getattr(fadam, f"paged_{name}")
    kwargs = {"min_size": 0} if name.endswith("8bit") else {}
    params = {k: v for k, v in _params().items() if k != "z"}  # real params: 8-bit state takes no complex ones
    path = tmp_path / "s" if storage == "disk" else None
    tx, reference = paged(1e-2, **kwargs, storage=storage, path=path, chunk_bytes=4096), make(1e-2, **kwargs)
    ours, state = params, tx.init(params)
    expected, ref_state = params, reference.init(params)
    for step in range(3):
        grads = _grads(params, step)
        ours, state = fadam.step(tx, ours, grads, state)
        with fadam.backend("kernel"):  # the unpaged step's backend, which paging keeps (generated: as on disk)
            expected, ref_state = fadam.step(reference, expected, grads, ref_state)
    assert len(state.chunks) > 1
    for a, b in zip(fadam._tree.tree_leaves(ours), fadam._tree.tree_leaves(expected)):
        assert torch.equal(a, b)


def test_at_most_two_chunks_are_materialized_at_once(monkeypatch, tmp_path):
    alive: dict[int, int] = {}
    peak = [0]
    original = _wrapper._materialize

    def tracking(buffer, chunk, device, streams, views_of=None):
        # fresh views, not host storage's cached ones (which cost no memory): what is tracked is the pipeline's hold
        tree = original(buffer, chunk, device, streams)
        key = id(chunk)
        tensors = [x for x in fadam._tree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
        alive[key] = alive.get(key, 0) + len(tensors)
        for t in tensors:
            weakref.finalize(t, lambda key=key: alive.__setitem__(key, alive[key] - 1))
        peak[0] = max(peak[0], sum(1 for n in alive.values() if n > 0))
        return tree

    monkeypatch.setattr(_wrapper, "_materialize", tracking)
    # a file mapped a window at a time (too large to keep mapped); one mapped whole has its chunks as views of the map
    monkeypatch.setattr(_storage, "_available_memory", lambda: 0)
    params = [torch.randn(1000) for _ in range(12)]
    for storage in ("host", "disk"):
        tx = fadam.page_state(
            fadam.adam(lr=1e-2), storage, tmp_path / "s" if storage == "disk" else None, 17_000, per_leaf=True
        )
        state = tx.init(params)
        assert len(state.chunks) == 6  # two params (16 KB of Adam state) per chunk
        for _ in range(2):
            _, state = tx.update([torch.ones(1000)] * 12, state, params)
            params, state = fadam.step(tx, params, [torch.ones(1000)] * 12, state, donate=True)
        assert 1 <= peak[0] <= 2, peak[0]
        peak[0] = 0


def test_host_views_are_made_once_per_buffer_and_go_with_their_state(monkeypatch):
    made: list[weakref.ref] = []
    original = _wrapper._views

    def counting(buffer, chunk):
        views = original(buffer, chunk)
        made.extend(weakref.ref(view) for _, view in views)
        return views

    monkeypatch.setattr(_wrapper, "_views", counting)
    params = [torch.randn(1000) for _ in range(4)]
    grads = [torch.ones(1000)] * 4
    reference = fadam.adamw8bit(1e-2, min_size=0)
    tx = fadam.page_state(reference, "host", chunk_bytes=5_000)
    state, expected_state = tx.init(params), reference.init(params)
    expected = params
    for step in range(4):  # updates alternate between the two buffers of each chunk; donated steps keep one
        _, state = tx.update(grads, state, params)
        _, expected_state = reference.update(grads, expected_state, params)
        params, state = fadam.step(tx, params, grads, state, donate=True)
        expected, expected_state = fadam.step(reference, expected, grads, expected_state, donate=True)
        if step == 1:
            count = len(made)
    assert count > 0 and len(made) == count  # no views made after the first two steps
    assert all(torch.equal(a, b) for a, b in zip(params, expected))
    del state
    gc.collect()
    assert all(view() is None for view in made)  # the transform keeps no view of a dropped state's buffers


def test_grads_of_another_kind_of_mapping_pair_with_their_params():
    # optree orders a dict's keys, an OrderedDict keeps its own order: the leaves are matched by key
    params = collections.OrderedDict([("b", torch.randn(3)), ("a", torch.randn(2))])
    grads = {"a": torch.randn(2), "b": torch.randn(3)}
    reference = fadam.adam(0.1)
    tx = fadam.page_state(reference, per_leaf=True)
    updates, _ = tx.update(grads, tx.init(params), params)
    expected, _ = reference.update(grads, reference.init(params), params)
    assert type(updates) is collections.OrderedDict and list(updates) == ["b", "a"]
    assert all(torch.equal(updates[k], expected[k]) for k in params)
    stepped, _ = fadam.step(tx, params, grads, tx.init(params))
    unpaged, _ = fadam.step(reference, params, grads, reference.init(params))  # the same backend as the paged step
    assert all(torch.equal(stepped[k], unpaged[k]) for k in params)


def test_chunks_hold_about_chunk_bytes_and_never_split_a_leaf():
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(5000), torch.zeros(100)]
    state = fadam.page_state(fadam.adam(), chunk_bytes=2000, per_leaf=True).init(params)
    assert [c.tolist() for c in state.chunks] == [[0, 1], [2], [3]]
    whole = fadam.page_state(fadam.adam(), chunk_bytes=2000, per_leaf=False).init(params)
    assert [c.tolist() for c in whole.chunks] == [[0, 1, 2, 3]]


def test_cpu_params_in_host_storage_are_one_chunk_unless_chunk_bytes_is_given(monkeypatch, tmp_path):
    monkeypatch.setattr(fadam.paging._wrapper, "DEFAULT_CHUNK_BYTES", 2000)
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(5000), torch.zeros(100)]
    chunks = lambda tx: [c.tolist() for c in tx.init(params).chunks]  # noqa: E731
    assert chunks(fadam.page_state(fadam.adam())) == [[0, 1, 2, 3]]
    assert chunks(fadam.paged_adamw(1e-3)) == [[0, 1, 2, 3]]
    assert chunks(fadam.page_state(fadam.adam(), chunk_bytes=2000)) == [[0, 1], [2], [3]]
    disk = fadam.page_state(fadam.adam(), "disk", tmp_path / "state")
    assert chunks(disk) == [[0, 1], [2], [3]]  # a file is mapped a chunk at a time when it is large


@pytest.mark.parametrize(
    ("make", "chunks"),
    [
        (lambda: fadam.adamw(1e-2), [[0, 1], [2], [3]]),
        (lambda: fadam.lion8bit(1e-3, min_size=0), [[0, 1], [2], [3]]),
        (lambda: fadam.lamb(1e-2), [[0, 1], [2], [3]]),  # its trust ratio reduces over a leaf only
        (lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-2)), [[0, 1, 2, 3]]),
        (lambda: fadam.masked(fadam.adam(1e-2), lambda p: [True] * len(p)), [[0, 1, 2, 3]]),
        (lambda: fadam.inject_hyperparams(fadam.adam)(lr=1e-2), [[0, 1, 2, 3]]),
        (lambda: fadam.adafactor(), [[0, 1], [2], [3]]),  # its statistics reduce over a leaf only
        (lambda: fadam.adafactor_torch(), [[0, 1], [2], [3]]),  # and so do its relative step's norms
        (lambda: fadam.sm3(1e-2), [[0, 1, 2, 3]]),  # not declared
    ],
)
def test_by_default_chunks_hold_leaves_where_the_declaration_shows_no_coupling(make, chunks):
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(5000), torch.zeros(100)]
    assert [c.tolist() for c in fadam.page_state(make(), chunk_bytes=2000).init(params).chunks] == chunks


def _reads(state) -> list[torch.Tensor]:
    """The buffers a host-paged state reads (the slot holding its commit)."""
    slot = int((state.slot_serials == state.serial).nonzero())
    return [pair[slot] for pair in state.buffers]


def test_update_is_pure_retried_from_the_previous_state_and_refuses_stale_ones():
    tx = fadam.paged_adam(lr=0.1, chunk_bytes=4096)
    params = [torch.randn(300), torch.randn(300)]
    s0 = tx.init(params)
    _, s1 = tx.update([torch.ones(300), torch.ones(300)], s0, params)
    read, snapshot = _reads(s1), [b.clone() for b in _reads(s1)]
    u2, s2 = tx.update([torch.ones(300), -torch.ones(300)], s1, params)
    assert all(torch.equal(b, c) for b, c in zip(read, snapshot))  # the input state is not written
    u2b, s2b = tx.update([torch.ones(300), -torch.ones(300)], s1, params)  # a retried (skipped) step
    assert all(torch.equal(a, b) for a, b in zip(u2, u2b))
    for stale in (s0, s2):  # s0's buffers hold s2 then s2b; s2's were overwritten by the retry
        with pytest.raises(ValueError, match="stale paged state"):
            tx.update([torch.ones(300), torch.ones(300)], stale, params)
    tx.update([torch.ones(300), torch.ones(300)], s2b, params)


def test_host_state_round_trips_through_torch_save(tmp_path):
    tx = fadam.paged_adamw(lr=0.1, chunk_bytes=4096)
    params = [torch.randn(300), torch.randn(7)]
    _, state = tx.update([torch.ones(300), torch.ones(7)], tx.init(params), params)
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=False)
    a, _ = tx.update([torch.ones(300), -torch.ones(7)], state, params)
    b, _ = tx.update([torch.ones(300), -torch.ones(7)], loaded, params)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_bad_inputs_are_named_before_anything_changes(tmp_path):
    tx = fadam.page_state(fadam.adam(), "disk", tmp_path / "s", per_leaf=True)
    params = {"w": torch.zeros(4), "b": torch.zeros(2)}
    state = tx.init(params)
    with pytest.raises(ValueError, match="3 leaves but the paged state was built for 2"):
        tx.update({"w": torch.zeros(4), "b": torch.zeros(2), "c": torch.zeros(1)}, state)
    with pytest.raises(ValueError, match=r"\['w'\].*shape \(5,\)"):
        tx.update({"w": torch.zeros(5), "b": torch.zeros(2)}, state, params)
    with pytest.raises(ValueError, match="expected a PagedState"):
        tx.update(params, fadam.adam().init(params))
    _, state = tx.update(params, state, params)  # the state is still usable
    with pytest.raises(ValueError, match="storage must be"):
        fadam.page_state(fadam.adam(), "gpu")
    with pytest.raises(ValueError, match="storage='disk' only"):
        fadam.page_state(fadam.adam(), "host", path=tmp_path / "x")
    with pytest.raises(ValueError, match="chunk_bytes"):
        fadam.page_state(fadam.adam(), chunk_bytes=0)


def test_an_inner_transform_that_changes_its_state_layout_is_refused():
    def init(params):
        return [torch.zeros(2)]

    def update(updates, state, params=None, **_):
        return updates, [torch.zeros(3)]

    tx = fadam.page_state(fadam.GradientTransformation(init, update))
    with pytest.raises(RuntimeError, match=r"float32\(3,\).*holds torch.float32\(2,\)"):
        tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))


def test_disk_state_without_a_path_lives_in_its_own_temporary_file():
    tx = fadam.page_state(fadam.adam(lr=0.1), "disk", per_leaf=True)
    params = [torch.ones(3)]
    first, second = tx.init(params), tx.init(params)  # independent states, as for any transform
    path = bytes(first.path.tolist()).decode()
    assert os.path.exists(path) and path != bytes(second.path.tolist()).decode()
    params, first = fadam.step(tx, params, [torch.ones(3)], first)
    torch.testing.assert_close(params[0], torch.full((3,), 0.9))
    _, second = tx.update([torch.ones(3)], second)
    del first
    gc.collect()
    assert not os.path.exists(path)  # removed with the last state that refers to it


def test_a_donated_host_state_is_updated_in_its_own_buffers():
    tx = fadam.paged_adam(lr=0.1, chunk_bytes=4096)
    params = [torch.randn(300), torch.randn(300)]
    state = tx.init(params)
    kept = fadam.paged_adam(lr=0.1, chunk_bytes=4096)
    reference = kept.init(params)
    grads = [torch.ones(300), -torch.ones(300)]
    new_params, new_state = fadam.step(tx, [p.clone() for p in params], grads, state, donate=True)
    ref_params, ref_state = fadam.step(kept, [p.clone() for p in params], grads, reference)
    assert all(a is b for a, b in zip(_reads(new_state), [pair[0] for pair in state.buffers]))  # written in place
    assert all(a is b for a, b in zip(_reads(ref_state), [pair[1] for pair in reference.buffers]))  # or the spare
    with pytest.raises(ValueError, match="stale paged state"):  # a donated state is given up
        tx.update(grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(new_params, ref_params))


@pytest.mark.parametrize("per_leaf", [True, False])
def test_a_param_on_the_meta_device_is_refused_by_name(per_leaf):
    with pytest.raises(ValueError, match=r"param \['b'\]: it is on the meta device"):
        fadam.page_state(fadam.adam(), per_leaf=per_leaf).init({"b": torch.zeros(2, device="meta")})


def test_one_chunk_needs_params_on_one_device():
    with pytest.raises(ValueError, match="needs params on one device"):
        fadam.page_state(fadam.adam(), per_leaf=False).init([torch.zeros(2), torch.zeros(2, device="meta")])


def test_dtensor_state_is_stored_as_local_shards_and_streams_in_as_dtensors(tmp_path: Path) -> None:
    """On a one-rank gloo mesh (two ranks: tests/test_fsdp.py): the storage holds local shards, the layout the
    placements, and the paged update equals the unpaged one bit for bit; a donated step writes the DTensors in place."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        params = {
            k: distribute_tensor(torch.randn(*s, generator=g), mesh, [Shard(0)])
            for k, s in [("w", (6, 4)), ("b", (5,))]
        }
        tx, plain = (
            fadam.page_state(fadam.adamw(1e-2, amsgrad=True), per_leaf=True, chunk_bytes=64),
            fadam.adamw(1e-2, amsgrad=True),
        )
        state, plain_state = tx.init(params), plain.init(params)
        layout = [x for x in fadam._tree.tree_leaves(state.layout) if x.dim() > 0]
        assert layout and all(x.placements == (Shard(0),) and x.to_local().device.type == "meta" for x in layout)
        expected = params
        for step in range(3):
            grads = {
                k: distribute_tensor(torch.randn(v.shape, generator=g), mesh, [Shard(0)]) for k, v in params.items()
            }
            updates, plain_state = plain.update(grads, plain_state, expected)
            expected = fadam.apply_updates(expected, updates)
            new, state = fadam.step(tx, params, grads, state, donate=step % 2 == 1)
            if step % 2:
                assert all(new[k] is params[k] for k in params)  # donated DTensors are written in place
            params = new
            for k in params:
                assert type(params[k]).__name__ == "DTensor" and torch.equal(
                    params[k].full_tensor(), expected[k].full_tensor()
                ), k
    finally:
        dist.destroy_process_group()


def test_states_of_separate_inits_of_one_transform_step_independently():
    # each state's layout is worked out once and reused by its later steps; states of other inits must not mix
    tx, reference = fadam.paged_adamw(lr=1e-2, chunk_bytes=4096), fadam.adamw(lr=1e-2)
    shapes = {"small": [(300,), (40,)], "large": [(1000,), (7, 3), (500,)]}
    runs = {}
    for name, dims in shapes.items():
        params = [torch.randn(d, generator=torch.Generator().manual_seed(len(d))) for d in dims]
        runs[name] = [params, tx.init(params), [p.clone() for p in params], reference.init(params)]
    for step in range(3):
        for params, state, ref_params, ref_state in runs.values():
            grads = [torch.full_like(p, 0.1 * (step + 1)) - p for p in params]
            run = runs["small" if len(params) == 2 else "large"]
            run[0], run[1] = fadam.step(tx, params, grads, state, donate=True)
            run[2], run[3] = fadam.step(reference, ref_params, grads, ref_state, donate=True)
    for params, _, ref_params, _ in runs.values():
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
