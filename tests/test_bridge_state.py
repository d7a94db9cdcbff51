"""fadam.Optimizer's state_dict (keyed by param position, named and unnamed alike, torch.optim's loaded through the
conversion) and the refusals and round trips of state_from_torch / state_to_torch."""

from __future__ import annotations

import functools
import io

import optree
import pytest
import torch

import fadam

LAYERS = 11  # sorted names put "10.weight" before "2.weight": the order optree flattens a dict of named params in


def _stack(seed: int = 0) -> torch.nn.Sequential:
    """Layers of one shape, so that a param given another's state is not caught by a shape check."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(LAYERS))).double()


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    twin = _stack(seed=1)
    twin.load_state_dict(model.state_dict())
    return twin


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    return model(x).pow(2).mean()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def _assert_close(a: torch.nn.Module, b: torch.nn.Module, rtol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        err = float((p.detach() - q.detach()).abs().max() / q.detach().abs().max())
        assert err <= rtol, (name, err)


def _roundtrip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --- fadam.Optimizer.state_dict: keyed by param position --------------------------------------------------------------


def test_state_dict_lists_each_params_state_under_its_position():
    model = _stack()
    opt = fadam.Optimizer(model.named_parameters(), fadam.adam, lr=1e-2)
    _train(model, opt, 2)
    saved = opt.state_dict()
    names = saved["param_groups"][0]["param_names"]
    assert names == [name for name, _ in model.named_parameters()]
    assert saved["param_groups"][0]["params"] == list(range(LAYERS))
    assert int(saved["param_groups"][0]["tx_state"]["state[0].count"]) == 2
    mu = opt.tx_states[0][0].mu
    for index, name in enumerate(names):
        assert sorted(saved["state"][index]) == ["state[0].mu", "state[0].nu"]
        assert saved["state"][index]["state[0].mu"] is mu[name]


@pytest.mark.parametrize(("source_named", "target_named"), [(False, True), (True, False), (True, True)])
def test_named_and_unnamed_state_dicts_load_into_each_other(source_named, target_named):
    def params(model, named):
        return model.named_parameters() if named else model.parameters()

    model = _stack()
    opt = fadam.Optimizer(params(model, source_named), fadam.adam, lr=1e-2)
    _train(model, opt, 5)
    twin = _copy(model)
    opt_twin = fadam.Optimizer(params(twin, target_named), fadam.adam, lr=1e-2)
    opt_twin.load_state_dict(_roundtrip(opt.state_dict()))
    _train(model, opt, 5, start=5)
    _train(twin, opt_twin, 5, start=5)
    _assert_close(twin, model, 0.0)


def test_a_torch_adam_state_dict_loads_into_a_named_fadam_optimizer():
    model = _stack()
    reference = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, reference, 5)
    twin = _copy(model)
    opt = fadam.Optimizer(twin.named_parameters(), fadam.adam, lr=1e-3)
    opt.load_state_dict(_roundtrip(reference.state_dict()))
    assert opt.param_groups[0]["lr"] == 1e-2
    assert int(opt.tx_states[0][0].count) == 5
    _train(model, reference, 20, start=5)
    _train(twin, opt, 20, start=5)
    _assert_close(twin, model, 1e-12)


def test_a_torch_state_dict_that_does_not_convert_is_refused_and_nothing_loads():
    model = _stack()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    _train(model, sgd, 1)
    opt = fadam.Optimizer(model.parameters(), fadam.adam, lr=0.2)
    with pytest.raises(ValueError, match=r"param group 0: .* param \[0\]: expected keys .*found \['momentum_buffer'\]"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["lr"] == 0.2


def test_a_state_dict_with_other_entries_is_refused_and_nothing_loads():
    model = _stack()
    sgd = fadam.Optimizer(model.named_parameters(), functools.partial(fadam.sgd, momentum=0.9), lr=0.1)
    _train(model, sgd, 1)
    opt = fadam.Optimizer(model.named_parameters(), fadam.adam, lr=0.2)
    before = opt.tx_states[0]
    with pytest.raises(ValueError, match=r"param \['0.weight'\]: state_dict holds \['state\[0\].trace'\], expected"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.tx_states[0] is before and opt.param_groups[0]["lr"] == 0.2


def test_the_older_layout_loads_only_where_the_param_names_agree():
    model = _stack()
    opt = fadam.Optimizer(model.named_parameters(), fadam.adam, lr=1e-2)
    _train(model, opt, 3)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    # fadam's older layout: the group's state leaves in the order optree flattens them (param names sorted)
    older = {"state": {0: optree.tree_leaves(opt.tx_states[0], none_is_leaf=True)}, "param_groups": [group]}
    group["params"] = list(range(LAYERS))
    named = fadam.Optimizer(_copy(model).named_parameters(), fadam.adam, lr=1e-2)
    named.load_state_dict(older)
    assert torch.equal(named.tx_states[0][0].mu["2.weight"], opt.tx_states[0][0].mu["2.weight"])
    unnamed = fadam.Optimizer(_copy(model).parameters(), fadam.adam, lr=1e-2)
    before = unnamed.tx_states[0]
    with pytest.raises(ValueError, match=r"older layout .* same param names"):
        unnamed.load_state_dict(older)
    assert unnamed.tx_states[0] is before


# --- state_from_torch: what does not convert is refused ---------------------------------------------------------------


def _stepped(make, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _stack()
    opt = make(model.parameters())
    _train(model, opt, steps)
    return model, opt


@pytest.mark.parametrize(
    ("make", "tx", "expected", "found"),
    [
        (
            lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
            fadam.adam(lr=1e-2),
            "['exp_avg', 'exp_avg_sq', 'step']",
            "['momentum_buffer']",
        ),
        (
            lambda ps: torch.optim.Adam(ps, lr=1e-2),
            fadam.sgd(lr=1e-2, momentum=0.9),
            "['momentum_buffer']",
            "['exp_avg', 'exp_avg_sq', 'step']",
        ),
        (
            lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
            fadam.adam(lr=1e-2),
            "['exp_avg', 'exp_avg_sq', 'step']",
            "['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step']",
        ),
        (
            lambda ps: torch.optim.NAdam(ps, lr=1e-2),
            fadam.adam(lr=1e-2),
            "['exp_avg', 'exp_avg_sq', 'step']",
            "['exp_avg', 'exp_avg_sq', 'mu_product', 'step']",
        ),
        (
            lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True),
            fadam.rmsprop(lr=1e-2),
            "['square_avg', 'step']",
            "['grad_avg', 'square_avg', 'step']",
        ),
    ],
    ids=["sgd-into-adam", "adam-into-sgd-momentum", "amsgrad-into-adam", "nadam-into-adam", "centered-into-plain"],
)
def test_state_from_torch_refuses_another_optimizers_state(make, tx, expected, found):
    model, opt = _stepped(make)
    message = f"param [0]: expected keys {expected}, found {found}"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fadam.state_from_torch(opt, tx, list(model.parameters()))


def test_state_from_torch_refuses_a_partial_state():
    model = _stack()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model[3].weight.requires_grad_(False)  # no gradient: torch.optim keeps no buffer for it
    _train(model, opt, 2)
    with pytest.raises(ValueError, match=r"param \[3\]: expected keys \['momentum_buffer'\], found \[\]"):
        fadam.state_from_torch(opt, fadam.sgd(lr=1e-2, momentum=0.9), list(model.parameters()))
    model, opt = _stepped(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    source = opt.state_dict()
    del source["state"][5]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"param \[5\]: expected keys .*, found \['exp_avg', 'step'\]"):
        fadam.state_from_torch(source, fadam.adam(lr=1e-2), list(model.parameters()))


def test_state_from_torch_refuses_state_without_a_torch_counterpart():
    model, opt = _stepped(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    with pytest.raises(ValueError, match=r"param \[0\]: fadam's state\[0\]\.mu \(ScaleByLionState\.mu\) has no torch"):
        fadam.state_from_torch(opt, fadam.lion(lr=1e-3), list(model.parameters()))


def test_state_from_torch_of_an_empty_state_is_a_fresh_one():
    model = _stack()
    params = list(model.parameters())
    fresh = fadam.state_from_torch(torch.optim.Adam(params, lr=1e-2), fadam.adam(lr=1e-2), params)
    assert int(fresh[0].count) == 0 and all(not m.any() for m in fresh[0].mu)
    sgd = torch.optim.SGD(params, lr=1e-2)
    _train(model, sgd, 1)
    source = sgd.state_dict()  # without momentum: no buffer, or a None one
    source["state"] = {i: {"momentum_buffer": None} for i in range(len(params))}
    assert fadam.state_from_torch(source, fadam.sgd(lr=1e-2), params) == (fadam.EmptyState(),)


def test_state_from_torch_matches_a_dict_of_params_by_the_optimizers_order():
    model, opt = _stepped(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    params = {name: p.detach() for name, p in model.named_parameters()}
    state = fadam.state_from_torch(opt.state_dict(), fadam.adam(lr=1e-2), params)  # no param_names: by order
    for name, p in model.named_parameters():
        assert torch.equal(state[0].mu[name], opt.state[p]["exp_avg"])


# --- state_to_torch ---------------------------------------------------------------------------------------------------

ROUND_TRIPS = [
    (functools.partial(fadam.rmsprop, lr=1e-3), functools.partial(torch.optim.RMSprop, lr=1e-3)),
    (
        functools.partial(fadam.rmsprop, lr=1e-3, centered=True),
        functools.partial(torch.optim.RMSprop, lr=1e-3, centered=True),
    ),
    (
        functools.partial(fadam.rmsprop, lr=1e-3, momentum=0.5),
        functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
    ),
    (
        functools.partial(fadam.rmsprop, lr=1e-3, centered=True, momentum=0.5, weight_decay=0.1),
        functools.partial(torch.optim.RMSprop, lr=1e-3, centered=True, momentum=0.5, weight_decay=0.1),
    ),
    (functools.partial(fadam.adagrad, lr=1e-1), functools.partial(torch.optim.Adagrad, lr=1e-1)),
    (
        functools.partial(fadam.adagrad, lr=1e-1, initial_accumulator_value=0.5),
        functools.partial(torch.optim.Adagrad, lr=1e-1, initial_accumulator_value=0.5),
    ),
]
ROUND_TRIP_IDS = [
    "rmsprop",
    "rmsprop-centered",
    "rmsprop-momentum",
    "rmsprop-centered-momentum-decay",
    "adagrad",
    "adagrad-initial-sum",
]


def _functional_train(tx, model, params, state, steps, start):
    def loss(params, step):
        return _loss_of(torch.func.functional_call(model, params, (_inputs(step),)))

    for step in range(start, start + steps):
        grads = torch.func.grad(loss)(params, step)
        params, state = fadam.step(tx, params, grads, state)
    return params, state


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.mark.parametrize(("fadam_tx", "torch_opt"), ROUND_TRIPS, ids=ROUND_TRIP_IDS)
def test_state_to_torch_continues_a_fadam_run_in_torch(fadam_tx, torch_opt):
    model = _stack()
    tx = fadam_tx()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    params, state = _functional_train(tx, model, params, tx.init(params), 5, 0)
    twin = _copy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(params[name])
    opt = torch_opt(twin.parameters())
    named = dict(twin.named_parameters())
    opt.load_state_dict(fadam.state_to_torch(state, {k: named[k] for k in params}, opt, count=5))
    assert all(float(s["step"]) == 5 for s in opt.state.values())
    params, state = _functional_train(tx, model, params, state, 15, 5)
    _train(twin, opt, 15, start=5)
    for name, p in twin.named_parameters():
        assert float((p.detach() - params[name]).abs().max() / params[name].abs().max()) <= 1e-12, name


@pytest.mark.parametrize(("fadam_tx", "torch_opt"), ROUND_TRIPS, ids=ROUND_TRIP_IDS)
def test_state_from_torch_continues_a_torch_run_in_fadam(fadam_tx, torch_opt):
    model = _stack()
    opt = torch_opt(model.parameters())
    _train(model, opt, 5)
    tx = fadam_tx()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = fadam.state_from_torch(opt.state_dict(), tx, params)
    _train(model, opt, 15, start=5)
    params, state = _functional_train(tx, model, params, state, 15, 5)
    for name, p in model.named_parameters():
        assert float((p.detach() - params[name]).abs().max() / params[name].abs().max()) <= 1e-12, name


def test_state_to_torch_asks_for_the_count_fadam_does_not_keep():
    model = _stack()
    tx = fadam.rmsprop(lr=1e-3)
    params = list(model.parameters())
    state = tx.init([p.detach() for p in params])
    with pytest.raises(ValueError, match=r"keeps no step count .* pass count="):
        fadam.state_to_torch(state, params, torch.optim.RMSprop(params, lr=1e-3))


@pytest.mark.parametrize(
    ("tx", "make", "match"),
    [
        (fadam.adam(lr=1e-2), lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), "SGD: it keeps"),
        (fadam.rmsprop(lr=1e-2), lambda ps: torch.optim.RMSprop(ps, centered=True), "RMSprop: it keeps .*grad_avg"),
        (fadam.lion(lr=1e-3), lambda ps: torch.optim.Adam(ps), "ScaleByLionState.mu. has no torch"),
        (fadam.adam(lr=1e-2), lambda ps: type("Yogi", (torch.optim.Optimizer,), {})(ps, {"lr": 1e-2}), "not Yogi"),
    ],
    ids=["adam-into-sgd", "plain-into-centered", "lion", "unsupported-optimizer"],
)
def test_state_to_torch_refuses_what_the_optimizer_does_not_keep(tx, make, match):
    model = _stack()
    params = list(model.parameters())
    detached = [p.detach() for p in params]
    state = tx.update([torch.ones_like(p) for p in params], tx.init(detached), detached)[1]
    with pytest.raises(ValueError, match=match):
        fadam.state_to_torch(state, params, make(params), count=1)
