"""fadam.Optimizer against torch.optim, with schedulers, GradScaler and checkpoints; torch.optim state import/export."""

from __future__ import annotations

import functools
import io
from typing import Any, NamedTuple

import optree
import pytest
import torch

import fadam

STEPS = 20


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=gen, dtype=dtype), torch.randn(16, 3, generator=gen, dtype=dtype)


def _train(model, opt, steps, start=0, scheduler=None, dtype=torch.float32):
    for step in range(start, start + steps):
        x, y = _batch(step, dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_same_params(a, b, rtol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        p, q = p.detach(), q.detach()
        err = float((p - q).abs().max() / q.abs().max())
        assert err <= rtol, (name, err)


@pytest.mark.parametrize(
    ("ours", "theirs", "rtol"),
    [
        (lambda ps: fadam.Optimizer(ps, fadam.adam(lr=1e-2), lr=1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2), 1e-6),
        (  # the same fused kernel as torch's fused Adam: bit for bit
            lambda ps: fadam.Optimizer(ps, fadam.adam(lr=1e-2), lr=1e-2),
            lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
            0.0,
        ),
        (
            lambda ps: fadam.Optimizer(ps, fadam.adamw(lr=1e-2, weight_decay=0.1), lr=1e-2),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            1e-6,
        ),
        (
            lambda ps: fadam.Optimizer(ps, fadam.sgd(lr=1e-2, momentum=0.9, nesterov=True), lr=1e-2),
            lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
            1e-6,
        ),
        (
            lambda ps: fadam.Optimizer(ps, fadam.nadam(lr=1e-2), lr=1e-2),
            lambda ps: torch.optim.NAdam(ps, lr=1e-2),
            1e-5,
        ),
    ],
    ids=["adam", "adam-vs-fused", "adamw", "sgd-nesterov", "nadam-general-path"],
)
def test_follows_torch_optim(ours, theirs, rtol):
    a, b = _model(), _model()
    opt_a, opt_b = ours(a.parameters()), theirs(b.parameters())
    _train(a, opt_a, STEPS)
    _train(b, opt_b, STEPS)
    _assert_same_params(a, b, rtol)


def test_follows_torch_in_float64_to_1e_12():
    a, b = _model(dtype=torch.float64), _model(dtype=torch.float64)
    opt_a = fadam.Optimizer(a.parameters(), fadam.adamw(lr=1e-2), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    _train(a, opt_a, STEPS, dtype=torch.float64)
    _train(b, opt_b, STEPS, dtype=torch.float64)
    _assert_same_params(a, b, 1e-12)


@pytest.mark.parametrize(
    ("factory", "torch_cls", "kwargs", "make_scheduler"),
    [
        (fadam.adam, torch.optim.Adam, {}, lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.3)),
        (
            functools.partial(fadam.adamw, weight_decay=0.1),
            torch.optim.AdamW,
            {"weight_decay": 0.1},
            lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
        ),
        (  # cycling the momentum too: tests/test_bridge_options.py
            functools.partial(fadam.sgd, momentum=0.9),
            torch.optim.SGD,
            {"momentum": 0.9},
            lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS, cycle_momentum=False),
        ),
    ],
    ids=["adam-steplr", "adamw-cosine", "sgd-momentum-onecycle"],
)
def test_lr_schedulers_drive_a_factory_exactly_like_torch(factory, torch_cls, kwargs, make_scheduler):
    a, b = _model(), _model()
    opt_a = fadam.Optimizer(a.parameters(), factory, lr=2e-2)
    opt_b = torch_cls(b.parameters(), lr=2e-2, **kwargs)
    sched_a, sched_b = make_scheduler(opt_a), make_scheduler(opt_b)
    _train(a, opt_a, STEPS, scheduler=sched_a)
    _train(b, opt_b, STEPS, scheduler=sched_b)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    _assert_same_params(a, b, 1e-6)


def test_a_ready_made_transform_is_rescaled_by_the_scheduler():
    a, b = _model(), _model()
    opt_a = fadam.Optimizer(a.parameters(), fadam.adam(lr=1e-2), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=5, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=5, gamma=0.5)
    _train(a, opt_a, STEPS, scheduler=sched_a)
    _train(b, opt_b, STEPS, scheduler=sched_b)
    _assert_same_params(a, b, 1e-5)


def test_a_ready_made_transform_needs_the_lr_it_was_built_with_which_the_group_reports():
    """fadam cannot read a ready transform's lr: it must be given, so that param_groups[i]["lr"] (what schedulers,
    HF Trainer and Lightning read) is the lr the step uses, not a multiplier."""
    model = _model()
    with pytest.raises(ValueError, match=r"param group 0: fadam cannot read a ready transform's learning rate"):
        fadam.Optimizer(model.parameters(), fadam.sgd(lr=0.1))

    # fadam.Optimizer's lr= is for the groups without their own tx: a group's own ready transform gives its own lr
    def groups(**head_lr):
        return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "tx": fadam.sgd(0.1), **head_lr}]

    with pytest.raises(ValueError, match=r"param group 1: fadam cannot read .* \(the group's lr for a group's own tx"):
        fadam.Optimizer(groups(), fadam.adam, lr=1e-3)
    opt = fadam.Optimizer(groups(lr=0.1), fadam.adam, lr=1e-3)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.1]
    before = model[2].weight.detach().clone()
    _train(model, opt, 1)
    expected = before - 0.1 * model[2].weight.grad  # the group's own sgd, with its lr
    torch.testing.assert_close(model[2].weight.detach(), expected, rtol=1e-6, atol=1e-7)


