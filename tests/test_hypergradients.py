"""Differentiating through unrolled optimizer steps: gradcheck/gradgradcheck in float64 with respect to the initial
params and every hyperparameter, torch.autograd vs torch.func agreement, finite meta-gradients where Adam's second
moment is zero, and the fused/in-place paths never cutting a graph.

Each case builds its transform as ``factory(**hparams)`` with 0-d tensor hyperparameters, or, for the injected cases,
as ``inject_hyperparams(factory)`` built from the float values with the differentiated tensors then written into
``InjectHyperparamsState.hyperparams``, the way a meta-learner keeps its learned hyperparameters in the state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import fadam

STEPS = 5
F64 = torch.float64


@dataclass(frozen=True)
class Case:
    name: str
    factory: Callable[..., fadam.GradientTransformation]
    hparams: dict[str, float | tuple[float, ...]]  # differentiated; passed as 0-d float64 tensors
    static: dict[str, Any] = field(default_factory=dict)
    injected: bool = False  # through inject_hyperparams: the tensors go into the state, not into the factory

    def __str__(self) -> str:
        return self.name


def _clipped_adam(max_norm: torch.Tensor, lr: torch.Tensor, betas: tuple, weight_decay: torch.Tensor):
    return fadam.chain(fadam.clip_by_global_norm(max_norm), fadam.adam(lr=lr, betas=betas, weight_decay=weight_decay))


DIRECT_CASES = [
    Case("adam", fadam.adam, {"lr": 0.05, "betas": (0.8, 0.9), "weight_decay": 0.1}),
    Case("adamw", fadam.adamw, {"lr": 0.05, "betas": (0.8, 0.9), "weight_decay": 0.2}),
    Case("adam-amsgrad", fadam.adam, {"lr": 0.05, "betas": (0.7, 0.8), "weight_decay": 0.1}, {"amsgrad": True}),
    Case("sgd-momentum", fadam.sgd, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    Case("sgd-nesterov", fadam.sgd, {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.1}, {"nesterov": True}),
    Case("clip-adam", _clipped_adam, {"max_norm": 0.5, "lr": 0.05, "betas": (0.8, 0.9), "weight_decay": 0.1}),
]
# through inject_hyperparams: the differentiated tensors are written into the state (betas as a pair of 0-d tensors)
_INJECTED_HPARAMS = {"lr": 0.05, "betas": (0.8, 0.9), "weight_decay": 0.1}
INJECTED_CASES = [
    Case("inject-adam", fadam.adam, _INJECTED_HPARAMS, injected=True),
    Case("inject-adamw", fadam.adamw, {**_INJECTED_HPARAMS, "weight_decay": 0.2}, injected=True),
    Case("inject-adam-amsgrad", fadam.adam, {**_INJECTED_HPARAMS, "betas": (0.7, 0.8)}, {"amsgrad": True}, True),
    Case("inject-sgd-momentum", fadam.sgd, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, injected=True),
    Case("inject-sgd-nesterov", fadam.sgd, {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.1}, {"nesterov": True}, True),
    Case("inject-clip-adam", _clipped_adam, {"max_norm": 0.5, **_INJECTED_HPARAMS}, injected=True),
]
CASES = DIRECT_CASES + INJECTED_CASES

_gen = torch.Generator().manual_seed(0)
A_TRAIN = torch.randn(4, 3, generator=_gen, dtype=F64)
Y_TRAIN = torch.randn(4, generator=_gen, dtype=F64)
A_VAL = torch.randn(4, 3, generator=_gen, dtype=F64)
Y_VAL = torch.randn(4, generator=_gen, dtype=F64)
PARAMS0 = {"w": torch.randn(3, generator=_gen, dtype=F64), "b": torch.randn(1, generator=_gen, dtype=F64)}


def _loss(params: dict[str, torch.Tensor], a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((torch.tanh(a @ params["w"] + params["b"]) - y) ** 2).sum()


def _tensors(hparams: dict[str, Any]) -> dict[str, Any]:
    return {
        k: tuple(torch.tensor(b, dtype=F64) for b in v) if isinstance(v, tuple) else torch.tensor(v, dtype=F64)
        for k, v in hparams.items()
    }


def _flat_inputs(case: Case) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], tuple[dict, dict]]]:
    """The differentiated inputs as one flat list (params then hyperparameters) and how to rebuild both trees."""
    leaves, spec = fadam._tree.tree_flatten((PARAMS0, _tensors(case.hparams)))
    return [x.clone().requires_grad_() for x in leaves], spec.unflatten


def build(case: Case, params: dict, hparams: dict) -> tuple[fadam.GradientTransformation, Any]:
    """The transform and its initial state, with the hyperparameter tensors ``hparams`` in the factory or the state."""
    if not case.injected:
        tx = case.factory(**hparams, **case.static)
        return tx, tx.init(params)
    tx = fadam.inject_hyperparams(case.factory)(**case.hparams, **case.static)
    state = tx.init(params)
    assert set(hparams) <= set(state.hyperparams), (sorted(hparams), sorted(state.hyperparams))
    return tx, state._replace(hyperparams={**state.hyperparams, **hparams})


def unrolled_autograd(case: Case, params: dict, hparams: dict, steps: int = STEPS) -> torch.Tensor:
    """Validation loss after ``steps`` inner steps, inner gradients by ``torch.autograd.grad(create_graph=True)``."""
    tx, state = build(case, params, hparams)
    return unrolled_loop(tx, params, steps, state)


def unrolled_loop(tx: fadam.GradientTransformation, params: dict, steps: int, state: Any = None) -> torch.Tensor:
    state = tx.init(params) if state is None else state
    for _ in range(steps):
        leaves = list(params.values())
        grads = dict(zip(params, torch.autograd.grad(_loss(params, A_TRAIN, Y_TRAIN), leaves, create_graph=True)))
        params, state = fadam.step(tx, params, grads, state)
    return _loss(params, A_VAL, Y_VAL)


def unrolled_functional(case: Case, params: dict, hparams: dict, steps: int = STEPS) -> torch.Tensor:
    """The same loop written purely functionally: inner gradients by ``torch.func.grad``."""
    tx, state = build(case, params, hparams)
    for _ in range(steps):
        grads = torch.func.grad(_loss)(params, A_TRAIN, Y_TRAIN)
        params, state = fadam.step(tx, params, grads, state)
    return _loss(params, A_VAL, Y_VAL)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradcheck_and_gradgradcheck_through_unrolled_steps(case: Case) -> None:
    inputs, rebuild = _flat_inputs(case)

    def fn(*flat: torch.Tensor) -> torch.Tensor:
        return unrolled_autograd(case, *rebuild(list(flat)))

    grads = torch.autograd.grad(fn(*inputs), inputs)
    # every input (params, lr, betas, weight decay, max norm) really moves the outer loss
    assert all(g.abs().max() > 1e-6 for g in grads), [g.abs().max().item() for g in grads]
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_autograd_and_torch_func_hypergradients_agree(case: Case) -> None:
    inputs, rebuild = _flat_inputs(case)
    params, hparams = rebuild(inputs)
    expected = torch.autograd.grad(unrolled_autograd(case, params, hparams), inputs)

    func_grads = torch.func.grad(lambda p, h: unrolled_functional(case, p, h), argnums=(0, 1))(
        *rebuild([x.detach() for x in inputs])
    )
    actual = fadam._tree.tree_leaves(func_grads)
    for name, a, e in zip(fadam.tree_paths((params, hparams)), actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)


def test_hypergradient_descent_on_the_learning_rate_lowers_the_unrolled_loss() -> None:
    """The outer loop is fadam too: Adam on ``log lr`` of an inner SGD with momentum on an ill-conditioned quadratic."""
    curvature = torch.tensor([1.0, 0.05], dtype=F64)
    w0 = torch.tensor([1.0, 1.0], dtype=F64)

    def unrolled(log_lr: torch.Tensor) -> torch.Tensor:
        tx = fadam.sgd(lr=log_lr.exp(), momentum=0.5)
        w, state = w0.clone().requires_grad_(), tx.init(w0)
        for _ in range(STEPS):
            (g,) = torch.autograd.grad(0.5 * (curvature * w * w).sum(), w, create_graph=True)
            w, state = fadam.step(tx, w, g, state)
        return 0.5 * (curvature * w * w).sum()

    meta = {"log_lr": torch.tensor(0.01, dtype=F64).log().requires_grad_()}
    outer_tx = fadam.adam(lr=0.2)
    outer_state = outer_tx.init(meta)
    losses = []
    for _ in range(20):
        loss = unrolled(meta["log_lr"])
        grads = dict(zip(meta, torch.autograd.grad(loss, list(meta.values()))))
        meta, outer_state = fadam.step(outer_tx, fadam.stop_gradient(meta), grads, outer_state)
        losses.append(loss.item())
    assert max(losses[-5:]) < 0.5 * losses[0], losses
    assert meta["log_lr"].exp() > 0.05  # it learned to take larger steps along the flat direction


def test_tensor_hyperparameters_give_bitwise_the_float_trajectory() -> None:
    torch.manual_seed(0)
    configs = [
        (fadam.adam, {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "amsgrad": True}),
        (fadam.adamw, {"lr": 1e-2, "betas": (0.8, 0.999), "weight_decay": 0.1}),
        (fadam.sgd, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
        (fadam.sgd, {"lr": 1e-2, "momentum": 0.8, "dampening": 0.3}),
    ]
    for factory, kwargs in configs:
        numeric = {k: v for k, v in kwargs.items() if isinstance(v, float | tuple)}
        tensor_kwargs = {**kwargs, **_tensors(numeric)}
        params = {"w": torch.randn(50), "z": torch.randn(3, dtype=torch.complex64)}
        float_tx, tensor_tx = factory(**kwargs), factory(**tensor_kwargs)
        p_float, p_tensor, s_float, s_tensor = params, params, float_tx.init(params), tensor_tx.init(params)
        for _ in range(6):
            grads = fadam.tree_map(torch.randn_like, params)
            u, s_float = float_tx.update(grads, s_float, p_float)
            p_float = fadam.apply_updates(p_float, u)
            u, s_tensor = tensor_tx.update(grads, s_tensor, p_tensor)
            p_tensor = fadam.apply_updates(p_tensor, u)
        for key in params:
            assert torch.equal(p_float[key], p_tensor[key]), (factory.__name__, key)


def _zero_gradient_meta_grads(sqrt_free_of_nan: bool) -> tuple[torch.Tensor, ...]:
    """Meta-gradients of Adam steps on ``c * w0 * w1`` from ``w1 = 0``: the gradient of ``w0`` is exactly zero but
    depends on ``w1``, the case where ``d sqrt(v)/dv`` is infinite."""
    w = torch.tensor([1.5, 0.0], dtype=F64, requires_grad=True)
    lr = torch.tensor(0.1, dtype=F64, requires_grad=True)
    tx = fadam.adam(lr=lr)
    if not sqrt_free_of_nan:  # the textbook formula: what fadam avoids
        m, v, p = torch.zeros_like(w), torch.zeros_like(w), w
        for t in range(1, 4):
            (g,) = torch.autograd.grad(2.0 * p[0] * p[1], p, create_graph=True)
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            p = p - lr * (m / (1 - 0.9**t)) / (torch.sqrt(v / (1 - 0.999**t)) + 1e-8)
    else:
        p, state = w, tx.init(w)
        for _ in range(3):
            (g,) = torch.autograd.grad(2.0 * p[0] * p[1], p, create_graph=True)
            p, state = fadam.step(tx, p, g, state)
    outer = (p**2).sum()
    first = torch.autograd.grad(outer, (w, lr), create_graph=True)
    second = torch.autograd.grad(first[0].sum() + first[1], (w, lr))
    return (*first, *second)


def test_meta_gradients_stay_finite_where_the_second_moment_is_zero() -> None:
    assert any(not torch.isfinite(g).all() for g in _zero_gradient_meta_grads(sqrt_free_of_nan=False))
    grads = _zero_gradient_meta_grads(sqrt_free_of_nan=True)
    assert all(torch.isfinite(g).all() for g in grads), grads
    assert grads[1].abs() > 0


def test_adam_with_eps_root_and_safe_sqrt_agree_in_value() -> None:
    """``safe_sqrt`` only changes derivatives: the recorded and the plain step give the same numbers."""
    params = {"w": torch.tensor([0.5, -1.0, 2.0])}
    grads = {"w": torch.tensor([0.0, 1e-3, -4.0])}
    tx = fadam.scale_by_adam()
    plain, _ = tx.update(grads, tx.init(params))
    recorded, _ = tx.update({"w": grads["w"].clone().requires_grad_()}, tx.init(params))
    assert recorded["w"].grad_fn is not None
    assert torch.equal(plain["w"], recorded["w"].detach())


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16, torch.complex64], ids=str)
def test_recorded_adam_steps_equal_the_plain_ones_bit_for_bit(dtype: torch.dtype) -> None:
    """The graph path (float bias corrections, intermediates rewritten in place, the zero check skipped once the
    second moment is positive) computes the very numbers of the no-graph path, step after step, 0-d leaves too."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"matrix": (5, 7), "vector": (9,), "scalar": ()}
    params = {k: torch.randn(shape, generator=gen).to(dtype) for k, shape in shapes.items()}
    for tx in (fadam.adam(lr=0.1), fadam.adam(lr=0.1, amsgrad=True), fadam.adamw(lr=0.1, betas=(0.5, 0.4))):
        plain_params, plain_state = params, tx.init(params)
        recorded_params = {k: v.clone().requires_grad_() for k, v in params.items()}
        recorded_state = tx.init(params)
        for step in range(4):
            grads = {k: (torch.randn(v.shape, generator=gen) * (step % 2)).to(dtype) for k, v in params.items()}
            updates, plain_state = tx.update(grads, plain_state, plain_params)  # the chain, not the fused kernel
            plain_params = fadam.apply_updates(plain_params, updates)
            recorded_grads = {k: g + 0 * recorded_params[k] for k, g in grads.items()}  # in the graph
            updates, recorded_state = tx.update(recorded_grads, recorded_state, recorded_params)
            recorded_params = fadam.apply_updates(recorded_params, updates)
            for k in params:
                assert recorded_params[k].grad_fn is not None
                assert torch.equal(recorded_params[k].detach(), plain_params[k]), (tx, step, k)


