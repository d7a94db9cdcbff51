"""The protocol in ``fadam/_base.py``: GradientTransformation, identity, set_to_zero, stateless, apply_updates, step."""

from __future__ import annotations

import pytest
import torch

import fadam
from tests.test_purity import FACTORIES, HANDLE_STATE, REAL_ONLY, _grads, _params
from tests.tree_checks import max_rel_err, tensor_leaves


def test_gradient_transformation_is_a_named_tuple():
    tx = fadam.identity()
    init, update = tx
    assert tx._fields == ("init", "update") and init is tx.init and update is tx.update
    assert fadam.GradientTransformationExtraArgs is fadam.GradientTransformation
    assert fadam.EmptyState() == () and isinstance(fadam.EmptyState(), tuple)


def test_identity_and_set_to_zero():
    g = {"a": torch.tensor([1.0, -2.0]), "b": None}
    out, state = fadam.identity().update(g, fadam.identity().init(g), extra=1)
    assert out is g and state == fadam.EmptyState()
    zero, _ = fadam.set_to_zero().update(g, fadam.EmptyState())
    assert zero["a"].tolist() == [0.0, 0.0] and zero["a"].dtype == g["a"].dtype and zero["b"] is None


def test_stateless_and_stateless_with_tree_map():
    def fn(updates, params):
        return fadam.tree_map(lambda u, p: None if u is None else u + p, updates, params)

    g, p = {"a": torch.tensor([1.0]), "b": None}, {"a": torch.tensor([2.0]), "b": torch.tensor([5.0])}
    out, state = fadam.stateless(fn).update(g, fadam.stateless(fn).init(p), p)
    assert out["a"].tolist() == [3.0] and out["b"] is None and state == fadam.EmptyState()
    per_leaf = fadam.stateless_with_tree_map(lambda u, param: u * (2 if param is None else param))
    assert per_leaf.update(g, fadam.EmptyState(), p)[0]["a"].tolist() == [2.0]
    assert per_leaf.update(g, fadam.EmptyState())[0]["a"].tolist() == [2.0]
    assert per_leaf.update(g, fadam.EmptyState())[0]["b"] is None


@pytest.mark.parametrize(
    ("param_dtype", "update_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float64),
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.complex64, torch.complex128),
    ],
)
def test_apply_updates_keeps_param_dtype(param_dtype, update_dtype):
    params = {"w": torch.ones(3, dtype=param_dtype), "skip": torch.ones(1, dtype=param_dtype)}
    updates = {"w": torch.full((3,), 0.25, dtype=update_dtype), "skip": None}
    out = fadam.apply_updates(params, updates)
    assert out["w"].dtype == param_dtype
    assert torch.equal(out["w"], params["w"] + updates["w"].to(param_dtype))
    assert out["skip"] is params["skip"]  # a None update leaves the param as it is
    assert params["w"].tolist() == [1.0, 1.0, 1.0] or param_dtype.is_complex


@pytest.mark.parametrize(
    ("name", "index"), [(name, index) for name, builders in FACTORIES.items() for index in range(len(builders))]
)
def test_every_factory_accepts_and_ignores_extra_kwargs(name, index):
    plain_tx, extra_tx = FACTORIES[name][index](), FACTORIES[name][index]()
    params = _params(complex_leaf=name not in REAL_ONLY)
    grads = _grads(params, steps=2)
    plain_state, extra_state = plain_tx.init(params), extra_tx.init(params)
    for g in grads:
        plain, plain_state = plain_tx.update(g, plain_state, params)
        extra, extra_state = extra_tx.update(g, extra_state, params, unknown=1, loss=torch.ones(()), key=None)
        assert max_rel_err(extra, plain)[0] == 0.0
        if name not in HANDLE_STATE:  # a paged state is a handle to its own storage: its updates are compared
            assert max_rel_err(extra_state, plain_state)[0] == 0.0


# ----------------------------------------------------------------------------------------------------------- step


@pytest.mark.parametrize(
    "build",
    [
        lambda: fadam.adam(1e-2, weight_decay=0.1),
        lambda: fadam.adamw(1e-2, amsgrad=True),
        lambda: fadam.sgd(1e-2, momentum=0.9),
        lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.scale_by_adam(), fadam.scale(-1e-2)),
    ],
    ids=["adam", "adamw", "sgd", "user-chain"],
)
def test_step_donate_writes_into_the_given_buffers(build):
    """Donation reuses the param buffers (no new param-sized tensors); without it nothing passed in is touched."""
    tx = build()
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    state = tx.init(params)
    g = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    expected_params, expected_state = fadam.step(tx, params, g, state)
    pointers = {k: v.data_ptr() for k, v in params.items()}
    new_params, new_state = fadam.step(tx, params, g, state, donate=True)
    assert {k: v.data_ptr() for k, v in new_params.items()} == pointers
    assert max_rel_err(new_params, expected_params)[0] <= 1e-6
    assert max_rel_err(new_state, expected_state)[0] <= 1e-6
    updates, _ = tx.update(g, tx.init(params), params)
    assert all(u is not None for _, u in tensor_leaves(updates))


def test_step_with_extra_args_runs_the_chain():
    tx = fadam.adam(1e-2)
    params = {"w": torch.ones(2)}
    g = {"w": torch.tensor([1.0, -1.0])}
    out, state = fadam.step(tx, params, g, tx.init(params), loss=torch.tensor(3.0))
    torch.testing.assert_close(out["w"], torch.tensor([0.99, 1.01]))
    assert int(state[0].count) == 1


def test_fusible_update_is_the_chain_update():
    tx = fadam.apply_if_finite(fadam.sgd(0.5, momentum=0.9), 3)
    assert isinstance(tx.update, fadam.FusibleUpdate) and callable(tx.update.fused_step)
    params = [torch.ones(2)]
    updates, _ = tx.update([torch.ones(2)], tx.init(params), params)
    assert updates[0].tolist() == [-0.5, -0.5]