class _InjectedState(NamedTuple):  # the shape of fadam.inject_hyperparams' state, built here to test duck typing
    count: torch.Tensor
    hyperparams: dict[str, torch.Tensor]
    inner_state: Any


def _injected_sgd(learning_rate: float) -> fadam.GradientTransformation:
    def init(params):
        return _InjectedState(torch.zeros([], dtype=torch.int32), {"learning_rate": torch.tensor(learning_rate)}, ())

    def update(updates, state, params=None, **_):
        lr = state.hyperparams["learning_rate"]
        return fadam.tree_map(lambda g: None if g is None else -lr * g, updates), state._replace(count=state.count + 1)

    return fadam.GradientTransformation(init, update)


def test_injected_hyperparams_receive_the_group_lr():
    a, b = _model(), _model()
    opt_a = fadam.Optimizer(a.parameters(), _injected_sgd(0.05))
    assert opt_a.param_groups[0]["lr"] == pytest.approx(0.05)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.05)
    sched_a = torch.optim.lr_scheduler.ExponentialLR(opt_a, gamma=0.9)
    sched_b = torch.optim.lr_scheduler.ExponentialLR(opt_b, gamma=0.9)
    _train(a, opt_a, 10, scheduler=sched_a)
    _train(b, opt_b, 10, scheduler=sched_b)
    assert float(opt_a.tx_states[0].hyperparams["learning_rate"]) == pytest.approx(0.05 * 0.9**9, rel=1e-6)
    _assert_same_params(a, b, 1e-6)


def test_named_parameters_and_param_groups_with_their_own_tx():
    a, b = _model(), _model()
    body, head = dict(a[0].named_parameters()), dict(a[2].named_parameters())
    opt = fadam.Optimizer(
        [
            {"params": list(a[0].named_parameters()), "lr": 1e-2},
            {"params": list(a[2].named_parameters()), "tx": functools.partial(fadam.sgd, momentum=0.9), "lr": 0.1},
        ],
        fadam.adam,
    )
    assert sorted(opt.tx_states[0][0].mu) == ["bias", "weight"]  # names are the pytree keys
    assert opt.tx_states[0][0].mu["weight"].shape == body["weight"].shape
    assert sorted(opt.tx_states[1][0].trace) == sorted(head)
    ref_body = torch.optim.Adam(b[0].parameters(), lr=1e-2)
    ref_head = torch.optim.SGD(b[2].parameters(), lr=0.1, momentum=0.9)
    for step in range(10):
        x, y = _batch(step)
        for o in (opt, ref_body, ref_head):
            o.zero_grad()
        torch.nn.functional.mse_loss(a(x), y).backward()
        torch.nn.functional.mse_loss(b(x), y).backward()
        opt.step()
        ref_body.step()
        ref_head.step()
    _assert_same_params(a, b, 1e-6)