def test_moment_requires_grad_puts_the_initial_moments_in_the_graph() -> None:
    params = {"w": torch.tensor([0.3, -0.7], dtype=F64)}
    for tx, moments in [
        (fadam.adam(lr=0.1, moment_requires_grad=True), lambda s: (s[0].mu["w"], s[0].nu["w"])),
        (fadam.sgd(lr=0.1, momentum=0.9, moment_requires_grad=True), lambda s: (s[0].trace["w"],)),
    ]:
        state = tx.init(params)
        leaves = moments(state)
        assert all(m.requires_grad and m.is_leaf for m in leaves)
        p = params
        for _ in range(3):
            p, state = fadam.step(tx, p, {"w": 2 * p["w"] - 1}, state)
        grads = torch.autograd.grad(p["w"].sum(), leaves)
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("donate", [False, True])
def test_step_never_fuses_or_writes_in_place_when_a_graph_is_needed(donate: bool) -> None:
    """Plain params and grads, but a hyperparameter that requires grad: the fused kernel (which takes numbers) and
    the donated in-place add would both cut the graph to it."""
    for make in [
        lambda h: fadam.adam(lr=h),
        lambda h: fadam.adam(lr=0.1, betas=(h, torch.tensor(0.999) if isinstance(h, torch.Tensor) else 0.999)),
        lambda h: fadam.adamw(lr=0.1, weight_decay=h),
        lambda h: fadam.sgd(lr=h, momentum=0.9),
        lambda h: fadam.sgd(lr=0.1, momentum=h),
    ]:
        h = torch.tensor(0.5, requires_grad=True)
        params = {"w": torch.ones(3)}
        results = []
        for tx in (make(h), make(0.5)):
            new_params, state = params, tx.init(params)
            for g in (0.5, -0.3):  # the gradient changes, or beta1 would cancel out of Adam's first steps
                new_params, state = fadam.step(tx, new_params, {"w": torch.full((3,), g)}, state, donate=donate)
            results.append(new_params["w"])
        (dh,) = torch.autograd.grad(results[0].sum(), h)
        assert dh != 0
        torch.testing.assert_close(results[0].detach(), results[1])
        if not donate:
            assert torch.equal(params["w"], torch.ones(3))


