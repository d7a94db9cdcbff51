"""Training-loop battery over every row of the conformance table: each optimizer can be wrapped in
``inject_hyperparams`` with bit-identical results, composes with ``MultiSteps``, and round-trips its state through a
``torch.save``/``torch.load(weights_only=True)`` checkpoint, resuming bit for bit."""

from __future__ import annotations

import io

import optree
import pytest
import torch

import fadam
from tests.conformance.table import ALL_ROWS, Row


def _params(row: Row) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen)}
    if row.complex_params:
        params["z"] = torch.randn(3, dtype=torch.complex64, generator=gen)
    return params


def _grads(params: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(v.shape, dtype=v.dtype, generator=gen) for k, v in params.items()}


def _run(tx: fadam.GradientTransformation, params, state, steps: range, grads_fn=_grads, fused: bool = False):
    for step in steps:
        grads = grads_fn(params, step)
        if fused:
            params, state = fadam.step(tx, params, grads, state)
        else:
            updates, state = tx.update(grads, state, params)
            params = fadam.apply_updates(params, updates)
    return params, state


def _assert_trees_equal(a, b, what: str) -> None:
    paths = fadam.tree_paths(a)
    la, lb = optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)
    assert optree.tree_structure(a, none_is_leaf=True) == optree.tree_structure(b, none_is_leaf=True), what
    for path, x, y in zip(paths, la, lb):
        if isinstance(x, torch.Tensor) and x.is_meta:  # a layout record (paged state): no values to compare
            assert y.is_meta and x.shape == y.shape and x.dtype == y.dtype, f"{what}: {path} differs"
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {path} differs"
        else:
            assert x == y, f"{what}: {path} differs"


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "step"])
def test_inject_hyperparams_is_bit_identical(row: Row, fused: bool):
    params = _params(row)
    plain = row.build()
    wrapped = fadam.inject_hyperparams(row.make)(**row.kwargs)
    want_params, want_state = _run(plain, params, plain.init(params), range(5), fused=fused)
    got_params, got_state = _run(wrapped, params, wrapped.init(params), range(5), fused=fused)
    _assert_trees_equal(got_params, want_params, "params")
    if row.value_state:  # a handle to paged storage differs between two inits; its params are compared
        _assert_trees_equal(got_state.inner_state, want_state, "inner state")
    numeric = {k for k, v in row.kwargs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numeric <= set(got_state.hyperparams)
    for name in numeric:
        assert float(got_state.hyperparams[name]) == float(row.kwargs[name])


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "step"])
def test_composes_with_multisteps(row: Row, fused: bool):
    params = _params(row)
    # k = 1: the accumulator holds the gradient exactly, so the wrapped run is the plain run, bit for bit
    plain = row.build()
    one = fadam.MultiSteps(row.build(), every_k_schedule=1).gradient_transformation()
    want_params, want_state = _run(plain, params, plain.init(params), range(4), fused=fused)
    got_params, got_state = _run(one, params, one.init(params), range(4), fused=fused)
    _assert_trees_equal(got_params, want_params, "params (k=1)")
    if row.value_state:  # a handle to paged storage differs between two inits; its params are compared
        _assert_trees_equal(got_state.inner_opt_state, want_state, "inner state (k=1)")

    # k = 2: every second mini-step is the plain optimizer stepping on the running mean of the pair
    two = fadam.MultiSteps(row.build(), every_k_schedule=2).gradient_transformation()
    got_params, got_state = _run(two, params, two.init(params), range(6), fused=fused)

    def mean_of_pair(p, step):
        g1, g2 = _grads(p, 2 * step), _grads(p, 2 * step + 1)
        return {k: g1[k] + (g2[k] - g1[k]) / torch.tensor(2.0, dtype=torch.float64) for k in g1}

    want_params, want_state = _run(plain, params, plain.init(params), range(3), grads_fn=mean_of_pair, fused=fused)
    _assert_trees_equal(got_params, want_params, "params (k=2)")
    if row.value_state:  # a handle to paged storage differs between two inits; its params are compared
        _assert_trees_equal(got_state.inner_opt_state, want_state, "inner state (k=2)")


def _checkpoint(state) -> dict:
    buffer = io.BytesIO()
    torch.save(fadam.state_to_dict(state), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_checkpoint_round_trip_and_resume(row: Row):
    params = _params(row)
    tx = row.build()
    reference = row.build()  # the uninterrupted run
    want_params, want_state = _run(reference, params, reference.init(params), range(7))
    params, state = _run(tx, params, tx.init(params), range(3))
    restored = fadam.state_from_dict(tx.init(params), _checkpoint(state))
    _assert_trees_equal(restored, state, "restored state")
    got_params, got_state = _run(tx, params, restored, range(3, 7))
    _assert_trees_equal(got_params, want_params, "resumed params")
    if row.value_state:
        _assert_trees_equal(got_state, want_state, "resumed state")


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_a_raw_state_loads_with_weights_only(row: Row):
    """fadam registers its state containers as safe globals: ``torch.save(state)`` then
    ``torch.load(weights_only=True)`` gives the same state back, containers and tensors."""
    params = _params(row)
    tx = row.build()
    params, state = _run(tx, params, tx.init(params), range(2))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    _assert_trees_equal(torch.load(buffer, weights_only=True), state, f"{row} state loaded with weights_only")
