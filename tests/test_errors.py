"""Bad input: a clear ``ValueError`` naming the leaf's path, raised before anything is computed or
written; and ``None`` gradients, which skip their param as torch.optim does.

What matches torch.optim exactly with ``None`` gradients, and what does not:

- A param whose gradient is ``None`` is skipped: it and its state are left bit-identical, like torch.optim.
- Params that always have a gradient follow torch.optim exactly.
- fadam's step count is one counter shared by all leaves (as in optax: the state is one tree with one ``count``);
  torch keeps a ``step`` per param. So after a param skipped some steps, Adam's bias corrections for it use the
  shared count in fadam and the param's own count in torch: its trajectory differs. It equals torch.optim's once
  torch's per-param ``step`` is set to the shared count, which pins down that this is the only difference.
- SGD has no step-dependent math except torch's "first step copies the gradient into the momentum buffer". That
  differs only with ``dampening != 0`` for a param whose first gradient arrives after step 1; without dampening SGD
  matches exactly.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

import fadam
from tests.tree_checks import assert_unchanged, max_rel_err, snapshot, tensor_leaves


def _params() -> dict[str, Any]:
    return {"enc": {"w": torch.ones(3, 2)}, "head": [torch.full((2,), 2.0), torch.tensor(3.0)]}


def _grads() -> dict[str, Any]:
    return {"enc": {"w": torch.full((3, 2), 0.5)}, "head": [torch.ones(2), torch.tensor(-1.0)]}


def _missing_leaf(g):
    del g["head"]


def _extra_leaf(g):
    g["head"].append(torch.ones(1))


def _renamed_key(g):
    g["dec"] = g.pop("enc")


def _python_float(g):
    g["enc"]["w"] = 0.5


def _shape(g):
    g["head"][0] = torch.ones(3)


def _device(g):
    g["head"][0] = torch.ones(2, device="meta")  # a second device on a CPU-only machine


# sparse gradients, which some transforms take: tests/test_sparse.py
BAD_GRADS = [
    pytest.param(_missing_leaf, "['head'][0]", id="missing-leaf"),
    pytest.param(_extra_leaf, "['head'][2]", id="extra-leaf"),
    pytest.param(_renamed_key, "['dec']", id="renamed-key"),
    pytest.param(_python_float, "['enc']['w']: expected a torch.Tensor or None, got float", id="non-tensor"),
    pytest.param(_shape, "['head'][0]: shape (3,) does not match expected (2,)", id="shape"),
    pytest.param(_device, "['head'][0]: device meta does not match expected cpu", id="device"),
]

TRANSFORMS = {
    "adam": lambda: fadam.adam(1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda: fadam.adamw(1e-2, amsgrad=True),
    "sgd": lambda: fadam.sgd(1e-2),
    "sgd-momentum": lambda: fadam.sgd(1e-2, momentum=0.9),
    "user-chain": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.scale_by_adam(), fadam.scale(-0.1)),
    "partition": lambda: fadam.partition({"a": fadam.adam(1e-2), "s": fadam.sgd(1e-2)}, {"enc": "a", "head": "s"}),
}


@pytest.mark.parametrize("mode", ["update", "step", "step-donate"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize(("corrupt", "message"), BAD_GRADS)
def test_bad_gradients_raise_naming_the_leaf(corrupt, message, name, mode):
    tx = TRANSFORMS[name]()
    params = _params()
    state = tx.init(params)
    fadam.step(tx, params, _grads(), state)  # a valid step first: state is not fresh
    grads = _grads()
    corrupt(grads)
    before = snapshot(params), snapshot(state)
    with pytest.raises(ValueError, match=re.escape(message)):
        if mode == "update":
            tx.update(grads, state, params)
        else:
            fadam.step(tx, params, grads, state, donate=mode == "step-donate")
    # nothing was written, not even with donation
    assert_unchanged(before[0], "params")
    assert_unchanged(before[1], "state")


@pytest.mark.parametrize(("corrupt", "message"), BAD_GRADS)
def test_apply_updates_rejects_bad_updates(corrupt, message):
    params, updates = _params(), _grads()
    corrupt(updates)
    before = snapshot(params)
    with pytest.raises(ValueError, match=re.escape(message)):
        fadam.apply_updates(params, updates)
    assert_unchanged(before, "params")


@pytest.mark.parametrize(("corrupt", "message"), BAD_GRADS)
def test_update_without_params_still_checks_against_state(corrupt, message):
    """``update(grads, state)`` with no params: Adam checks the grads against its moments."""
    tx = fadam.chain(fadam.scale_by_adam(), fadam.scale(-1e-2))
    state = tx.init(_params())
    grads = _grads()
    corrupt(grads)
    with pytest.raises(ValueError, match=re.escape(message)):
        tx.update(grads, state)


@pytest.mark.parametrize("name", ["adam", "adamw-amsgrad", "sgd-momentum", "partition"])
@pytest.mark.parametrize("donate", [False, True])
def test_state_from_other_params_is_rejected(name, donate):
    tx = TRANSFORMS[name]()
    params = _params()
    other = copy.deepcopy(params)
    other["head"].append(torch.zeros(4))
    state = tx.init(other)
    before = snapshot(params), snapshot(state)
    with pytest.raises(ValueError, match=re.escape("['head'][2]")):
        fadam.step(tx, params, _grads(), state, donate=donate)
    assert_unchanged(before[0], "params")
    assert_unchanged(before[1], "state")


def test_decay_without_params_is_a_clear_error():
    with pytest.raises(ValueError, match="needs params"):
        fadam.add_decayed_weights(0.1).update(_grads(), fadam.EmptyState())
    with pytest.raises(ValueError, match="needs params"):
        tx = fadam.adamw(1e-2)
        tx.update(_grads(), tx.init(_params()))


def test_non_transform_in_chain_is_a_type_error():
    with pytest.raises(TypeError, match="chain argument 1"):
        fadam.chain(fadam.identity(), lambda g: g)


# ------------------------------------------------------------------------------------------------- None gradients


def _none_schedule(steps: int, skipped: set[int]) -> list[dict]:
    """Gradients for params ``a`` and ``b``; ``b``'s gradient is ``None`` at the ``skipped`` steps (1-based)."""
    gen = torch.Generator().manual_seed(0)
    grads = []
    for step in range(1, steps + 1):
        g = {"a": torch.randn(4, generator=gen, dtype=torch.float64)}
        b = torch.randn(3, generator=gen, dtype=torch.float64)
        g["b"] = None if step in skipped else b
        grads.append(g)
    return grads


