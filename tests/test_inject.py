"""inject_hyperparams: bit-identical to the plain optimizer, readable/writable hyperparameters, schedules, gradients
through hyperparameters, vmap."""

from __future__ import annotations

import pytest
import torch

import fadam

CONFIGS = [
    (fadam.adam, {"lr": 1e-2}),
    (fadam.adam, {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True}),
    (fadam.adam, {"lr": 1e-2, "weight_decay": 0.05, "maximize": True}),
    (fadam.adamw, {"lr": 1e-2}),
    (fadam.adamw, {"lr": 7e-3, "weight_decay": 0.3, "amsgrad": True}),
    (fadam.sgd, {"lr": 1e-2}),
    (fadam.sgd, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    (fadam.sgd, {"lr": 1e-2, "momentum": 0.8, "dampening": 0.3, "maximize": True}),
]


def _config_id(config: tuple) -> str:
    make, kwargs = config
    return make.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kwargs.items())


def _params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(7, 5, generator=gen).to(dtype), "b": torch.randn(33, generator=gen).to(dtype)}
    if dtype == torch.float32:
        params["z"] = torch.randn(4, dtype=torch.complex64, generator=gen)
    return params


def _grads(params: dict, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {k: (torch.randn(v.shape, dtype=torch.float64, generator=gen) * 3).to(v.dtype) for k, v in params.items()}


def _trajectory(tx: fadam.GradientTransformation, dtype: torch.dtype, steps: int = 6, fused: bool = False) -> list:
    params = _params(dtype)
    state = tx.init(params)
    out = []
    for step in range(steps):
        grads = _grads(params, step)
        if fused:
            params, state = fadam.step(tx, params, grads, state)
        else:
            updates, state = tx.update(grads, state, params)
            params = fadam.apply_updates(params, updates)
        out.append(params)
    return out


def _assert_bit_identical(a: list, b: list) -> None:
    for step, (pa, pb) in enumerate(zip(a, b)):
        for key in pa:
            assert torch.equal(pa[key], pb[key]), f"step {step} leaf {key}: max diff {(pa[key] - pb[key]).abs().max()}"


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bit_identical_to_the_plain_optimizer(config, dtype):
    make, kwargs = config
    plain = _trajectory(make(**kwargs), dtype)
    _assert_bit_identical(plain, _trajectory(fadam.inject_hyperparams(make)(**kwargs), dtype))


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_fused_step_is_kept_and_bit_identical(config):
    make, kwargs = config
    plain = _trajectory(make(**kwargs), torch.float32, fused=True)
    _assert_bit_identical(plain, _trajectory(fadam.inject_hyperparams(make)(**kwargs), torch.float32, fused=True))


def test_hyperparams_are_float64_tensors_and_flags_stay_static():
    tx = fadam.inject_hyperparams(fadam.adam)(lr=1e-3, amsgrad=True, betas=(0.9, 0.99))
    state = tx.init({"w": torch.zeros(2)})
    assert sorted(state.hyperparams) == ["betas", "eps", "lr", "weight_decay"]  # amsgrad (a bool) stays static
    assert all(v.dtype == torch.float64 for v in state.hyperparams.values())
    assert state.hyperparams["betas"].tolist() == [0.9, 0.99] and state.hyperparams["lr"].shape == ()
    assert float(state.hyperparams["lr"]) == 1e-3
    assert isinstance(state.inner_state[0], fadam.ScaleByAmsgradState)
    state32 = fadam.inject_hyperparams(fadam.adam, hyperparam_dtype=torch.float32)(lr=1e-3).init({"w": torch.zeros(2)})
    assert state32.hyperparams["lr"].dtype == torch.float32
    # a schedule's value is cast too, and the factory uses the cast value
    tx = fadam.inject_hyperparams(fadam.sgd, hyperparam_dtype=torch.float32)(lr=fadam.constant_schedule(0.1))
    params, grads = {"w": torch.ones(3, dtype=torch.float64)}, {"w": torch.full((3,), 3.0, dtype=torch.float64)}
    updates, state = tx.update(grads, tx.init(params), params)
    assert state.hyperparams["lr"].dtype == torch.float32
    assert torch.equal(updates["w"], grads["w"] * -torch.tensor(0.1, dtype=torch.float32).double())


@pytest.mark.parametrize("make", [fadam.adam, fadam.adamw, fadam.sgd])
def test_schedules_match_the_plain_optimizer_and_are_logged(make):
    lr = fadam.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=2, decay_steps=6)
    wd = fadam.linear_schedule(0.1, 0.0, 4)
    kwargs = {"lr": lr, "weight_decay": wd, **({"momentum": 0.9} if make is fadam.sgd else {})}
    plain = _trajectory(make(**kwargs), torch.float32)
    wrapped_tx = fadam.inject_hyperparams(make)(**kwargs)
    _assert_bit_identical(plain, _trajectory(wrapped_tx, torch.float32))
    params = _params(torch.float32)
    state = wrapped_tx.init(params)
    for step in range(5):
        _, state = wrapped_tx.update(_grads(params, step), state, params)
        assert float(state.hyperparams["lr"]) == float(lr(torch.tensor(step)))  # the lr this step used
        assert float(state.hyperparams["weight_decay"]) == float(wd(torch.tensor(step)))
        assert int(state.count) == step + 1


