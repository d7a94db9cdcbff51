"""state_from_torch / state_to_torch for Adadelta, ASGD, Rprop, torch's Adafactor and Muon: a run switches sides
mid-way and continues on the same float64 trajectory, in both directions."""

from __future__ import annotations

import functools

import pytest
import torch

import fadam

# (fadam transform, torch.optim optimizer, whether the model has 1-D params: Muon takes matrices only)
CASES = {
    "adadelta": (functools.partial(fadam.adadelta, lr=1.0), functools.partial(torch.optim.Adadelta, lr=1.0), True),
    "asgd": (
        functools.partial(fadam.asgd, lr=1e-2, t0=3.0),  # averaging from step 4 on: mu below 1 after the switch
        functools.partial(torch.optim.ASGD, lr=1e-2, t0=3.0),
        True,
    ),
    "rprop": (functools.partial(fadam.rprop, lr=1e-2), functools.partial(torch.optim.Rprop, lr=1e-2), True),
    "adafactor": (
        functools.partial(fadam.adafactor_torch, lr=1e-2),
        functools.partial(torch.optim.Adafactor, lr=1e-2, foreach=False),
        True,
    ),
    "muon": (functools.partial(fadam.muon, lr=2e-2), functools.partial(torch.optim.Muon, lr=2e-2), False),
}


def _model(bias: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5, bias=bias), torch.nn.Tanh(), torch.nn.Linear(5, 3, bias=bias))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _train_torch(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model(_inputs(step))).backward()
        opt.step()


def _train_fadam(tx, model, params, state, start, steps):
    def loss(params, step):
        return _loss(torch.func.functional_call(model, params, (_inputs(step),)))

    for step in range(start, start + steps):
        params, state = fadam.step(tx, params, torch.func.grad(loss)(params, step), state)
    return params, state


