"""Checkpoints of wrapper states (the conformance battery covers every optimizer row), resuming bit for bit, and
errors that name the first mismatched path without returning anything half-loaded."""

from __future__ import annotations

import functools
import io

import optree
import pytest
import torch

import fadam


def _params() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "encoder": {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)},
        "head": [torch.randn(3, generator=gen), torch.randn(2, dtype=torch.complex64, generator=gen)],
    }


def _grads(params, step: int):
    gen = torch.Generator().manual_seed(50 + step)
    grads = fadam.tree_map(lambda p: torch.randn(p.shape, dtype=p.dtype, generator=gen), params)
    if step == 2:
        grads["encoder"]["b"] = grads["encoder"]["b"] * float("nan")
    return grads


def _save_load(state) -> dict:
    buffer = io.BytesIO()
    torch.save(fadam.state_to_dict(state), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _same(x, y) -> bool:
    """Equal values and dtypes, NaN equal to NaN (an unprotected optimizer fed a NaN keeps it)."""
    if not isinstance(x, torch.Tensor):
        return x == y
    return (
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.isnan(), y.isnan())
        and torch.equal(x.nan_to_num(), y.nan_to_num())
    )


def _equal(a, b) -> bool:
    if optree.tree_structure(a, none_is_leaf=True) != optree.tree_structure(b, none_is_leaf=True):
        return False
    pairs = zip(optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True))
    return all(_same(x, y) for x, y in pairs)


WRAPPED = {
    "inject-schedules": lambda: fadam.inject_hyperparams(fadam.adamw)(
        lr=fadam.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10), weight_decay=fadam.linear_schedule(0.1, 0.0, 5)
    ),
    "apply_if_finite": lambda: fadam.apply_if_finite(fadam.adam(lr=0.1, amsgrad=True), max_consecutive_errors=3),
    "multisteps-skip": lambda: fadam.MultiSteps(
        fadam.sgd(lr=0.1, momentum=0.9), 2, should_skip_update_fn=fadam.skip_not_finite
    ).gradient_transformation(),
    "multisteps-large": lambda: fadam.MultiSteps(
        fadam.adam(lr=0.1), 1, should_skip_update_fn=functools.partial(fadam.skip_large_updates, max_squared_norm=50.0)
    ).gradient_transformation(),
    "zero_nans-chain": lambda: fadam.chain(fadam.zero_nans(), fadam.clip_by_global_norm(1.0), fadam.adam(lr=0.1)),
    "selective_transform": lambda: fadam.selective_transform(
        fadam.adam(lr=0.1), freeze_mask={"encoder": True, "head": False}
    ),
    "partition-named_chain": lambda: fadam.partition(
        {
            0: fadam.named_chain(("trace", fadam.trace(0.9)), ("lr", fadam.scale_by_learning_rate(0.1))),
            1: fadam.apply_if_finite(fadam.sgd(0.1), 1),
        },
        {"encoder": 0, "head": 1},
    ),
}


@pytest.mark.parametrize("name", list(WRAPPED))
def test_wrapper_states_round_trip_and_resume_bit_for_bit(name):
    tx = WRAPPED[name]()
    params, state = _params(), None
    state = tx.init(params)
    for step in range(4):  # step 2 has a NaN gradient: skip states and counters are exercised
        updates, state = tx.update(_grads(params, step), state, params)
        params = fadam.apply_updates(params, updates)
    loaded = _save_load(state)
    restored = fadam.state_from_dict(tx.init(params), loaded)
    assert _equal(restored, state)

    def resume(params, state):
        for step in range(4, 8):
            updates, state = tx.update(_grads(params, step), state, params)
            params = fadam.apply_updates(params, updates)
        return params, state

    assert _equal(resume(params, restored), resume(params, state))


