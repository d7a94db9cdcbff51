"""fadam.lbfgs against torch.optim.LBFGS: 300-step float64 trajectories through fadam.Optimizer.step(closure), with
and without the strong Wolfe line search, the functional update, live group options and the refusals."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

import fadam

STEPS = 300


def _rosenbrock() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor], dict]:
    model = torch.nn.ParameterDict(
        {"x": torch.nn.Parameter(torch.tensor([-1.2, 1.0, -0.5, 1.5, 0.3, -1.0], dtype=torch.float64))}
    )

    def loss(m: torch.nn.Module) -> torch.Tensor:
        x = m["x"]
        return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()

    return model, loss, {"max_iter": 3, "history_size": 4}


def _least_squares() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor], dict]:
    gen = torch.Generator().manual_seed(0)
    # columns scaled over four decades: an ill-conditioned problem that takes many iterations
    a = torch.randn(40, 6, generator=gen, dtype=torch.float64) * torch.logspace(0, 2, 6, dtype=torch.float64)
    b = torch.randn(40, generator=gen, dtype=torch.float64)
    torch.manual_seed(3)
    model = torch.nn.Linear(6, 1).double()

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return 0.5 * (m(a).squeeze(1) - b).pow(2).sum()

    return model, loss, {"max_iter": 2, "history_size": 3, "lr": 0.5}


def _mlp() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor], dict]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return (m(x) - y).pow(2).mean()

    return model, loss, {"history_size": 10}


PROBLEMS = {"rosenbrock": _rosenbrock, "least_squares": _least_squares, "mlp": _mlp}


def _closure(opt: torch.optim.Optimizer, model: torch.nn.Module, loss: Callable) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = loss(model)
        value.backward()
        return value

    return closure


def _pair(problem: str, line_search_fn: str | None, **overrides):
    """A torch model under torch.optim.LBFGS and its copy under fadam.Optimizer (named params, whose sorted names
    differ from the order given), with the same options."""
    model, loss, options = PROBLEMS[problem]()
    options = {"lr": 1, **options, **overrides, "line_search_fn": line_search_fn}  # fadam.Optimizer needs an lr
    twin = PROBLEMS[problem]()[0]
    twin.load_state_dict(model.state_dict())
    theirs = torch.optim.LBFGS(model.parameters(), **options)
    ours = fadam.Optimizer(twin.named_parameters(), fadam.lbfgs, **options)
    return (model, theirs), (twin, ours), loss


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_trajectory_equals_torch_lbfgs(problem, line_search_fn):
    (model, theirs), (twin, ours), loss = _pair(problem, line_search_fn)
    with torch.no_grad():
        start = float(loss(model))
    worst = 0.0
    for _ in range(STEPS):
        their_loss = theirs.step(_closure(theirs, model, loss))
        our_loss = ours.step(_closure(ours, twin, loss))
        assert our_loss.item() == their_loss.item()
        worst = max(worst, _max_diff(model, twin))
    assert worst <= 1e-12
    with torch.no_grad():
        assert float(loss(twin)) < start / 100  # the runs went somewhere
    torch_state, state = theirs.state[next(model.parameters())], ours.tx_states[0]
    assert (int(state.func_evals), int(state.n_iter)) == (torch_state["func_evals"], torch_state["n_iter"])
    assert torch_state["n_iter"] >= STEPS  # steps that iterate, not ones that find a gradient of 0
    assert float((state.d - torch_state["d"]).abs().max()) <= 1e-12
    used = int(state.num_old)
    assert used == len(torch_state["old_dirs"])
    for ours_y, theirs_y in zip(state.old_dirs[:used], torch_state["old_dirs"]):
        assert float((ours_y - theirs_y).abs().max()) <= 1e-12


def test_the_closure_runs_at_each_point_torch_evaluates():
    calls: dict[str, int] = {"torch": 0, "fadam": 0}
    (model, theirs), (twin, ours), loss = _pair("mlp", "strong_wolfe")

    def counted(opt, m, name):
        inner = _closure(opt, m, loss)

        def closure():
            calls[name] += 1
            return inner()

        return closure

    for _ in range(5):
        theirs.step(counted(theirs, model, "torch"))
        ours.step(counted(ours, twin, "fadam"))
    assert calls["fadam"] == calls["torch"] > 5


def test_live_group_options_and_lr_scheduler_follow_torch():
    (model, theirs), (twin, ours), loss = _pair("mlp", None, max_iter=4)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5) for opt in (theirs, ours)]
    for step in range(40):
        if step == 15:  # switched on mid-run, as a group option
            for opt in (theirs, ours):
                opt.param_groups[0]["line_search_fn"] = "strong_wolfe"
                opt.param_groups[0]["max_iter"] = 6
        theirs.step(_closure(theirs, model, loss))
        ours.step(_closure(ours, twin, loss))
        for scheduler in schedulers:
            scheduler.step()
    assert ours.param_groups[0]["lr"] == 0.0625
    assert ours.param_groups[0]["max_eval"] == theirs.param_groups[0]["max_eval"] == 5  # from max_iter at the start
    assert _max_diff(model, twin) <= 1e-12


def test_a_state_dict_resumes_the_same_trajectory():
    (model, theirs), (twin, ours), loss = _pair("mlp", "strong_wolfe")
    for _ in range(5):
        theirs.step(_closure(theirs, model, loss))
        ours.step(_closure(ours, twin, loss))
    saved = ours.state_dict()
    resumed = fadam.Optimizer(
        twin.named_parameters(), fadam.lbfgs, lr=1, history_size=10, line_search_fn="strong_wolfe"
    )
    resumed.load_state_dict(saved)
    for _ in range(10):
        theirs.step(_closure(theirs, model, loss))
        resumed.step(_closure(resumed, twin, loss))
    assert _max_diff(model, twin) <= 1e-12
    assert int(resumed.tx_states[0].func_evals) == theirs.state[next(model.parameters())]["func_evals"]


def test_functional_update_with_value_fn():
    """The optax-style call: value and value_fn as extra args, updates applied with apply_updates."""
    model, loss, options = _rosenbrock()
    theirs = torch.optim.LBFGS(model.parameters(), line_search_fn="strong_wolfe", **options)
    tx = fadam.lbfgs(line_search_fn="strong_wolfe", **options)
    params = {"x": model["x"].detach().clone()}

    def value_fn(params: dict) -> tuple[torch.Tensor, dict]:
        x = params["x"].detach().requires_grad_()
        value = loss({"x": x})
        return value.detach(), {"x": torch.autograd.grad(value, x)[0]}

    state = tx.init(params)
    for _ in range(50):
        theirs.step(_closure(theirs, model, loss))
        value, grads = value_fn(params)
        updates, state = tx.update(grads, state, params, value=value, value_fn=value_fn)
        params = fadam.apply_updates(params, updates)
    with torch.no_grad():
        assert float(loss(params)) < float(loss(model)) + 1e-9 < 10  # from 907.5
    assert float((params["x"] - model["x"].detach()).abs().max()) <= 1e-9  # params + updates: last-bit roundings


def test_a_fixed_step_of_lr_on_a_quadratic_from_the_second_iteration():
    """The first step is scaled to min(1, 1 / |g|_1) lr; then the two-loop recursion on an exact quadratic."""
    tx = fadam.lbfgs(max_iter=3, history_size=2)  # max_eval 3: the evaluation after the second move ends it
    params = [torch.tensor([1.0, 2.0], dtype=torch.float64)]
    scale = torch.tensor([1.0, 4.0], dtype=torch.float64)

    def value_fn(params):
        return float(0.5 * (scale * params[0] ** 2).sum()), [scale * params[0]]

    value, grads = value_fn(params)
    _, state = tx.update.minimize(grads, tx.init(params), params, value=value, value_fn=value_fn)
    first = params[0] - grads[0] / grads[0].abs().sum()  # t = 1 / |g|_1 = 1 / 9 along -g
    torch.testing.assert_close(state.prev_flat_grad, scale * first, rtol=0, atol=1e-15)
    assert (int(state.n_iter), int(state.func_evals), int(state.num_old)) == (2, 3, 1)


def test_refusals_have_torch_messages():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(RuntimeError, match="only 'strong_wolfe' is supported"):
        fadam.lbfgs(line_search_fn="armijo")
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        fadam.lbfgs(lr=-1)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        fadam.lbfgs(lr=torch.ones(2))
    with pytest.raises(ValueError, match="doesn't support per-parameter options"):
        fadam.Optimizer([{"params": [w]}, {"params": [torch.nn.Parameter(torch.ones(1))]}], fadam.lbfgs, lr=1)
    opt = fadam.Optimizer([w], fadam.lbfgs, lr=1)
    w.grad = torch.ones(2)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'closure'"):
        opt.step()
    tx = fadam.lbfgs()
    with pytest.raises(ValueError, match="value_fn"):
        tx.update([torch.ones(2)], tx.init([torch.ones(2)]), [torch.ones(2)])


def test_an_optimal_start_moves_nothing_and_counts_the_evaluation():
    model = torch.nn.Linear(2, 1).double()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = fadam.Optimizer(model.parameters(), fadam.lbfgs, lr=1)
    closure = _closure(opt, model, lambda m: m(torch.ones(1, 2, dtype=torch.float64)).pow(2).sum())
    assert opt.step(closure).item() == 0.0
    assert (int(opt.tx_states[0].func_evals), int(opt.tx_states[0].n_iter)) == (1, 0)
    assert all(float(p.abs().max()) == 0.0 for p in model.parameters())


def test_a_changed_history_size_keeps_the_newest_pairs():
    tx, smaller = fadam.lbfgs(history_size=4, max_iter=6), fadam.lbfgs(history_size=2, max_iter=1)
    params = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)]
    scale = torch.tensor([1.0, 3.0, 9.0], dtype=torch.float64)
    value_fn = functools.partial(_quadratic, scale)
    value, grads = value_fn(params)
    params, state = tx.update.minimize(grads, tx.init(params), params, value=value, value_fn=value_fn)
    assert int(state.num_old) == 4
    value, grads = value_fn(params)
    _, resized = smaller.update.minimize(grads, state, params, value=value, value_fn=value_fn)
    assert len(resized.old_dirs) == 2 and int(resized.num_old) == 2
    assert resized.old_dirs[0] is state.old_dirs[3]  # the newest of the old pairs, then the new one


def _quadratic(scale: torch.Tensor, params: list) -> tuple[float, list]:
    return float(0.5 * (scale * params[0] ** 2).sum()), [scale * params[0]]