@pytest.mark.parametrize("with_zero", [True, False], ids=["general-path", "cpu-no-zero-path"])
def test_safe_sqrt_values_and_derivatives(with_zero: bool) -> None:
    from fadam._numerics import safe_sqrt

    x = torch.tensor([0.0 if with_zero else 0.25, 4.0, 2.0], dtype=F64, requires_grad=True)
    assert torch.equal(safe_sqrt(x), torch.sqrt(x))
    (first,) = torch.autograd.grad(safe_sqrt(x).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), x)
    expected_first, expected_second = 0.5 * x.detach() ** -0.5, -0.25 * x.detach() ** -1.5
    if with_zero:
        expected_first[0] = expected_second[0] = 0.0
    torch.testing.assert_close(first, expected_first, rtol=1e-12, atol=0)
    torch.testing.assert_close(second, expected_second, rtol=1e-12, atol=0)
    special = torch.tensor([float("nan"), -1.0, float("inf"), 0.0])
    torch.testing.assert_close(safe_sqrt(special), torch.sqrt(special).abs(), equal_nan=True)  # NaN stays NaN
    # inside torch.func (vmap over rows, one with a zero) the general path runs and agrees
    rows = torch.tensor([[0.0, 1.0], [4.0, 9.0]])
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(lambda v: safe_sqrt(v).sum()))(rows),
        torch.tensor([[0.0, 0.5], [0.25, 1 / 6]]),
    )