def test_overwritten_lr_is_used_by_the_next_step():
    params = _params(torch.float32)
    tx = fadam.inject_hyperparams(fadam.adamw)(lr=0.1, weight_decay=0.1)
    state = tx.init(params)
    _, state = tx.update(_grads(params, 0), state, params)
    state = state._replace(hyperparams={**state.hyperparams, "lr": torch.tensor(1e-4)})
    updates, new_state = tx.update(_grads(params, 1), state, params)
    # the same step by a plain adamw built with the new value, from the same inner state
    want, _ = fadam.adamw(lr=float(torch.tensor(1e-4)), weight_decay=0.1).update(
        _grads(params, 1), state.inner_state, params
    )
    for key in want:
        assert torch.equal(updates[key], want[key])
    assert new_state.hyperparams["lr"].dtype == torch.float64  # the state keeps its dtypes
    assert float(new_state.hyperparams["lr"]) == float(torch.tensor(1e-4))


def test_hyperparameter_gradients_flow_into_the_update():
    params = {"w": torch.tensor([1.0, -2.0, 3.0])}
    grads = {"w": torch.tensor([0.5, 0.25, -1.0])}
    # a tensor given by the user
    lr = torch.tensor(0.1, requires_grad=True)
    tx = fadam.inject_hyperparams(fadam.sgd)(lr=lr, momentum=0.9)
    updates, _ = tx.update(grads, tx.init(params), params)
    fadam.apply_updates(params, updates)["w"].sum().backward()
    assert torch.allclose(lr.grad, -grads["w"].sum())
    # a Python float made differentiable in the state (meta-learning the lr of Adam)
    tx = fadam.inject_hyperparams(fadam.adam)(lr=0.1)
    state = tx.init(params)
    meta_lr = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    state = state._replace(hyperparams={**state.hyperparams, "lr": meta_lr})
    updates, state = tx.update(grads, state, params)
    direction = fadam.adam(lr=1.0).update(grads, fadam.adam(lr=1.0).init(params), params)[0]["w"]
    (fadam.apply_updates(params, updates)["w"] ** 2).sum().backward()
    new_w = params["w"] + 0.05 * direction
    torch.testing.assert_close(meta_lr.grad, (2 * new_w * direction).sum().double())
    assert state.hyperparams["lr"].requires_grad


