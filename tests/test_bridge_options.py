"""fadam.Optimizer's group options: every factory argument and torch.optim's implementation flags live in each
param group, are read at each step and checkpointed, as torch.optim's; schedulers that cycle betas or momentum."""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch

import fadam

STEPS = 6


def _model(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype)


def _batch(step: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=gen, dtype=dtype), torch.randn(8, 2, generator=gen, dtype=dtype)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step, next(model.parameters()).dtype)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest difference between the two models' params, relative to the largest param."""
    ours, theirs = _flat(a), _flat(b)
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _groups(model: torch.nn.Module, overrides: tuple[dict, dict]) -> list[dict]:
    return [
        {"params": list(model[0].parameters()), **overrides[0]},
        {"params": list(model[2].parameters()), **overrides[1]},
    ]


def test_maximize_and_weight_decay_in_a_group_change_the_step_as_in_torch():
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    v = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    ours = fadam.Optimizer([{"params": [w], "maximize": True, "weight_decay": 0.5}], fadam.sgd, lr=0.1)
    theirs = torch.optim.SGD([{"params": [v], "maximize": True, "weight_decay": 0.5}], lr=0.1)
    for _ in range(3):
        w.grad, v.grad = torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
        ours.step()
        theirs.step()
    assert float(w.detach()) == pytest.approx(1.142625, abs=1e-12)
    assert float(w.detach()) == pytest.approx(float(v.detach()), abs=1e-15)


@pytest.mark.parametrize(
    ("factory", "torch_cls"),
    [
        (fadam.adam, torch.optim.Adam),
        (fadam.adamw, torch.optim.AdamW),
        (fadam.sgd, torch.optim.SGD),
        (fadam.nadam, torch.optim.NAdam),
        (fadam.radam, torch.optim.RAdam),
        (fadam.rmsprop, torch.optim.RMSprop),
        (fadam.adagrad, torch.optim.Adagrad),
        (fadam.adamax, torch.optim.Adamax),
    ],
)
def test_every_factory_argument_is_a_group_option_with_torchs_default(factory, torch_cls):
    """Each group holds torch.optim's options with torch's defaults (fadam.adam and adamw have no
    ``decoupled_weight_decay``: they are the two torch classes), and fadam's own factory arguments."""
    ours = fadam.Optimizer([torch.nn.Parameter(torch.ones(2))], factory, lr=0.1).param_groups[0]
    theirs = torch_cls([torch.nn.Parameter(torch.ones(2))], lr=0.1).param_groups[0]
    torch_options = set(theirs) - {"params", "decoupled_weight_decay" if factory in (fadam.adam, fadam.adamw) else ""}
    assert torch_options <= set(ours)
    assert {name: ours[name] for name in torch_options} == {name: theirs[name] for name in torch_options}