@pytest.mark.parametrize("mode", ["update", "step", "step-donate"])
@pytest.mark.parametrize("name", ["adam", "adamw-amsgrad", "sgd-momentum", "user-chain"])
def test_none_gradient_skips_param_and_leaves_its_state_alone(name, mode):
    tx = TRANSFORMS[name]()
    params = {"a": torch.ones(4, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
    state = tx.init(params)
    b_state_paths = None
    for step, g in enumerate(_none_schedule(6, skipped={3, 4}), start=1):
        b_before = params["b"].clone()
        a_before = params["a"].clone()
        b_state = [(p, t.clone()) for p, t in _leaves_under(state, "['b']")]
        b_state_paths = b_state_paths or [p for p, _ in b_state]
        if mode == "update":
            updates, state = tx.update(g, state, params)
            assert (updates["b"] is None) == (g["b"] is None)
            params = fadam.apply_updates(params, updates)
        else:
            params, state = fadam.step(tx, params, g, state, donate=mode == "step-donate")
        assert not torch.equal(params["a"], a_before), f"step {step}: a was not updated"
        if g["b"] is None:
            assert torch.equal(params["b"], b_before), f"step {step}: skipped param b changed"
            for (path, before), (_, after) in zip(b_state, _leaves_under(state, "['b']"), strict=True):
                assert torch.equal(before, after), f"step {step}: state {path} of skipped param changed"
        else:
            assert not torch.equal(params["b"], b_before)
    assert b_state_paths, "the test must see b's state"


def _leaves_under(state: Any, key: str) -> list[tuple[str, torch.Tensor]]:
    return [(path, t) for path, t in tensor_leaves(state) if key in path]


def _run_torch(torch_cls, kwargs, grads, step_override=None):
    a = torch.ones(4, dtype=torch.float64, requires_grad=True)
    b = torch.ones(3, dtype=torch.float64, requires_grad=True)
    opt = torch_cls([a, b], foreach=False, **kwargs)
    for count, g in enumerate(grads, start=1):
        a.grad = g["a"].clone()
        b.grad = None if g["b"] is None else g["b"].clone()
        if step_override and b in opt.state and b.grad is not None:
            opt.state[b]["step"] = torch.tensor(float(count - 1))  # torch increments it to the shared count
        opt.step()
    return {"a": a.detach(), "b": b.detach()}


def _run_fadam(tx, grads):
    params = {"a": torch.ones(4, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = fadam.apply_updates(params, updates)
    return params


@pytest.mark.parametrize(
    ("make", "torch_cls", "kwargs"),
    [
        (fadam.adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
        (fadam.adamw, torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    ],
    ids=["adam", "adamw"],
)
def test_none_gradient_against_torch_adam(make, torch_cls, kwargs):
    grads = _none_schedule(20, skipped={3, 4, 9})
    ours = _run_fadam(make(**kwargs), grads)
    theirs = _run_torch(torch_cls, kwargs, grads)
    assert max_rel_err(ours["a"], theirs["a"])[0] <= 1e-12  # always-present param: exact
    # b skipped 3 steps: fadam's shared count gives it other bias corrections than torch's per-param step
    assert max_rel_err(ours["b"], theirs["b"])[0] > 1e-6
    pinned = _run_torch(torch_cls, kwargs, grads, step_override=True)
    assert max_rel_err(ours["b"], pinned["b"])[0] <= 1e-12  # ... and that is the only difference


@pytest.mark.parametrize("skipped", [{1, 2}, {5, 6, 7}], ids=["first-steps", "later-steps"])
def test_none_gradient_against_torch_sgd(skipped):
    kwargs = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1, "nesterov": True}
    grads = _none_schedule(20, skipped=skipped)
    ours = _run_fadam(fadam.sgd(**kwargs), grads)
    theirs = _run_torch(torch.optim.SGD, kwargs, grads)
    assert max_rel_err(ours, theirs)[0] <= 1e-12


def test_none_gradient_first_step_with_dampening_differs_from_torch():
    """The documented difference: torch copies a param's first gradient into its buffer whenever it arrives."""
    kwargs = {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}
    grads = _none_schedule(10, skipped={1})
    ours = _run_fadam(fadam.sgd(**kwargs), grads)
    theirs = _run_torch(torch.optim.SGD, kwargs, grads)
    assert max_rel_err(ours["a"], theirs["a"])[0] <= 1e-12
    assert max_rel_err(ours["b"], theirs["b"])[0] > 1e-6