def _other_transforms(h: torch.Tensor) -> list[tuple[str, fadam.GradientTransformation]]:
    """Every other transform and combinator, each made to depend on the hyperparameter tensor ``h``."""
    return [
        ("clip", fadam.chain(fadam.clip(h), fadam.scale(-0.1))),
        ("scale_by_schedule", fadam.scale_by_schedule(lambda count: -h / (count + 1))),
        (
            "add_decayed_weights-mask",
            fadam.chain(fadam.add_decayed_weights(h, mask={"w": True, "b": False}), fadam.sgd(0.1)),
        ),
        ("add_decoupled_weight_decay", fadam.chain(fadam.scale(-0.1), fadam.add_decoupled_weight_decay(0.1, h))),
        ("masked", fadam.masked(fadam.adam(lr=h), {"w": True, "b": False})),
        (
            "partition",
            fadam.partition({"a": fadam.adam(lr=h), "s": fadam.sgd(lr=h, momentum=0.5)}, {"w": "a", "b": "s"}),
        ),
        (
            "named_chain",
            fadam.named_chain(("adam", fadam.scale_by_adam(b1=h)), ("lr", fadam.scale_by_learning_rate(0.1))),
        ),
        ("sgd-dampening", fadam.sgd(lr=0.1, momentum=h, dampening=0.3)),
        (
            "adam-eps_root-nesterov",
            fadam.chain(fadam.scale_by_adam(eps_root=1e-6, nesterov=True, b1=h), fadam.scale(-0.1)),
        ),
        ("amsgrad-maximize", fadam.adam(lr=h, amsgrad=True, maximize=True)),
    ]