def test_mismatches_name_the_first_path_and_load_nothing():
    params = _params()
    tx = fadam.adam(lr=0.1)
    state = tx.init(params)
    saved = _save_load(tx.update(_grads(params, 0), state, params)[1])
    template = tx.init(params)
    before = optree.tree_map(torch.clone, template)

    other_shapes = {**params, "encoder": {"w": torch.zeros(4, 4), "b": torch.zeros(3)}}
    with pytest.raises(ValueError, match=r"\[0\]\['mu'\]\['encoder'\]\['w'\].*shape \(4, 3\).*\(4, 4\)"):
        fadam.state_from_dict(tx.init(other_shapes), saved)
    other_dtypes = fadam.tree_map(lambda p: p.to(torch.float64) if not p.is_complex() else p, params)
    with pytest.raises(ValueError, match=r"\[0\]\['mu'\]\['encoder'\]\['b'\].*dtype torch.float32.*torch.float64"):
        fadam.state_from_dict(tx.init(other_dtypes), saved)
    with pytest.raises(ValueError, match=r"missing state path \[0\]\['nu_max'\]"):
        fadam.state_from_dict(fadam.adam(amsgrad=True).init(params), saved)
    with pytest.raises(ValueError, match=r"has state path \['0'\]\['mu'\]\['head'\]\['1'\]"):
        fadam.state_from_dict(fadam.adam().init({**params, "head": params["head"][:1]}), saved)
    with pytest.raises(ValueError, match=r"missing state path \[1\]"):
        fadam.state_from_dict(fadam.adam(lr=fadam.constant_schedule(0.1)).init(params), saved)
    # failed loads leave the template and the loaded dict as they were
    assert _equal(template, before)
    assert _equal(fadam.state_from_dict(template, saved), fadam.state_from_dict(template, saved))


def _drop(d: dict, key: str) -> dict:
    """``d`` without ``key`` at any depth."""
    return {k: _drop(v, key) if isinstance(v, dict) else v for k, v in d.items() if k != key}


@pytest.mark.parametrize("make", [fadam.adamw8bit, fadam.adam4bit])
def test_quantized_state_records_the_shape_it_was_made_for(make):
    # the codes and scales of a (64, 128) weight have the sizes of a (128, 64) one's: only the shape tells them apart
    params = {"w": torch.randn(64, 128), "b": torch.randn(10)}
    tx = make(lr=0.1, min_size=256)
    state = tx.update(_grads(params, 0), tx.init(params), params)[1]
    index = next(i for i, s in enumerate(state) if isinstance(s, fadam.QuantizedState))
    saved = _save_load(state)
    assert _equal(fadam.state_from_dict(tx.init(params), saved), state)
    template = tx.init({"w": torch.zeros(128, 64), "b": torch.zeros(10)})
    before = optree.tree_map(torch.clone, template)
    with pytest.raises(
        ValueError,
        match=rf"state path \[{index}\]\['inner_state'\]\['mu'\]\['w'\]: quantized state of shape \(64, 128\) does "
        r"not match the optimizer's \(128, 64\)",
    ):
        fadam.state_from_dict(template, saved)
    assert _equal(template, before)
    # a checkpoint that records no shapes is checked by the sizes of its codes and scales
    assert _equal(fadam.state_from_dict(tx.init(params), _drop(saved, "like")), state)
    saved[str(index)]["inner_state"]["mu"]["w"]["like"] = torch.zeros(64, 128)
    with pytest.raises(
        ValueError, match=r"\['mu'\]\['w'\]\['like'\]: expected an empty tensor of shape \(\*shape, 0\)"
    ):
        fadam.state_from_dict(tx.init(params), saved)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_quantized_state_round_trips_through_distributed_checkpoint_with_its_shape(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    params = {"w": torch.randn(64, 128)}
    tx = fadam.adamw8bit(lr=0.1, min_size=256)
    state = tx.update(_grads(params, 0), tx.init(params), params)[1]
    dcp.save({"optim": fadam.state_to_dict(state)}, checkpoint_id=tmp_path, no_dist=True)
    target = {"optim": fadam.state_to_dict(tx.init(params))}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    assert _equal(fadam.state_from_dict(tx.init(params), target["optim"]), state)
    other = {"optim": fadam.state_to_dict(tx.init({"w": torch.zeros(128, 64)}))}
    with pytest.raises(CheckpointException, match=r"(?s)Size mismatch.*\[64, 128, 0\].*\[128, 64, 0\].*mu\.w\.like"):
        dcp.load(other, checkpoint_id=tmp_path, no_dist=True)