def _max_diff(model: torch.nn.Module, params: dict) -> float:
    return max(float((p.detach() - params[name]).abs().max()) for name, p in model.named_parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_a_torch_run_continues_in_fadam(case):
    make_tx, make_opt, bias = CASES[case]
    model = _model(bias).double()
    opt = make_opt(model.parameters())
    _train_torch(model, opt, 0, 5)
    tx = make_tx()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = fadam.state_from_torch(opt.state_dict(), tx, params)
    _train_torch(model, opt, 5, 25)
    params, state = _train_fadam(tx, model, params, state, 5, 25)
    assert _max_diff(model, params) <= 1e-12
    assert _max_diff(_model(bias).double(), params) > 1e-3  # the runs moved the params


@pytest.mark.parametrize("case", list(CASES))
def test_a_fadam_run_continues_in_torch(case):
    make_tx, make_opt, bias = CASES[case]
    model = _model(bias).double()
    tx = make_tx()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    params, state = _train_fadam(tx, model, params, tx.init(params), 0, 5)
    twin = _model(bias).double()
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(params[name])
    opt = make_opt(twin.parameters())
    named = dict(twin.named_parameters())
    # adadelta and rprop keep no step count in fadam (their updates do not read it): it is given
    converted = fadam.state_to_torch(state, {k: named[k] for k in params}, opt, count=5)
    opt.load_state_dict(converted)
    assert set(opt.state[named["0.weight"]]) == set(_fresh_torch_state(make_opt, bias))
    _train_torch(twin, opt, 5, 25)
    params, state = _train_fadam(tx, model, params, state, 5, 25)
    assert _max_diff(twin, params) <= 1e-12


def _fresh_torch_state(make_opt, bias: bool) -> dict:
    """The keys torch.optim keeps for the first weight after one step of its own."""
    model = _model(bias).double()
    opt = make_opt(model.parameters())
    _train_torch(model, opt, 0, 1)
    return opt.state[model[0].weight]


def test_adafactor_keeps_row_and_column_statistics_of_matrices_and_a_full_moment_of_vectors():
    model = _model(True).double()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    _train_torch(model, opt, 0, 3)
    tx = fadam.adafactor_torch(lr=1e-2)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = fadam.state_from_torch(opt, tx, {k: dict(model.named_parameters())[k] for k in params})
    (inner,) = [s for s in state if isinstance(s, fadam.ScaleByAdafactorTorchState)]
    assert int(inner.count) == 3
    torch.testing.assert_close(inner.row_var["0.weight"], opt.state[model[0].weight]["row_var"], rtol=0, atol=0)
    torch.testing.assert_close(inner.variance["0.bias"], opt.state[model[0].bias]["variance"], rtol=0, atol=0)
    back = fadam.state_to_torch(state, dict(model.named_parameters()), opt)
    assert sorted(back["state"][0]) == ["col_var", "row_var", "step"]
    assert sorted(back["state"][1]) == ["step", "variance"]


def test_asgd_eta_and_mu_are_computed_from_the_count_as_torch_stores_them():
    model = _model(True).double()
    opt = torch.optim.ASGD(model.parameters(), lr=1e-2, lambd=1e-2, t0=2.0)
    _train_torch(model, opt, 0, 6)
    tx = fadam.asgd(lr=1e-2, lambd=1e-2, t0=2.0)
    params = list(model.parameters())
    state = fadam.state_from_torch(opt, tx, params)
    back = fadam.state_to_torch(state, params, opt)
    for index, p in enumerate(params):
        for key in ("eta", "mu", "step"):
            theirs = opt.state[p][key]
            assert back["state"][index][key].dtype == theirs.dtype
            assert float(back["state"][index][key]) == float(theirs), key


def test_state_to_torch_asks_adadelta_and_rprop_for_the_count():
    model = _model(True).double()
    params = list(model.parameters())
    for tx, opt in ((fadam.adadelta(lr=1.0), torch.optim.Adadelta(params)), (fadam.rprop(), torch.optim.Rprop(params))):
        detached = [p.detach() for p in params]
        state = tx.update([torch.ones_like(p) for p in detached], tx.init(detached), detached)[1]
        with pytest.raises(ValueError, match="adadelta, rprop\\): pass count="):
            fadam.state_to_torch(state, params, opt)


def test_a_torch_muon_state_dict_loads_into_a_fadam_optimizer():
    model = _model(False).double()
    opt = torch.optim.Muon(model.parameters(), lr=2e-2)
    _train_torch(model, opt, 0, 4)
    twin = _model(False).double()
    twin.load_state_dict(model.state_dict())
    ours = fadam.Optimizer(twin.parameters(), fadam.muon, lr=2e-2)
    ours.load_state_dict(opt.state_dict())
    _train_torch(model, opt, 4, 10)
    _train_torch(twin, ours, 4, 10)
    assert max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), twin.parameters())) <= 1e-12


# --- torch.optim.LBFGS: its state lives in its first param's dict; a run continues bit for bit on either side --------

LBFGS_KWARGS = {"lr": 0.5, "max_iter": 4, "history_size": 3}  # 4 iterations a step: the history fills, then shifts
# torch's keys once it has iterated, but its scratch list "al"
LBFGS_KEYS = ("func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss")


def _lbfgs_torch(model: torch.nn.Module, opt: torch.optim.LBFGS, start: int, steps: int) -> None:
    for step in range(start, start + steps):

        def closure(step: int = step) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(model(_inputs(step)))
            loss.backward()
            return loss

        opt.step(closure)


def _lbfgs_fadam(tx, model, params, state, start, steps):
    for step in range(start, start + steps):

        def value_fn(point, step=step):
            point = {name: p.detach().requires_grad_() for name, p in point.items()}
            loss = _loss(torch.func.functional_call(model, point, (_inputs(step),)))
            return loss.detach(), dict(zip(point, torch.autograd.grad(loss, list(point.values()))))

        loss, grads = value_fn(params)
        params, state = tx.update.minimize(grads, state, params, value=loss, value_fn=value_fn)
    return params, state