# (fadam factory, torch class, options for both optimizers, per-group options, {step: [(group, option, value)]})
CASES = {
    "adam": (
        fadam.adam,
        torch.optim.Adam,
        {"weight_decay": 0.1},
        ({}, {"betas": (0.8, 0.99), "maximize": True, "amsgrad": True}),
        {
            2: [(0, "eps", 1e-3), (0, "betas", (0.7, 0.9)), (1, "weight_decay", 0.3), (1, "lr", 0.05)],
            4: [(0, "weight_decay", 0.0), (1, "maximize", False)],  # the chain loses stateless members
        },
    ),
    "adamw": (
        fadam.adamw,
        torch.optim.AdamW,
        {"betas": (0.85, 0.995)},
        ({}, {"weight_decay": 0.2, "eps": 1e-4}),
        {3: [(0, "weight_decay", 0.05), (1, "betas", (0.8, 0.98)), (1, "eps", 1e-6)]},
    ),
    "sgd": (
        fadam.sgd,
        torch.optim.SGD,
        {"momentum": 0.9, "dampening": 0.1},
        ({}, {"nesterov": True, "dampening": 0.0, "weight_decay": 0.01}),
        {
            2: [(0, "momentum", 0.5), (0, "dampening", 0.0), (1, "nesterov", False), (1, "maximize", True)],
            4: [(0, "nesterov", True), (0, "weight_decay", 0.2)],
        },
    ),
    "nadam": (
        fadam.nadam,
        torch.optim.NAdam,
        {"momentum_decay": 0.01},
        ({}, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
        {3: [(0, "betas", (0.8, 0.9)), (0, "eps", 1e-4), (0, "momentum_decay", 0.02), (1, "weight_decay", 0.2)]},
    ),
    "radam": (
        fadam.radam,
        torch.optim.RAdam,
        {"weight_decay": 0.05},
        ({}, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
        {3: [(0, "betas", (0.8, 0.9)), (1, "weight_decay", 0.3)]},
    ),
    "rmsprop": (
        fadam.rmsprop,
        torch.optim.RMSprop,
        {"momentum": 0.5},
        ({}, {"centered": True, "alpha": 0.9}),
        {3: [(0, "alpha", 0.8), (0, "momentum", 0.7), (0, "eps", 1e-4), (1, "weight_decay", 0.1)]},
    ),
    "adagrad": (
        fadam.adagrad,
        torch.optim.Adagrad,
        {"lr_decay": 0.01, "initial_accumulator_value": 0.1},  # torch's Adagrad reads only the optimizer's
        ({}, {"eps": 1e-6}),
        {3: [(0, "lr_decay", 0.05), (0, "eps", 1e-3), (1, "weight_decay", 0.1)]},
    ),
    "adamax": (
        fadam.adamax,
        torch.optim.Adamax,
        {"eps": 1e-6},
        ({}, {"betas": (0.8, 0.99), "weight_decay": 0.1}),
        {3: [(0, "eps", 1e-3), (0, "betas", (0.7, 0.95)), (1, "weight_decay", 0.0)]},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_options_given_per_group_and_changed_between_steps_follow_torch(case):
    factory, torch_cls, shared, overrides, changes = CASES[case]
    a, b = _model(), _model()
    ours = fadam.Optimizer(_groups(a, overrides), factory, lr=0.02, **shared)
    theirs = torch_cls(_groups(b, overrides), lr=0.02, **shared)
    for step in range(STEPS):
        for group, option, value in changes.get(step, []):
            ours.param_groups[group][option] = value
            theirs.param_groups[group][option] = value
        _step(a, ours, step)
        _step(b, theirs, step)
        assert _error(a, b) <= 1e-12, (step, _error(a, b))
    for mine, torchs in zip(ours.param_groups, theirs.param_groups):
        assert all(mine[k] == v for k, v in torchs.items() if k not in ("params", "decoupled_weight_decay"))


def test_an_option_that_needs_another_state_layout_is_refused_once_stepped_and_taken_before():
    a, b = _model(), _model()
    ours = fadam.Optimizer(a.parameters(), fadam.adam, lr=0.01)
    theirs = torch.optim.Adam(b.parameters(), lr=0.01)
    ours.param_groups[0]["amsgrad"] = theirs.param_groups[0]["amsgrad"] = True  # before the first step: a fresh state
    for step in range(3):
        _step(a, ours, step)
        _step(b, theirs, step)
    assert _error(a, b) <= 1e-12
    assert hasattr(ours.tx_states[0][0], "nu_max")

    before, state = _flat(a), ours.tx_states[0]
    ours.param_groups[0]["amsgrad"] = False
    with pytest.raises(ValueError, match=r"param group 0: amsgrad=False needs an optimizer state of another layout"):
        _step(a, ours, 3)
    assert torch.equal(_flat(a), before) and ours.tx_states[0] is state


def test_momentum_set_before_the_first_step_gives_sgd_a_momentum_buffer_as_in_torch():
    a, b = _model(), _model()
    ours = fadam.Optimizer(a.parameters(), fadam.sgd, lr=0.05)
    theirs = torch.optim.SGD(b.parameters(), lr=0.05)
    ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = 0.9
    for step in range(STEPS):
        _step(a, ours, step)
        _step(b, theirs, step)
    assert _error(a, b) <= 1e-12


def test_a_bad_option_raises_naming_its_group_before_any_group_steps():
    model = _model()
    opt = fadam.Optimizer(_groups(model, ({}, {})), fadam.adam, lr=0.01)
    _step(model, opt, 0)
    before = _flat(model)
    opt.param_groups[1]["betas"] = (1.5, 0.9)
    with pytest.raises(ValueError, match=r"param group 1: Invalid beta parameter at index 0: 1.5"):
        _step(model, opt, 1)
    assert torch.equal(_flat(model), before)
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    del opt.param_groups[0]["eps"]
    with pytest.raises(ValueError, match=r"param group 0 lacks the option 'eps' of adam"):
        _step(model, opt, 1)
    assert torch.equal(_flat(model), before)


def test_options_given_to_the_optimizer_are_the_factorys_and_a_groups_own_factory_takes_those_it_has():
    model = _model()
    with pytest.raises(TypeError, match=r"sgd takes no option 'betas'; its options are momentum, dampening"):
        fadam.Optimizer(model.parameters(), fadam.sgd, lr=0.1, betas=(0.9, 0.99))
    with pytest.raises(TypeError, match=r"'momentum' are options of a transform factory, and a ready transform"):
        fadam.Optimizer(model.parameters(), fadam.sgd(0.1), lr=0.1, momentum=0.9)
    opt = fadam.Optimizer(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "tx": fadam.sgd, "lr": 0.1}],
        functools.partial(fadam.adamw, betas=(0.8, 0.9)),
        lr=0.01,
        weight_decay=0.3,
    )
    body, head = opt.param_groups
    assert (body["betas"], body["weight_decay"], body["amsgrad"]) == ((0.8, 0.9), 0.3, False)
    assert (head["weight_decay"], head["momentum"], head["nesterov"]) == (0.3, 0.0, False)

    def needs_decay(lr, weight_decay):
        return fadam.sgd(lr, weight_decay=weight_decay)

    with pytest.raises(ValueError, match="didn't specify a value of required optimization parameter weight_decay"):
        fadam.Optimizer(model.parameters(), needs_decay, lr=0.1)


def test_a_factory_taking_learning_rate_is_driven_by_the_groups_lr():
    w = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    opt = fadam.Optimizer([w], fadam.sign_sgd, lr=0.25)
    w.grad = torch.tensor([3.0, -0.5], dtype=torch.float64)
    opt.step()
    opt.param_groups[0]["lr"] = 0.5
    opt.step()
    assert w.detach().tolist() == [0.25, -0.25]


def test_an_inject_hyperparams_factory_reads_its_options_from_the_group():
    a, b = _model(), _model()
    ours = fadam.Optimizer(a.parameters(), fadam.inject_hyperparams(fadam.adam), lr=0.01, eps=1e-6)
    theirs = torch.optim.Adam(b.parameters(), lr=0.01, eps=1e-6)
    for step in range(STEPS):
        if step == 3:
            ours.param_groups[0]["betas"] = theirs.param_groups[0]["betas"] = (0.8, 0.9)
            ours.param_groups[0]["eps"] = theirs.param_groups[0]["eps"] = 1e-3
        _step(a, ours, step)
        _step(b, theirs, step)
    assert _error(a, b) <= 1e-12
    assert ours.tx_states[0].hyperparams["betas"].tolist() == [0.8, 0.9]


# --- checkpoints and copies ----------------------------------------------------------------------------------------


def test_a_state_dict_round_trip_keeps_the_group_options_and_loads_their_state_layout():
    a = _model()
    opt = fadam.Optimizer(a.parameters(), fadam.adam, lr=0.01, amsgrad=True)
    for step in range(3):
        _step(a, opt, step)
    opt.param_groups[0]["betas"], opt.param_groups[0]["weight_decay"] = (0.8, 0.95), 0.1
    _step(a, opt, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    b = copy.deepcopy(a)
    resumed = fadam.Optimizer(b.parameters(), fadam.adam, lr=0.01)  # built with amsgrad=False, other betas
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    mine = {k: v for k, v in resumed.param_groups[0].items() if k != "params"}
    assert mine == {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert mine["amsgrad"] is True and mine["betas"] == (0.8, 0.95)
    for step in range(4, 4 + STEPS):
        _step(a, opt, step)
        _step(b, resumed, step)
    assert torch.equal(_flat(a), _flat(b))


def test_copies_and_pickles_keep_the_options_their_transforms_were_built_with():
    a = _model()
    opt = fadam.Optimizer(a.parameters(), fadam.sgd, lr=0.05, momentum=0.9)
    _step(a, opt, 0)
    opt.param_groups[0]["nesterov"] = True
    b, twin = copy.deepcopy((a, opt))
    c = copy.deepcopy(a)
    pickled = pickle.loads(pickle.dumps((c, opt)))[1]
    pickled_model = pickled.param_groups[0]["params"]
    assert twin.param_groups[0]["nesterov"] is pickled.param_groups[0]["nesterov"] is True
    for step in range(1, STEPS):
        _step(a, opt, step)
        _step(b, twin, step)
    for step in range(1, STEPS):
        x, y = _batch(step)
        pickled.zero_grad()
        out = torch.nn.functional.linear(
            torch.tanh(torch.nn.functional.linear(x, *pickled_model[:2])), *pickled_model[2:]
        )
        torch.nn.functional.mse_loss(out, y).backward()
        pickled.step()
    assert torch.equal(_flat(a), _flat(b))
    assert torch.equal(_flat(a), torch.cat([p.detach().flatten() for p in pickled_model]))


# --- schedulers that cycle momentum ---------------------------------------------------------------------------------


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12)


def _cyclic(opt):
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=3)


@pytest.mark.parametrize(
    ("factory", "torch_cls", "options", "make_scheduler", "momentum"),
    [
        (fadam.adamw, torch.optim.AdamW, {}, _one_cycle, "betas"),
        (fadam.sgd, torch.optim.SGD, {"momentum": 0.9}, _one_cycle, "momentum"),
        (fadam.adam, torch.optim.Adam, {}, _cyclic, "betas"),
        (fadam.sgd, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, _cyclic, "momentum"),
    ],
    ids=["adamw-onecycle", "sgd-onecycle", "adam-cyclic", "sgd-nesterov-cyclic"],
)
def test_schedulers_cycle_betas_and_momentum_exactly_as_with_torch(
    factory, torch_cls, options, make_scheduler, momentum
):
    a, b = _model(), _model()
    ours, theirs = (
        fadam.Optimizer(a.parameters(), factory, lr=0.01, **options),
        torch_cls(b.parameters(), lr=0.01, **options),
    )
    sched_a, sched_b = make_scheduler(ours), make_scheduler(theirs)
    seen_a, seen_b = [], []
    for step in range(12):
        seen_a.append((ours.param_groups[0]["lr"], ours.param_groups[0][momentum]))
        seen_b.append((theirs.param_groups[0]["lr"], theirs.param_groups[0][momentum]))
        _step(a, ours, step)
        _step(b, theirs, step)
        sched_a.step()
        sched_b.step()
    assert seen_a == seen_b
    assert len({m for _, m in seen_a}) > 3  # the momentum did cycle
    assert _error(a, b) <= 1e-12


# --- torch.optim's implementation flags -----------------------------------------------------------------------------


def test_torchs_implementation_flags_are_group_options_kept_by_state_dict():
    model = _model()
    opt = fadam.Optimizer(
        [{"params": model[0].parameters(), "foreach": False}, {"params": model[2].parameters()}],
        fadam.adam,
        lr=0.01,
        fused=None,
        capturable=True,
    )
    flags = [{k: g[k] for k in ("foreach", "fused", "capturable", "differentiable")} for g in opt.param_groups]
    assert flags == [
        {"foreach": False, "fused": None, "capturable": True, "differentiable": False},
        {"foreach": None, "fused": None, "capturable": True, "differentiable": False},
    ]
    saved = opt.state_dict()["param_groups"]
    assert [{k: g[k] for k in flags[0]} for g in saved] == flags


def _functional_run(tx, model, backend, steps):
    """The params after ``steps`` steps of ``fadam.step`` on one backend: the reference for a group's flags."""
    params = [p.detach().clone() for p in model.parameters()]
    state = tx.init(params)
    twin = copy.deepcopy(model)
    for step in range(steps):
        x, y = _batch(step, params[0].dtype)
        for p, q in zip(twin.parameters(), params):
            p.data = q.clone()
            p.grad = None
        torch.nn.functional.mse_loss(twin(x), y).backward()
        with fadam.backend(backend):
            params, state = fadam.step(tx, params, [p.grad for p in twin.parameters()], state)
    return torch.cat([p.flatten() for p in params])


def test_fused_runs_torchs_fused_kernel_foreach_fadams_kernel_and_the_for_loop_eager_torch_ops():
    """In float32, where fadam's eager chain and torch's fused AdamW round differently in the last place."""
    models = {name: _model(dtype=torch.float32) for name in ("fused", "foreach", "loop", "torch_fused")}
    opts = {
        "fused": fadam.Optimizer(models["fused"].parameters(), fadam.adamw, lr=0.01, fused=True),
        "foreach": fadam.Optimizer(models["foreach"].parameters(), fadam.adamw, lr=0.01, foreach=True),
        "loop": fadam.Optimizer(models["loop"].parameters(), fadam.adamw, lr=0.01, foreach=False),
        "torch_fused": torch.optim.AdamW(models["torch_fused"].parameters(), lr=0.01, fused=True),
    }
    for step in range(STEPS):
        for name, opt in opts.items():
            _step(models[name], opt, step)
    eager = _functional_run(fadam.adamw(lr=0.01), _model(dtype=torch.float32), "eager", STEPS)
    kernel = _functional_run(fadam.adamw(lr=0.01), _model(dtype=torch.float32), "kernel", STEPS)
    assert torch.equal(_flat(models["fused"]), _flat(models["torch_fused"]))
    assert torch.equal(_flat(models["foreach"]), kernel)
    assert torch.equal(_flat(models["loop"]), eager)
    assert not torch.equal(eager, _flat(models["torch_fused"]))


@pytest.mark.parametrize(
    "flags", [{"fused": True}, {"foreach": True}, {"foreach": False}, {"fused": False}, {"capturable": True}]
)
def test_every_flag_follows_torch_in_float64(flags):
    a, b = _model(), _model()
    ours = fadam.Optimizer(a.parameters(), fadam.adam, lr=0.01, weight_decay=0.1, **flags)
    theirs = torch.optim.Adam(b.parameters(), lr=0.01, weight_decay=0.1)  # torch's capturable is for accelerators
    for step in range(STEPS):
        _step(a, ours, step)
        _step(b, theirs, step)
    assert _error(a, b) <= 1e-12


def test_fused_and_flag_conflicts_raise_as_in_torch_before_anything_changes():
    complex_param = torch.nn.Parameter(torch.ones(2, dtype=torch.complex128))
    message = r"`fused=True` requires all the params to be floating point Tensors of supported .*complex128 and cpu"
    with pytest.raises(RuntimeError, match=r"param group 0: " + message):
        fadam.Optimizer([complex_param], fadam.adam, lr=0.1, fused=True)
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"`fused` and `foreach` cannot be `True` together"):
        fadam.Optimizer([w], fadam.adam, lr=0.1, fused=True, foreach=True)
    with pytest.raises(RuntimeError, match=r"`fused` does not support `differentiable`"):
        fadam.Optimizer([w], fadam.adam, lr=0.1, fused=True, differentiable=True)
    with pytest.raises(RuntimeError, match=r"`foreach` and `differentiable` cannot be `True` together"):
        fadam.Optimizer([w], fadam.adam, lr=0.1, foreach=True, differentiable=True)
    with pytest.raises(TypeError, match=r"param group 0: capturable must be a bool, got 'yes'"):
        fadam.Optimizer([w], fadam.adam, lr=0.1, capturable="yes")

    opt = fadam.Optimizer([complex_param], fadam.adam, lr=0.1)  # fused set between steps: checked at the step
    opt.param_groups[0]["fused"] = True
    complex_param.grad = torch.ones(2, dtype=torch.complex128)
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert torch.equal(complex_param.detach(), torch.ones(2, dtype=torch.complex128))
    assert int(opt.tx_states[0][0].count) == 0


def test_capturable_refuses_params_on_a_device_torch_optim_does_not_capture_on():
    w = torch.nn.Parameter(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"capturable=True needs the step counts on the params' device"):
        fadam.Optimizer([w], fadam.adam, lr=0.1, capturable=True)


def _unrolled(make, steps=3):
    """A loss after ``steps`` differentiable steps of non-leaf params, and its gradients with respect to the
    initial params and a tensor learning rate."""
    torch.manual_seed(0)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    lr = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    p = w.clone()
    opt = make([p], lr)
    for step in range(steps):
        p.grad = torch.sin(w * (step + 1))
        opt.step()
    return (p.detach(), *torch.autograd.grad((p**2).sum(), [w, lr]))


@pytest.mark.parametrize(
    ("factory", "torch_cls", "options"),
    [(fadam.sgd, torch.optim.SGD, {}), (fadam.adam, torch.optim.Adam, {}), (fadam.adamw, torch.optim.AdamW, {})],
)
def test_differentiable_steps_give_torchs_gradients(factory, torch_cls, options):
    # torch's differentiable Adam computes its bias corrections from the step tensor, in the default dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        theirs = _unrolled(lambda ps, lr: torch_cls(ps, lr=lr, differentiable=True, **options))
        ours = _unrolled(lambda ps, lr: fadam.Optimizer(ps, factory, lr=lr, differentiable=True, **options))
    finally:
        torch.set_default_dtype(previous)
    for mine, torchs in zip(ours, theirs):
        torch.testing.assert_close(mine, torchs, rtol=1e-12, atol=1e-12)


def test_differentiable_momentum_gives_the_gradients_of_the_functional_steps():
    """torch's SGD detaches its first momentum buffer; fadam differentiates through it, as an unrolled
    ``fadam.step`` does."""
    ours = _unrolled(lambda ps, lr: fadam.Optimizer(ps, fadam.sgd, lr=lr, momentum=0.9, differentiable=True))
    torch.manual_seed(0)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    lr = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    tx = fadam.sgd(lr, momentum=0.9)
    params = [w]
    state = tx.init(params)
    for step in range(3):
        params, state = fadam.step(tx, params, [torch.sin(w * (step + 1))], state)
    reference = (params[0].detach(), *torch.autograd.grad((params[0] ** 2).sum(), [w, lr]))
    for mine, expected in zip(ours, reference):
        torch.testing.assert_close(mine, expected, rtol=1e-12, atol=1e-12)