def test_vmap_over_params_and_over_learning_rates():
    tx = fadam.inject_hyperparams(fadam.adam)(lr=fadam.linear_schedule(0.1, 0.01, 5), weight_decay=0.01)
    batch = torch.randn(4, 6)
    grads = torch.randn(4, 6)

    def one(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        state = tx.init({"w": p})
        for _ in range(3):
            updates, state = tx.update({"w": g}, state, {"w": p})
            p = fadam.apply_updates({"w": p}, updates)["w"]
        return p

    torch.testing.assert_close(
        torch.func.vmap(one)(batch, grads), torch.stack([one(p, g) for p, g in zip(batch, grads)])
    )

    # a sweep of learning rates as one batched hyperparameter
    sweep = fadam.inject_hyperparams(fadam.adam)(lr=0.1)
    params = {"w": batch[0]}
    state = sweep.init(params)

    def with_lr(lr: torch.Tensor) -> torch.Tensor:
        updates, _ = sweep.update({"w": grads[0]}, state._replace(hyperparams={**state.hyperparams, "lr": lr}), params)
        return updates["w"]

    lrs = torch.tensor([0.1, 0.01, 0.001], dtype=torch.float64)
    got = torch.func.vmap(with_lr)(lrs)
    want = torch.stack(
        [fadam.adam(lr=float(lr)).update({"w": grads[0]}, state.inner_state, params)[0]["w"] for lr in lrs]
    )
    torch.testing.assert_close(got, want)


def test_bad_arguments_and_states_are_named():
    with pytest.raises(ValueError, match="not arguments of adam"):
        fadam.inject_hyperparams(fadam.adam, static_args=("learning_rate",))
    with pytest.raises(ValueError, match="takes \\*args"):
        fadam.inject_hyperparams(fadam.chain)
    tx = fadam.inject_hyperparams(fadam.sgd)(lr=0.1)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    with pytest.raises(ValueError, match="'lrr'"):
        tx.update(params, state._replace(hyperparams={**state.hyperparams, "lrr": torch.tensor(1.0)}), params)
    with pytest.raises(ValueError, match="lacks 'momentum'"):
        tx.update(params, state._replace(hyperparams={"lr": torch.tensor(1.0)}), params)
    with pytest.raises(ValueError, match="InjectHyperparamsState"):
        tx.update(params, state.inner_state, params)


def test_static_args_keep_a_callable_and_extra_args_reach_the_inner_transform():
    seen = {}

    def factory(scale: float, fn=None) -> fadam.GradientTransformation:
        def update(updates, state, params=None, **extra):
            seen.update(extra)
            return fadam.tree_map(lambda u: fn(u) * scale, updates), state

        return fadam.GradientTransformation(lambda params: fadam.EmptyState(), update)

    tx = fadam.inject_hyperparams(factory, static_args="fn")(scale=2.0, fn=torch.neg)
    state = tx.init([torch.ones(1)])
    assert list(state.hyperparams) == ["scale"]
    updates, _ = tx.update([torch.ones(1)], state, loss=3.0)
    assert updates[0].item() == -2.0 and seen == {"loss": 3.0}


@pytest.mark.slow
def test_compiled_step_does_not_recompile_as_the_scheduled_lr_changes():
    # Under torch.compile the factory receives the hyperparameters as tensors, so new values do not recompile.
    # weight_decay is static: its value decides whether adam's chain has a decay transform.
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    tx = fadam.inject_hyperparams(fadam.adam, static_args=("weight_decay",))(
        lr=fadam.warmup_cosine_decay_schedule(0.0, 0.1, 2, 20)
    )
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def compiled_step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return fadam.apply_updates(params, updates), state

    params = _params(torch.float32)
    state, eager_params, eager_state = tx.init(params), params, tx.init(params)
    for step in range(5):
        grads = _grads(params, step)
        params, state = compiled_step(params, grads, state)
        updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = fadam.apply_updates(eager_params, updates)
        if step == 0:
            frames = counter.frame_count
        for key in params:
            torch.testing.assert_close(params[key], eager_params[key], rtol=1e-6, atol=1e-7)
    assert counter.frame_count == frames  # the lr changed every step (0, 0.05, 0.1, ...) and nothing recompiled
    assert float(state.hyperparams["lr"]) == float(eager_state.hyperparams["lr"]) > 0


def test_a_float_written_over_an_int_hyperparameter_is_neither_truncated_nor_cut_from_the_graph():
    tx = fadam.inject_hyperparams(fadam.sgd)(lr=1, momentum=0.9)  # lr given as a Python int: stored as int64
    params, grads = {"w": torch.tensor([1.0, -2.0])}, {"w": torch.tensor([0.5, 0.25])}
    state = tx.init(params)
    assert state.hyperparams["lr"].dtype == torch.int64
    meta_lr = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    updates, new_state = tx.update(grads, state._replace(hyperparams={**state.hyperparams, "lr": meta_lr}), params)
    torch.testing.assert_close(updates["w"], -0.5 * grads["w"])
    assert new_state.hyperparams["lr"] is meta_lr
    (dlr,) = torch.autograd.grad(updates["w"].sum(), meta_lr)
    assert dlr == -0.75
    # a Python float written over it is read as a float too, as at construction
    updates, new_state = tx.update(grads, state._replace(hyperparams={**state.hyperparams, "lr": 0.25}), params)
    torch.testing.assert_close(updates["w"], -0.25 * grads["w"])
    assert new_state.hyperparams["lr"].dtype == torch.float64
    # an int written over a float hyperparameter is still cast to the float's dtype
    _, new_state = tx.update(grads, state._replace(hyperparams={**state.hyperparams, "momentum": 1}), params)
    assert new_state.hyperparams["momentum"].dtype == torch.float64


def test_a_tuple_of_numbers_is_injected_as_one_vector():
    """``betas`` lives in the state as a 1-d tensor; writing a tuple of tensors that require grad meta-learns both
    betas, writing plain numbers changes them, and a wrong length is refused before any math."""
    tx = fadam.inject_hyperparams(fadam.adam)(lr=0.1, betas=(0.9, 0.99))
    params, grads = {"w": torch.tensor([1.0, -2.0])}, {"w": torch.tensor([0.5, 0.25])}
    state = tx.init(params)
    b1, b2 = torch.tensor(0.8, dtype=torch.float64, requires_grad=True), torch.tensor(0.9, requires_grad=True)
    steps = [grads, {"w": torch.tensor([-1.0, 2.0])}]  # beta1 cancels out while the gradient stays the same
    for g in steps:
        updates, state = tx.update(g, state._replace(hyperparams={**state.hyperparams, "betas": (b1, b2)}), params)
        params = fadam.apply_updates(params, updates)
    assert state.hyperparams["betas"].dtype == torch.float64  # cast to the stored dtype, graph kept
    d_b1, d_b2 = torch.autograd.grad(params["w"].sum(), (b1, b2))
    assert d_b1 != 0 and d_b2 != 0
    expected = fadam.adam(lr=0.1, betas=(0.8, 0.9))
    plain = {"w": torch.tensor([1.0, -2.0])}
    plain_state = expected.init(plain)
    for g in steps:
        updates, plain_state = expected.update(g, plain_state, plain)
        plain = fadam.apply_updates(plain, updates)
    torch.testing.assert_close(params["w"].detach(), plain["w"], rtol=1e-6, atol=1e-7)
    written = state._replace(hyperparams={**state.hyperparams, "betas": (0.5, 0.6)})
    tx.update(grads, written, params)  # plain numbers are accepted
    for wrong in [(0.5,), torch.tensor([0.5, 0.6, 0.7]), torch.tensor(0.5)]:
        with pytest.raises(ValueError, match="hyperparams\\['betas'\\] must hold 2 values"):
            tx.update(grads, state._replace(hyperparams={**state.hyperparams, "betas": wrong}), params)
