"""Schedule-Free AdamW and SGD against the ``schedulefree`` package's float64 trajectories (train point ``y`` and
evaluation point ``x``), as transforms and through ``fadam.Optimizer`` with ``train()`` and ``eval()``; the wrapper
against its equations; the train and eval modes of the bridge.

The reference values (tests/data/schedulefree.json) were computed by schedulefree 1.4.1 on torch 2.13 in float64, on
the fixed gradient sequence stored beside them (scripts/schedulefree_reference.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fadam
from fadam.transforms._schedule_free import schedule_free_train_params

REFERENCE = json.loads((Path(__file__).parent / "data" / "schedulefree.json").read_text())
CASES = REFERENCE["cases"]
TOLERANCE = 1e-10  # max abs difference, float64; the measured one is below 1e-15


def _factory(case: dict) -> Any:
    return fadam.schedule_free_adamw if case["class"] == "AdamWScheduleFree" else fadam.schedule_free_sgd


def _fadam_kwargs(case: dict) -> dict[str, Any]:
    """The reference's arguments under fadam's (optax's) names: ``lr`` -> ``learning_rate``, ``betas`` -> ``b1, b2``,
    ``momentum`` -> ``b1``."""
    kwargs = dict(case["kwargs"])
    renamed: dict[str, Any] = {}
    if "lr" in kwargs:
        renamed["learning_rate"] = kwargs.pop("lr")
    if "betas" in kwargs:
        renamed["b1"], renamed["b2"] = kwargs.pop("betas")
    if "momentum" in kwargs:
        renamed["b1"] = kwargs.pop("momentum")
    return {**renamed, **kwargs}


def _tensors(values: dict[str, list]) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(v, dtype=torch.float64) for name, v in values.items()}


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, list]) -> float:
    return max(float((got[name] - w).abs().max()) for name, w in _tensors(want).items())


def _functional_diffs(tx: fadam.GradientTransformation, case: dict) -> float:
    """The largest difference of ``y`` and ``x`` from the reference's at its checkpoints, stepping with ``fadam.step``
    (the generated kernel where the backend allows it)."""
    params = _tensors(REFERENCE["start"])
    state = tx.init(params)
    worst, checkpoint = 0.0, 0
    for t, g in enumerate(REFERENCE["grads"], start=1):
        params, state = fadam.step(tx, params, _tensors(g), state)
        if t in REFERENCE["checkpoints"]:
            x = fadam.schedule_free_eval_params(state, params)
            worst = max(worst, _max_diff(params, case["y"][checkpoint]), _max_diff(x, case["x"][checkpoint]))
            checkpoint += 1
    assert checkpoint == len(REFERENCE["checkpoints"])
    return worst


def test_reference_covers_both_optimizers_over_200_steps():
    assert REFERENCE["schedulefree_version"] == "1.4.1"
    assert REFERENCE["steps"] >= 200 and REFERENCE["checkpoints"][-1] == REFERENCE["steps"]
    assert {case["class"] for case in CASES} == {"AdamWScheduleFree", "SGDScheduleFree"}


@pytest.mark.parametrize("backend", ["eager", "kernel"])
@pytest.mark.parametrize("case", [c for c in CASES if not c["switch_every"]], ids=lambda c: c["name"])
def test_matches_schedulefree_float64_trajectory(case, backend):
    with fadam.backend(backend):
        assert _functional_diffs(_factory(case)(**_fadam_kwargs(case)), case) <= TOLERANCE


def test_the_reference_comparison_can_fail():
    """A small change of b1 moves the trajectory outside the tolerance."""
    case = next(c for c in CASES if c["name"] == "adamw-default")
    assert _functional_diffs(fadam.schedule_free_adamw(b1=0.9 + 1e-6), case) > TOLERANCE


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_optimizer_with_train_and_eval_matches_schedulefree(case):
    """``fadam.Optimizer`` over a factory, in train mode from the start; ``eval()`` on a deep copy gives ``x``, and
    the cases that switch call ``eval()`` then ``train()`` on the optimizer itself, as the reference did."""
    params = {name: torch.nn.Parameter(v) for name, v in _tensors(REFERENCE["start"]).items()}
    kwargs = _fadam_kwargs(case)
    lr = kwargs.pop("learning_rate", _default_lr(case))
    opt = fadam.Optimizer(params.items(), _factory(case), lr=lr, **kwargs)
    checkpoint = 0
    for t, g in enumerate(REFERENCE["grads"], start=1):
        for name, p in params.items():
            p.grad = torch.tensor(g[name], dtype=torch.float64)
        opt.step()
        if t in REFERENCE["checkpoints"]:
            twin_params, twin = copy.deepcopy((params, opt))
            twin.eval()
            assert _max_diff({n: p.detach() for n, p in params.items()}, case["y"][checkpoint]) <= TOLERANCE
            assert _max_diff({n: p.detach() for n, p in twin_params.items()}, case["x"][checkpoint]) <= TOLERANCE
            checkpoint += 1
        if case["switch_every"] and t % case["switch_every"] == 0:
            opt.eval()
            opt.train()


def _default_lr(case: dict) -> float:
    return 0.0025 if case["class"] == "AdamWScheduleFree" else 1.0


# ---------------------------------------------------------------------------------------------------------- math


def _sequences(b1: float, ck: list[float], steps: list[torch.Tensor], y0: torch.Tensor) -> tuple:
    """The paper's three sequences from base steps ``d_t`` and weights ``c_t``: z, x and y after the last step."""
    z, x = y0.clone(), y0.clone()
    for c, d in zip(ck, steps):
        z = z + d
        x = (1 - c) * x + c * z
    return z, x, b1 * x + (1 - b1) * z


def test_schedule_free_follows_the_three_sequences_of_the_paper():
    """With a base of plain SGD, a learning rate 0 on the first step (no weight yet: c = 0) and r = 1, the params are
    ``b1 x + (1 - b1) z``, ``x`` the weighted average of the ``z`` and ``schedule_free_eval_params`` gives ``x``."""
    rates = [0.0, 0.1, 0.3, 0.2, 0.2]
    b1, r, power = 0.7, 1.0, 2.0

    def schedule(count: torch.Tensor) -> float:
        return rates[int(count)]

    tx = fadam.schedule_free(fadam.sgd(schedule), schedule, b1=b1, weight_lr_power=power, r=r)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, generator=gen, dtype=torch.float64) for _ in rates]
    y = torch.randn(4, generator=gen, dtype=torch.float64)
    y0, state, steps, ck, weight_sum, lr_max = y.clone(), tx.init([y]), [], [], 0.0, -1.0
    for t, (rate, g) in enumerate(zip(rates, grads), start=1):
        lr_max = max(lr_max, rate)
        weight = t**r * lr_max**power
        weight_sum += weight
        ck.append(weight / weight_sum if weight_sum else 0.0)
        steps.append(-rate * g)
        updates, state = tx.update([g], state, [y])
        y = y + updates[0]
    z, x, want_y = _sequences(b1, ck, steps, y0)
    assert ck[0] == 0.0 and ck[1] == 1.0  # the first weighted step restarts the average at z
    torch.testing.assert_close(state[1].z[0], z, rtol=0, atol=1e-14)
    torch.testing.assert_close(y, want_y, rtol=0, atol=1e-14)
    torch.testing.assert_close(fadam.schedule_free_eval_params(state, [y])[0], x, rtol=0, atol=1e-14)
    assert float(state[1].weight_sum) == pytest.approx(weight_sum, rel=1e-15)
    assert float(state[1].lr_max) == 0.3 and int(state[1].count) == len(rates)