def test_add_param_group_closure_and_zero_grad():
    model = _model()
    opt = fadam.Optimizer(model[0].parameters(), fadam.sgd, lr=0.1)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.0})
    assert len(opt.tx_states) == 2 and opt.param_groups[1]["lr"] == 0.0
    frozen = [p.detach().clone() for p in model[2].parameters()]
    before = model[0].weight.detach().clone()
    x, y = _batch(0)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert torch.equal(model[0].weight.detach(), before - 0.1 * model[0].weight.grad)
    assert all(torch.equal(p.detach(), q) for p, q in zip(model[2].parameters(), frozen))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_group_without_gradients_is_left_alone():
    model = _model()
    opt = fadam.Optimizer(model.parameters(), fadam.adam, lr=0.1)
    opt.step()
    assert int(opt.tx_states[0][0].count) == 0


def test_bad_arguments_raise():
    model = _model()
    with pytest.raises(ValueError, match="no default learning rate, and a transform factory needs one"):
        fadam.Optimizer(model.parameters(), lambda lr, momentum=0.9: fadam.sgd(lr, momentum))
    assert fadam.Optimizer(model.parameters(), fadam.adam).param_groups[0]["lr"] == 1e-3  # torch.optim.Adam's
    with pytest.raises(TypeError, match="GradientTransformation or a factory"):
        fadam.Optimizer(model.parameters(), 0.1)
    with pytest.raises(ValueError, match="lr 0 cannot be the base"):
        fadam.Optimizer(model.parameters(), fadam.sgd(lr=0.1), lr=0.0)


def test_a_group_whose_transform_fails_to_initialize_is_not_added():
    model = _model()
    opt = fadam.Optimizer(model[0].parameters(), fadam.sgd, lr=0.1)

    def init(params):
        raise RuntimeError("no state for these params")

    broken = fadam.GradientTransformation(init, fadam.sgd(0.1).update)
    with pytest.raises(RuntimeError, match="no state for these params"):
        opt.add_param_group({"params": model[2].parameters(), "tx": broken, "lr": 0.1})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": model[2].parameters()})  # the params are free to join another group
    assert len(opt.param_groups) == len(opt.tx_states) == 2


# --- params that would be updated twice ----------------------------------------------------------------------------