def _assert_same_params(model: torch.nn.Module, params: dict) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), params[name]), name


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_a_torch_lbfgs_run_continues_in_fadam_bit_for_bit(line_search_fn):
    model = _model(True).double()
    opt = torch.optim.LBFGS(model.parameters(), line_search_fn=line_search_fn, **LBFGS_KWARGS)
    _lbfgs_torch(model, opt, 0, 2)
    first = opt.state[model[0].weight]
    assert len(first["old_dirs"]) == 3 and "al" in first  # a full history; its scratch list is not converted
    tx = fadam.lbfgs(line_search_fn=line_search_fn, **LBFGS_KWARGS)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = fadam.state_from_torch(opt.state_dict(), tx, params)
    assert (int(state.n_iter), int(state.func_evals), int(state.num_old)) == (
        first["n_iter"],
        first["func_evals"],
        3,
    )
    _lbfgs_torch(model, opt, 2, 3)
    params, state = _lbfgs_fadam(tx, model, params, state, 2, 3)
    _assert_same_params(model, params)
    assert int(state.n_iter) == opt.state[model[0].weight]["n_iter"]
    assert _max_diff(_model(True).double(), params) > 1e-2  # the runs moved the params


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_a_fadam_lbfgs_run_continues_in_torch_bit_for_bit(line_search_fn):
    model = _model(True).double()
    tx = fadam.lbfgs(line_search_fn=line_search_fn, **LBFGS_KWARGS)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    params, state = _lbfgs_fadam(tx, model, params, tx.init(params), 0, 2)
    twin = _model(True).double()
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(params[name])
    opt = torch.optim.LBFGS(twin.parameters(), line_search_fn=line_search_fn, **LBFGS_KWARGS)
    opt.load_state_dict(fadam.state_to_torch(state, dict(twin.named_parameters()), opt))
    assert set(opt.state[twin[0].weight]) == set(LBFGS_KEYS)
    _lbfgs_torch(twin, opt, 2, 3)
    params, state = _lbfgs_fadam(tx, model, params, state, 2, 3)
    _assert_same_params(twin, params)


def test_lbfgs_state_before_any_iteration_converts_both_ways():
    model = _model(True).double()
    tx = fadam.lbfgs(**LBFGS_KWARGS)
    params = list(model.parameters())
    opt = torch.optim.LBFGS(params, **LBFGS_KWARGS)
    assert fadam.state_to_torch(tx.init([p.detach() for p in params]), params, opt)["state"] == {}
    relaxed = torch.optim.LBFGS(params, **{**LBFGS_KWARGS, "tolerance_grad": 1e9})  # optimal at the first evaluation
    _lbfgs_torch(model, relaxed, 0, 2)
    assert relaxed.state[params[0]] == {"func_evals": 2, "n_iter": 0}
    state = fadam.state_from_torch(relaxed, tx, params)
    assert (int(state.func_evals), int(state.n_iter), int(state.count)) == (2, 0, 1)
    assert fadam.state_to_torch(state, params, opt)["state"] == {0: {"func_evals": 2, "n_iter": 0}}


def test_lbfgs_state_that_does_not_convert_is_refused():
    model = _model(True).double()
    params = list(model.parameters())
    opt = torch.optim.LBFGS(params, **LBFGS_KWARGS)
    _lbfgs_torch(model, opt, 0, 2)
    tx = fadam.lbfgs(**LBFGS_KWARGS)
    with pytest.raises(ValueError, match=r"keeps its state in its first param's, .* in the optimizer's order"):
        fadam.state_from_torch(opt, tx, params[::-1])
    with pytest.raises(ValueError, match=r"holds 3 pairs, more than fadam\.lbfgs's history_size 2"):
        fadam.state_from_torch(opt, fadam.lbfgs(**{**LBFGS_KWARGS, "history_size": 2}), params)
    source = opt.state_dict()
    source["state"][0] = {key: value for key, value in source["state"][0].items() if key != "prev_loss"}
    with pytest.raises(ValueError, match=r"expected keys \[.*'prev_loss'.*\], found \[.*'old_stps', 'prev_flat_grad'"):
        fadam.state_from_torch(source, tx, params)
    state = fadam.state_from_torch(opt, tx, params)
    with pytest.raises(ValueError, match=r"torch\.optim\.LBFGS keeps no step count"):
        fadam.state_to_torch(state, params, opt, count=2)
    with pytest.raises(ValueError, match="in the optimizer's order"):
        fadam.state_to_torch(state, params[::-1], opt)
    adam = fadam.adam()
    with pytest.raises(ValueError, match=r"converts fadam\.lbfgs's state \(LbfgsState\) into torch\.optim\.LBFGS"):
        fadam.state_to_torch(adam.init([p.detach() for p in params]), params, opt)