def test_the_wrapper_over_sgd_is_schedule_free_sgd_bit_for_bit():
    params = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)}
    grads = [{"w": torch.full_like(params["w"], 0.5 * (-1) ** t + 0.1 * t)} for t in range(6)]
    results = []
    for tx in (fadam.schedule_free(fadam.sgd(0.3), 0.3, b1=0.8), fadam.schedule_free_sgd(0.3, b1=0.8)):
        p, state = params, tx.init(params)
        for g in grads:
            p, state = fadam.step(tx, p, g, state)
        results.append(p["w"])
    assert torch.equal(results[0], results[1])


def test_eval_params_round_trip_and_leave_unstepped_leaves():
    """Only the leaves a schedule-free transform steps move to ``x`` (``partition``); ``y`` and ``x`` differ once
    ``z`` has left ``y``; a state without a schedule-free part is refused."""
    params = {"w": torch.ones(2, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float64)}
    tx = fadam.partition({"sf": fadam.schedule_free_sgd(0.5), "plain": fadam.sgd(0.1)}, {"w": "sf", "b": "plain"})
    state = tx.init(params)
    for g in (torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])):
        params, state = fadam.step(tx, params, {"w": g.double(), "b": torch.ones(1, dtype=torch.float64)}, state)
    x = fadam.schedule_free_eval_params(state, params)
    assert x["b"] is params["b"]
    assert float((x["w"] - params["w"]).abs().max()) > 1e-3
    back = schedule_free_train_params(state, x)
    torch.testing.assert_close(back["w"], params["w"], rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="no ScheduleFreeState"):
        fadam.schedule_free_eval_params(fadam.sgd(0.1).init(params), params)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="b1"):
        fadam.schedule_free_sgd(b1=1.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        fadam.schedule_free_adamw(warmup_steps=-1)
    with pytest.raises(ValueError, match="learning_rate"):
        fadam.schedule_free(fadam.sgd(0.1), -0.1)


# ---------------------------------------------------------------------------------------------------------- bridge


def _stepped_model(tx: Any = fadam.schedule_free_adamw, **options: Any) -> tuple[torch.nn.Linear, fadam.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    opt = fadam.Optimizer(model.parameters(), tx, **options)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(4, 3, dtype=torch.float64)).square().sum().backward()
        opt.step()
    return model, opt


def test_eval_sets_x_and_train_sets_y_back():
    model, opt = _stepped_model(lr=0.1)
    y = [p.detach().clone() for p in model.parameters()]
    want_x = fadam.schedule_free_eval_params(opt.tx_states[0], y)
    opt.eval()
    opt.eval()  # a second eval leaves x where it is
    assert all(torch.equal(p.detach(), x) for p, x in zip(model.parameters(), want_x))
    assert any(not torch.equal(x, p) for x, p in zip(want_x, y))
    assert opt.param_groups[0]["train_mode"] is False and opt.state_dict()["param_groups"][0]["train_mode"] is False
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step()
    opt.train()
    for p, want in zip(model.parameters(), y):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-15)  # lerp back: y up to rounding
    opt.step()  # train mode again


def test_train_and_eval_refuse_transforms_that_are_not_schedule_free():
    model, opt = _stepped_model(fadam.adamw, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for switch in (opt.eval, opt.train):
        with pytest.raises(TypeError, match="not one"):
            switch()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert "train_mode" not in opt.param_groups[0]
