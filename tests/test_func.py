"""torch.func: every transform works inside ``torch.func.grad`` (an inner step inside a loss that
is differentiated), with ``torch.func.functional_call``, and under ``torch.func.vmap``, where one vmapped
``init``/``update`` over N stacked models equals N separate runs.

The transforms come from the purity table (every public factory, so new factories are covered here too) and from
the conformance table (every optimizer row).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, stack_module_state, vmap

import fadam
from fadam._tree import tree_leaves
from tests.conformance.table import ALL_ROWS
from tests.test_purity import FACTORIES, HANDLE_STATE, REAL_ONLY, _params
from tests.tree_checks import max_rel_err, tensor_leaves

# branches on the loss's values (line search, stopping tests), or seeds a generator from its state: refused under
# torch.func, checked below
VALUE_BRANCHING = {"lbfgs", "noisy_sgd", "add_noise"}
# refuse torch.func by design (a ring buffer indexed by the count, a search that branches on the loss's values)
VALUE_BRANCHING |= {"scale_by_lbfgs", "scale_by_zoom_linesearch", "scale_by_backtracking_linesearch"}
SPARSE_ONLY = {"sparse_adam", "scale_by_sparse_adam"}  # take sparse gradients only, which torch.func does not batch
TRANSFORMS = [
    pytest.param(builder, name not in REAL_ONLY, id=f"{name}-{index}")
    for name, builders in FACTORIES.items()
    if name not in HANDLE_STATE and name not in VALUE_BRANCHING and name not in SPARSE_ONLY
    for index, builder in enumerate(builders)
] + [pytest.param(row.build, row.complex_params, id=f"row-{row.name}") for row in ALL_ROWS if row.value_state]
HANDLE_TRANSFORMS = [
    pytest.param(builder, id=f"{name}-{index}")
    for name, builders in FACTORIES.items()
    if name in HANDLE_STATE
    for index, builder in enumerate(builders)
] + [pytest.param(row.build, id=f"row-{row.name}") for row in ALL_ROWS if not row.value_state]


@pytest.mark.parametrize("make", [lambda: fadam.add_noise(0.01, 0.55, key=1), lambda: fadam.noisy_sgd(1e-2, key=0)])
def test_noise_refuses_torch_func_clearly(make):
    tx = make()
    stacked = fadam.tree_map(lambda p: torch.stack([p, p]), _double(_params(complex_leaf=False)))
    with pytest.raises(ValueError, match=r"add_noise cannot run under torch\.func"):
        vmap(tx.update)(stacked, vmap(tx.init)(stacked), stacked)


def test_lbfgs_refuses_torch_func_clearly():
    tx = fadam.lbfgs(max_iter=2)
    params = _double(_params(complex_leaf=False))
    stacked = fadam.tree_map(lambda p: torch.stack([p, p]), params)

    def value_fn(p: Any) -> tuple[torch.Tensor, Any]:  # half the squared norm: its gradient is p
        return sum((leaf * leaf).sum() for leaf in fadam._tree.tree_leaves(p)) / 2, p

    def member_update(g: Any, state: Any, p: Any) -> tuple[Any, Any]:
        return tx.update(g, state, p, value=value_fn(p)[0], value_fn=value_fn)

    with pytest.raises(ValueError, match=r"lbfgs cannot run under torch\.func"):
        vmap(member_update)(stacked, vmap(tx.init)(stacked), stacked)


@pytest.mark.parametrize("build", HANDLE_TRANSFORMS)
def test_paged_state_refuses_torch_func_clearly(build):
    """Paged state lives outside the traced tensors: vmap and grad get a clear error instead of wrong results."""
    tx = build()
    params = _double(_params(complex_leaf=False))
    state = tx.init(params)
    stacked = fadam.tree_map(lambda p: torch.stack([p, p]), params)
    with pytest.raises(ValueError, match=r"torch\.func"):
        vmap(tx.init)(stacked)
    with pytest.raises(ValueError, match=r"torch\.func"):
        grad(lambda p: _inner_loss(fadam.apply_updates(p, tx.update(p, state, p)[0])))(params)


def _double(tree: Any) -> Any:
    return fadam.tree_map(lambda p: p.to(torch.complex128 if p.is_complex() else torch.float64), tree)


def _inner_loss(params: Any) -> torch.Tensor:
    return sum(((p.abs() ** 2) * 0.5 + p.real * 0.3).sum() for p in tree_leaves(params))


def _outer_loss(new_params: Any) -> torch.Tensor:
    return sum(((p.abs() - 0.3) ** 2).sum() for p in tree_leaves(new_params))


def _warm_state(tx: fadam.GradientTransformation, params: Any) -> Any:
    """State after one step, so that moments and counts are not at their initial values."""
    state = tx.init(params)
    g = fadam.tree_map(lambda p: p * 0.7 - 0.2, params)
    return tx.update(g, state, params)[1]


@pytest.mark.parametrize("use_step", [False, True], ids=["update", "step"])
@pytest.mark.parametrize(("build", "complex_ok"), TRANSFORMS)
def test_inner_step_inside_torch_func_grad(build, complex_ok, use_step):
    """The meta-gradient of a loss after one inner step: torch.func.grad equals torch.autograd on the same function."""
    tx = build()
    params = _double(_params(complex_leaf=complex_ok))
    state = _warm_state(tx, params)

    def inner_step(p: Any, inner_grads: Any) -> Any:
        if use_step:
            return fadam.step(tx, p, inner_grads, state)[0]
        updates, _ = tx.update(inner_grads, state, p)
        return fadam.apply_updates(p, updates)

    def outer(p: Any) -> torch.Tensor:
        return _outer_loss(inner_step(p, grad(_inner_loss)(p)))

    functorch_meta = grad(outer)(params)

    leaves = [(path, t.detach().clone().requires_grad_()) for path, t in tensor_leaves(params)]
    spec = fadam._tree.tree_flatten(params)[1]
    autograd_params = spec.unflatten([t for _, t in leaves])
    inner_grads = torch.autograd.grad(_inner_loss(autograd_params), [t for _, t in leaves], create_graph=True)
    new_params = inner_step(autograd_params, spec.unflatten(list(inner_grads)))
    expected = torch.autograd.grad(_outer_loss(new_params), [t for _, t in leaves], allow_unused=True)
    expected = spec.unflatten([torch.zeros_like(t) if e is None else e for (_, t), e in zip(leaves, expected)])

    err, where = max_rel_err(functorch_meta, expected)
    assert err <= 1e-12, f"meta-gradient differs at {where}: {err:.2e}"
    assert all(torch.isfinite(t).all() for _, t in tensor_leaves(functorch_meta))


def test_meta_gradient_of_adam_matches_finite_differences():
    """A number that can fail: d(loss after one Adam step)/d(lr), against a central difference."""
    params = {"w": torch.linspace(-1, 1, 5, dtype=torch.float64)}
    state = _warm_state(fadam.adam(1e-2), params)

    def loss_after_step(lr: torch.Tensor) -> torch.Tensor:
        tx = fadam.adam(lr)
        updates, _ = tx.update(grad(_inner_loss)(params), state, params)
        return _outer_loss(fadam.apply_updates(params, updates))

    lr = torch.tensor(0.05, dtype=torch.float64)
    analytic = grad(loss_after_step)(lr)
    h = 1e-6
    numeric = (loss_after_step(lr + h) - loss_after_step(lr - h)) / (2 * h)
    torch.testing.assert_close(analytic, numeric, rtol=1e-7, atol=0)
    assert abs(float(analytic)) > 1e-3


# --------------------------------------------------------------------------------------------------------- vmap


def _member(tree: Any, index: int) -> Any:
    return fadam.tree_map(lambda x: None if x is None else x[index], tree)


def _assert_members_equal(batched: Any, separate: list[Any], what: str) -> None:
    for index, member in enumerate(separate):
        err, where = max_rel_err(_member(batched, index), member)
        assert err <= 1e-12, f"{what}, member {index}: {err:.2e} at {where}"


@pytest.mark.parametrize("use_step", [False, True], ids=["update", "step"])
@pytest.mark.parametrize(("build", "complex_ok"), TRANSFORMS)
def test_vmapped_update_equals_separate_updates(build, complex_ok, use_step):
    tx = build()
    n = 3
    base = _double(_params(complex_leaf=complex_ok))
    gen = torch.Generator().manual_seed(0)

    def noise(p: torch.Tensor) -> torch.Tensor:
        return torch.randn((n, *p.shape), generator=gen, dtype=p.dtype)

    params = fadam.tree_map(lambda p: p + noise(p), base)
    grads = [fadam.tree_map(lambda p: noise(p) * 2, base) for _ in range(3)]

    def one_step(p: Any, g: Any, s: Any) -> tuple[Any, Any]:
        if use_step:
            return fadam.step(tx, p, g, s)
        updates, s = tx.update(g, s, p)
        return fadam.apply_updates(p, updates), s

    state = vmap(tx.init)(params)
    members = [_member(params, i) for i in range(n)]
    member_states = [tx.init(p) for p in members]
    _assert_members_equal(state, member_states, "init")
    for g in grads:
        params, state = vmap(one_step)(params, g, state)
        for i in range(n):
            members[i], member_states[i] = one_step(members[i], _member(g, i), member_states[i])
        _assert_members_equal(params, members, "params")
        _assert_members_equal(state, member_states, "state")


BLOCK_OPTIMIZERS = [
    pytest.param(
        lambda: fadam.chain(fadam.clip_by_global_norm(0.5), fadam.scale_by_adam(nesterov=True), fadam.scale(-1e-2)),
        id="clip-adam-nesterov",
    ),
    pytest.param(
        lambda: fadam.chain(
            fadam.add_decayed_weights(1e-2, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
            fadam.trace(0.9, dampening=0.1),
            fadam.scale_by_learning_rate(lambda count: 0.1 * 0.9 ** count.to(torch.float64)),
        ),
        id="decay-trace-schedule",
    ),
    pytest.param(
        lambda: fadam.partition(
            {"first": fadam.adamw(1e-2, amsgrad=True), "second": fadam.sgd(0.1, momentum=0.5)},
            lambda p: {k: "first" if k.startswith("0.") else "second" for k in p},
        ),
        id="partition",
    ),
]


@pytest.mark.parametrize(
    "build", [*(pytest.param(row.build, id=row.name) for row in ALL_ROWS if row.value_state), *BLOCK_OPTIMIZERS]
)
def test_stacked_models_trained_by_one_vmapped_update(build):
    """N MLPs stacked with torch.func.stack_module_state, one vmapped grad/update per step, equal N separate runs."""
    n, steps = 3, 5
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double() for _ in range(n)
    ]
    skeleton = copy.deepcopy(models[0]).to("meta")
    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(n, 16, 1, generator=gen, dtype=torch.float64)

    def loss(params: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(functional_call(skeleton, params, (xb,)), yb)

    tx, alone_tx = build(), build()

    def train_step(tx: fadam.GradientTransformation) -> Callable[..., tuple[dict, Any]]:
        def run(params: dict, state: Any, xb: torch.Tensor, yb: torch.Tensor) -> tuple[dict, Any]:
            updates, state = tx.update(grad(loss)(params, xb, yb), state, params)
            return fadam.apply_updates(params, updates), state

        return run

    state = vmap(tx.init)(stacked)
    separate = [({k: v.detach().clone() for k, v in m.named_parameters()}, None) for m in models]
    separate = [(p, alone_tx.init(p)) for p, _ in separate]
    for _ in range(steps):
        stacked, state = vmap(train_step(tx))(stacked, state, x, y)
        separate = [train_step(alone_tx)(p, s, x[i], y[i]) for i, (p, s) in enumerate(separate)]
    _assert_members_equal(stacked, [p for p, _ in separate], "params")
    _assert_members_equal(state, [s for _, s in separate], "state")
    moved = max_rel_err(_member(stacked, 0), dict(models[0].named_parameters()))[0]
    assert moved > 1e-6  # the models were trained


def test_clip_by_global_norm_under_vmap_uses_each_members_norm():
    tx = fadam.clip_by_global_norm(1.0)
    # member norms over both leaves: 0.5 (kept), 5 (scaled by 1/5), 13 (scaled by 1/13)
    a = torch.tensor([[0.3, 0.0], [3.0, 0.0], [5.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[0.4], [4.0], [12.0]], dtype=torch.float64)
    updates, _ = vmap(lambda u: tx.update(u, fadam.EmptyState()))({"a": a, "b": b})
    scale = torch.tensor([1.0, 1 / 5, 1 / 13], dtype=torch.float64)
    torch.testing.assert_close(updates["a"], a * scale[:, None], rtol=1e-15, atol=0)
    torch.testing.assert_close(updates["b"], b * scale[:, None], rtol=1e-15, atol=0)
    norms = vmap(fadam.global_norm)(updates)
    torch.testing.assert_close(norms, torch.tensor([0.5, 1.0, 1.0], dtype=torch.float64))