def test_a_param_listed_twice_is_stepped_once_with_torchs_warning():
    """torch.optim warns of a duplicate param (its for-loop then steps it twice, its foreach and fused Adam give
    other numbers); fadam warns alike and steps it once, as if listed once."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    other = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        opt = fadam.Optimizer([w, other, w], fadam.adam, lr=0.1)
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        fadam.Optimizer([("a", w), ("b", w)], fadam.adam, lr=0.1)
    assert opt.param_groups[0]["params"] == [w, other] and len(opt.state_dict()["state"]) == 2
    ref_w, ref_other = (torch.nn.Parameter(p.detach().clone()) for p in (w, other))
    ref = torch.optim.Adam([ref_w, ref_other], lr=0.1)
    for step in range(3):
        for p, q in ((w, ref_w), (other, ref_other)):
            p.grad = torch.full_like(p, float(step + 1))
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(w.detach(), ref_w.detach(), rtol=1e-12, atol=0)
    # the same param in two groups is refused, as by torch.optim
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [w]})
    assert len(opt.param_groups) == 1 and len(opt.tx_states) == 1


def test_params_overlapping_in_memory_are_refused_naming_both_and_disjoint_views_step():
    buffer = torch.zeros(10)
    head, tail = torch.nn.Parameter(buffer[:6]), torch.nn.Parameter(buffer[4:])
    with pytest.raises(ValueError, match=r"param group 0 \[0\] and param group 0 \[1\] overlap in memory"):
        fadam.Optimizer([head, tail], fadam.sgd, lr=0.1)
    rows = torch.zeros(4, 3)
    opt = fadam.Optimizer([torch.nn.Parameter(rows[:2])], fadam.sgd, lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 \[0\] and param group 1 \['col'\] overlap in memory"):
        opt.add_param_group({"params": [("col", torch.nn.Parameter(rows[:, 1]))]})
    assert len(opt.param_groups) == 1 and len(opt.tx_states) == 1
    # views that do not overlap are separate params
    head, tail = torch.nn.Parameter(buffer[:4]), torch.nn.Parameter(buffer[4:])
    opt = fadam.Optimizer([head, tail], fadam.sgd, lr=0.5)
    head.grad, tail.grad = torch.ones(4), torch.full((6,), 2.0)
    opt.step()
    assert torch.equal(buffer, torch.tensor([-0.5] * 4 + [-1.0] * 6))


# --- GradScaler ----------------------------------------------------------------------------------------------------


def _scaled_step(model, opt, scaler, x, y, poison=False):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if poison:
        model[0].weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_unscales_and_skips_non_finite_steps():
    a, b = _model(), _model()
    opt_a = fadam.Optimizer(a.parameters(), fadam.adam(lr=1e-2), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    scaler_a = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler_b = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(6):
        x, y = _batch(step)
        before = [p.detach().clone() for p in a.parameters()]
        count = int(opt_a.tx_states[0][0].count)
        _scaled_step(a, opt_a, scaler_a, x, y, poison=step == 3)
        _scaled_step(b, opt_b, scaler_b, x, y, poison=step == 3)
        if step == 3:  # skipped: params and state untouched, scale backed off
            assert all(torch.equal(p.detach(), q) for p, q in zip(a.parameters(), before))
            assert int(opt_a.tx_states[0][0].count) == count
            assert scaler_a.get_scale() == 2.0**9
        else:
            assert int(opt_a.tx_states[0][0].count) == count + 1
    _assert_same_params(a, b, 1e-6)


# --- checkpoints -----------------------------------------------------------------------------------------------------


def test_state_dict_round_trip_resumes_bit_for_bit():
    a, b = _model(), _model()
    opt_a = fadam.Optimizer(a.named_parameters(), fadam.adamw, lr=1e-2)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=4, gamma=0.5)
    _train(a, opt_a, 20, scheduler=sched_a)

    opt_b = fadam.Optimizer(b.named_parameters(), fadam.adamw, lr=1e-2)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=4, gamma=0.5)
    _train(b, opt_b, 10, scheduler=sched_b)
    buffer = io.BytesIO()
    torch.save({"model": b.state_dict(), "opt": opt_b.state_dict(), "sched": sched_b.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    c = _model(seed=1)
    c.load_state_dict(saved["model"])
    opt_c = fadam.Optimizer(c.named_parameters(), fadam.adamw, lr=1e-2)
    sched_c = torch.optim.lr_scheduler.StepLR(opt_c, step_size=4, gamma=0.5)
    opt_c.load_state_dict(saved["opt"])
    sched_c.load_state_dict(saved["sched"])
    _train(c, opt_c, 10, start=10, scheduler=sched_c)
    _assert_same_params(c, a, 0.0)


def test_load_state_dict_names_the_mismatch_and_loads_nothing():
    small = fadam.Optimizer(torch.nn.Linear(3, 2).parameters(), fadam.adam, lr=0.1)
    big_model = torch.nn.Linear(4, 2)
    big = fadam.Optimizer(big_model.parameters(), fadam.adam, lr=0.2)
    _train_linear(big_model, big)
    state = big.tx_states[0]
    before = [t.clone() for t in optree.tree_leaves(state)]
    with pytest.raises(ValueError, match=r"param group 0, param \[0\], state\[0\]\.mu: expected shape \(2, 4\)"):
        big.load_state_dict(small.state_dict())
    assert big.tx_states[0] is state
    assert all(torch.equal(x, y) for x, y in zip(before, optree.tree_leaves(state)))
    assert big.param_groups[0]["lr"] == 0.2


def _train_linear(model, opt):
    opt.zero_grad()
    model(torch.ones(1, model.in_features)).sum().backward()
    opt.step()


# --- torch.optim state import / export --------------------------------------------------------------------------------


def _functional_loss(params, model, x, y):
    return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


@pytest.mark.parametrize(
    ("torch_make", "tx"),
    [
        (lambda ps: torch.optim.Adam(ps, lr=1e-2), fadam.adam(lr=1e-2)),
        (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True), fadam.adam(lr=1e-2, amsgrad=True)),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), fadam.adamw(lr=1e-2, weight_decay=0.1)),
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), fadam.sgd(lr=1e-2, momentum=0.9)),
        (lambda ps: torch.optim.NAdam(ps, lr=1e-2), fadam.nadam(lr=1e-2)),
        (
            lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.5),
            fadam.rmsprop(lr=1e-3, centered=True, momentum=0.5),
        ),
        (lambda ps: torch.optim.Adagrad(ps, lr=1e-1, lr_decay=0.05), fadam.adagrad(lr=1e-1, lr_decay=0.05)),
    ],
    ids=["adam", "amsgrad", "adamw", "sgd-momentum", "nadam", "rmsprop-centered-momentum", "adagrad-lr-decay"],
)
def test_switching_from_torch_to_fadam_and_back_mid_run(torch_make, tx):
    stay, switch = _model(), _model()
    opt_stay = torch_make(stay.parameters())
    _train(stay, opt_stay, 30)

    opt_torch = torch_make(switch.parameters())
    _train(switch, opt_torch, 10)
    # torch -> fadam (functional loop over named params)
    params = {k: v.detach() for k, v in switch.named_parameters()}
    named = dict(switch.named_parameters())
    state = fadam.state_from_torch(opt_torch, tx, {k: named[k] for k in params})
    for step in range(10, 20):
        x, y = _batch(step)
        grads = torch.func.grad(_functional_loss)(params, switch, x, y)
        params, state = fadam.step(tx, params, grads, state)
    with torch.no_grad():
        for k, v in params.items():
            named[k].copy_(v)
    # fadam -> torch
    opt_back = torch_make(switch.parameters())
    opt_back.load_state_dict(fadam.state_to_torch(state, {k: named[k] for k in params}, opt_back))
    _train(switch, opt_back, 10, start=20)
    _assert_same_params(switch, stay, 1e-5)


def test_state_from_a_torch_state_dict_matches_by_name():
    model = _model()
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    _train(model, opt, 3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fadam.state_from_torch(opt.state_dict(), fadam.adam(lr=1e-2), params)
    for name, p in model.named_parameters():
        assert torch.equal(state[0].mu[name], opt.state[p]["exp_avg"])
    assert int(state[0].count) == 3


def test_state_from_torch_refuses_different_per_param_steps():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[2].bias.grad = None  # this param skips the first step: its torch step lags behind
    opt.step()
    _train(model, opt, 2, start=1)
    with pytest.raises(ValueError, match=r"per-param steps differ .*\[3\]: 2"):
        fadam.state_from_torch(opt, fadam.adam(lr=1e-2), list(model.parameters()))


def test_complex_params_follow_torch():
    torch.manual_seed(0)
    z = torch.randn(4, 3, dtype=torch.complex64)
    target = torch.randn(4, 3, dtype=torch.complex64)
    a, b = torch.nn.Parameter(z.clone()), torch.nn.Parameter(z.clone())
    opt_a = fadam.Optimizer([a], functools.partial(fadam.nadam, weight_decay=0.01), lr=1e-2)
    opt_b = torch.optim.NAdam([b], lr=1e-2, weight_decay=0.01)
    for opt, p in ((opt_a, a), (opt_b, b)):
        for _ in range(STEPS):
            opt.zero_grad()
            (p - target).abs().pow(2).sum().backward()
            opt.step()
    assert float((a - b).detach().abs().max() / b.detach().abs().max()) < 1e-6