@pytest.mark.parametrize("index", range(10), ids=lambda i: _other_transforms(torch.tensor(0.5))[i][0])
def test_every_transform_is_differentiable_in_params_and_hyperparameters(index: int) -> None:
    def fn(w: torch.Tensor, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        tx = _other_transforms(h)[index][1]
        params = {"w": w, "b": b}
        return unrolled_loop(tx, params, steps=3)

    inputs = [PARAMS0["w"].clone().requires_grad_(), PARAMS0["b"].clone().requires_grad_()]
    inputs.append(torch.tensor(0.5, dtype=F64, requires_grad=True))
    grads = torch.autograd.grad(fn(*inputs), inputs)
    assert grads[-1].abs() > 1e-8  # the hyperparameter is really in the graph
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("case", DIRECT_CASES, ids=str)
def test_a_meta_learned_lr_in_the_inject_state_gets_the_gradient_of_the_lr_passed_directly(case: Case) -> None:
    """Three outer Adam steps on the inner learning rate, kept once in ``InjectHyperparamsState.hyperparams["lr"]``
    and once passed to the factory: the same hypergradients and the same learned lr, bit for bit."""

    def direct(lr: torch.Tensor) -> tuple[fadam.GradientTransformation, Any]:
        tx = case.factory(**{**case.hparams, "lr": lr}, **case.static)
        return tx, None

    def injected(lr: torch.Tensor) -> tuple[fadam.GradientTransformation, Any]:
        tx = fadam.inject_hyperparams(case.factory)(**case.hparams, **case.static)
        state = tx.init(PARAMS0)
        return tx, state._replace(hyperparams={**state.hyperparams, "lr": lr})

    def meta_learn(make: Callable) -> list[torch.Tensor]:
        lr = torch.tensor(case.hparams["lr"], dtype=F64)
        outer_tx = fadam.adam(lr=0.01)
        outer_state = outer_tx.init(lr)
        seen = []
        for _ in range(3):
            lr = lr.detach().requires_grad_()
            params = {k: v.clone().requires_grad_() for k, v in PARAMS0.items()}
            tx, state = make(lr)
            (grad,) = torch.autograd.grad(unrolled_loop(tx, params, STEPS, state), lr)
            lr, outer_state = fadam.step(outer_tx, lr.detach(), grad, outer_state)
            seen += [grad, lr]
        return seen

    expected, actual = meta_learn(direct), meta_learn(injected)
    assert expected[0].abs() > 1e-6
    assert not torch.equal(expected[1], torch.tensor(case.hparams["lr"], dtype=F64))  # the lr really moved
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a, e), (i, a, e)
