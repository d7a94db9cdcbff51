"""Prodigy against ``prodigyopt.Prodigy``'s float64 trajectories (``d`` included); MARS against the paper's equations
written out here; Lookahead and SAM against optax's float64 trajectories and their papers' equations.

The reference values were computed in float64 by prodigyopt 1.1.2 on torch 2.13 (tests/data/prodigy.json,
scripts/prodigy_reference.py) and by optax 0.2.8 with jax (tests/data/optax_lookahead_sam.json,
scripts/optax_lookahead_sam_reference.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import vmap

import fadam

DATA = Path(__file__).parent / "data"
PRODIGY = json.loads((DATA / "prodigy.json").read_text())
OPTAX = json.loads((DATA / "optax_lookahead_sam.json").read_text())
PRODIGY_TOLERANCE = 1e-10  # relative for d, d_max, d_numerator; absolute for the params (measured: below 1e-13)


def _f64(value: Any) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------------- Prodigy


def _prodigy_kwargs(case: dict) -> dict[str, Any]:
    kwargs = dict(case["kwargs"])
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if "warmup_steps" in case:  # the reference's LambdaLR, min(1, n / steps) at the n-th step from 0
        kwargs["lr"] = lambda count, steps=case["warmup_steps"]: (count.to(torch.float64) / steps).clamp(max=1.0)
    return kwargs


def _prodigy_errors(tx: fadam.GradientTransformation, case: dict) -> tuple[float, float]:
    """The largest relative error of ``d``, ``d_max``, ``d_numerator`` over every step, and the largest absolute
    error of the params at the checkpoints, replaying the reference's gradients."""
    params = {name: _f64(v) for name, v in PRODIGY["start"].items()}
    state = tx.init(params)
    worst_d = worst_p = 0.0
    checkpoint = 0
    for t, step_grads in enumerate(case["grads"], start=1):
        grads = {name: None if g is None else _f64(g) for name, g in step_grads.items()}
        updates, state = tx.update(grads, state, params)
        params = fadam.apply_updates(params, updates)
        for key in ("d", "d_max", "d_numerator"):
            want = case[key][t - 1]
            worst_d = max(worst_d, abs(float(getattr(state, key)) - want) / max(abs(want), 1e-300))
        if t in PRODIGY["checkpoints"]:
            for name, want in case["params"][checkpoint].items():
                worst_p = max(worst_p, float((params[name] - _f64(want)).abs().max()))
            checkpoint += 1
    assert checkpoint == len(PRODIGY["checkpoints"])
    return worst_d, worst_p


def test_prodigy_reference_covers_100_steps_and_growing_d():
    assert PRODIGY["prodigyopt_version"] == "1.1.2" and PRODIGY["steps"] >= 100
    for case in PRODIGY["cases"]:
        assert case["d"][-1] > 100 * case["d"][0], case["name"]  # the estimate moved far from d0


@pytest.mark.parametrize("case", PRODIGY["cases"], ids=lambda case: case["name"])
def test_prodigy_matches_prodigyopt_float64_trajectory(case):
    worst_d, worst_p = _prodigy_errors(fadam.prodigy(**_prodigy_kwargs(case)), case)
    assert worst_d <= PRODIGY_TOLERANCE and worst_p <= PRODIGY_TOLERANCE


def test_prodigy_zero_gradients_take_no_step_and_missing_ones_are_left_out():
    case = next(c for c in PRODIGY["cases"] if c["name"] == "zero-start-missing-grads")
    tx = fadam.prodigy(**_prodigy_kwargs(case))
    params = {name: _f64(v) for name, v in PRODIGY["start"].items()}
    state = tx.init(params)
    zeros = {name: torch.zeros_like(p) for name, p in params.items()}
    updates, state = tx.update(zeros, state, params)
    assert (int(state.count), int(state.k)) == (1, 0) and float(state.d) == case["kwargs"]["d0"]
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    updates, state = tx.update({**zeros, "b": None, "w": torch.ones_like(params["w"])}, state, params)
    assert updates["b"] is None and torch.equal(state.exp_avg_sq["b"], torch.zeros(3, dtype=torch.float64))
    assert (int(state.count), int(state.k)) == (2, 1)


def test_prodigy_warmup_from_zero_moves_after_its_first_step():
    """A schedule reads every step taken (a torch.optim scheduler's count), the bias correction only the steps that
    moved: the lr of 0 at step 0 moves nothing, the next steps move (the reference's numbers: the trajectory test)."""
    case = next(c for c in PRODIGY["cases"] if "warmup_steps" in c)
    tx = fadam.prodigy(**_prodigy_kwargs(case))
    start = {name: _f64(v) for name, v in PRODIGY["start"].items()}
    params, state = start, tx.init(start)
    for t, step_grads in enumerate(case["grads"][:3], start=1):
        params, state = fadam.step(tx, params, {name: _f64(g) for name, g in step_grads.items()}, state)
        moved = any(not torch.equal(params[name], p) for name, p in start.items())
        assert moved == (t > 1) and (int(state.count), int(state.k)) == (t, t - 1)


def test_prodigy_comparison_can_fail():
    case = PRODIGY["cases"][0]
    worst_d, _ = _prodigy_errors(fadam.prodigy(d_coef=1.0 + 1e-7), case)
    assert worst_d > PRODIGY_TOLERANCE


def test_prodigy_under_vmap_equals_separate_runs():
    """Two members with different gradients, so their ``d`` differ: the global sums are per member."""
    tx = fadam.prodigy(weight_decay=0.01, use_bias_correction=True)
    start = torch.stack([_f64([1.0, -2.0, 0.5]), _f64([0.3, 0.2, -1.0])])
    params, state = start, vmap(tx.init)(start)
    for _ in range(12):
        updates, state = vmap(tx.update)(2 * params - 0.1, state, params)
        params = fadam.apply_updates(params, updates)
    for i in range(2):
        p, s = start[i], tx.init(start[i])
        for _ in range(12):
            u, s = tx.update(2 * p - 0.1, s, p)
            p = fadam.apply_updates(p, u)
        torch.testing.assert_close(params[i], p, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(state.d[i], s.d, rtol=1e-13, atol=0)
    assert float((state.d[0] - state.d[1]).abs()) > 0


def test_prodigy_without_first_moment_keeps_none_and_runs_under_vmap():
    tx = fadam.prodigy(betas=(0.0, 0.99), d0=1e-3)
    start = torch.stack([_f64([1.0, -2.0]), _f64([0.5, 0.5])])
    params, state = start, vmap(tx.init)(start)
    assert state.exp_avg == ()
    for _ in range(5):
        updates, state = vmap(tx.update)(params - 0.3, state, params)
        params = fadam.apply_updates(params, updates)
    p, s = start[1], tx.init(start[1])
    for _ in range(5):
        u, s = tx.update(p - 0.3, s, p)
        p = fadam.apply_updates(p, u)
    torch.testing.assert_close(params[1], p, rtol=1e-13, atol=1e-15)


def test_prodigy_arguments_are_checked():
    with pytest.raises(ValueError, match="d0"):
        fadam.prodigy(d0=0.0)
    with pytest.raises(ValueError, match="learning rate"):
        fadam.prodigy(lr=0.0)
    with pytest.raises(ValueError, match="needs params"):
        tx = fadam.prodigy()
        tx.update([torch.ones(1)], tx.init([torch.ones(1)]))


# ---------------------------------------------------------------------------------------------------------- MARS


def _mars_equations(grads: list[list[torch.Tensor]], b1: float, b2: float, eps: float, gamma: float) -> list:
    """MARS-AdamW (Algorithm 2 of the paper, approximate form) written out for each leaf: the updates per step."""
    n = len(grads[0])
    last = [torch.zeros_like(g) for g in grads[0]]
    m = [torch.zeros_like(g) for g in grads[0]]
    v = [torch.zeros_like(g) for g in grads[0]]
    out = []
    for t, step in enumerate(grads, start=1):
        row = []
        for i in range(n):
            c = step[i] + gamma * b1 / (1 - b1) * (step[i] - last[i])
            norm = math.sqrt(float((c * c).sum()))
            if norm > 1:
                c = c / norm
            m[i] = b1 * m[i] + (1 - b1) * c
            v[i] = b2 * v[i] + (1 - b2) * c * c
            row.append((m[i] / (1 - b1**t)) / (torch.sqrt(v[i] / (1 - b2**t)) + eps))
            last[i] = step[i]
        out.append(row)
    return out


def _mars_grads(steps: int) -> list[list[torch.Tensor]]:
    """Two leaves: a matrix whose corrected gradient is clipped on some steps (large, changing), a small vector never
    clipped."""
    gen = torch.Generator().manual_seed(3)
    return [
        [3.0 * torch.randn(3, 4, generator=gen, dtype=torch.float64), 0.05 * torch.randn(5, generator=gen).double()]
        for _ in range(steps)
    ]


@pytest.mark.parametrize("backend", ["eager", "kernel"])
def test_scale_by_mars_follows_the_papers_equations(backend):
    b1, b2, eps, gamma = 0.9, 0.98, 1e-6, 0.05
    grads = _mars_grads(25)
    tx = fadam.scale_by_mars(b1, b2, eps, gamma)
    state = tx.init(grads[0])
    with fadam.backend(backend):
        for got_row, want_row in zip(_run_updates(tx, state, grads), _mars_equations(grads, b1, b2, eps, gamma)):
            for got, want in zip(got_row, want_row):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _run_updates(tx: fadam.GradientTransformation, state: Any, grads: list) -> list:
    rows = []
    for g in grads:
        updates, state = tx.update(g, state, g)
        rows.append(updates)
    return rows


def test_mars_clipping_engages_and_the_comparison_can_fail():
    grads = _mars_grads(5)
    c = grads[0][0] * (1 + 0.025 * 0.95 / 0.05)
    assert float(c.norm()) > 1 and float((grads[0][1] * 1.475).norm()) < 1
    want = _mars_equations(grads, 0.95, 0.99, 1e-8, 0.025)
    got = _run_updates(fadam.scale_by_mars(gamma=0.026), fadam.scale_by_mars().init(grads[0]), grads)
    assert float((got[-1][0] - want[-1][0]).abs().max()) > 1e-6


def test_mars_alias_steps_matrices_by_mars_and_the_rest_by_adamw():
    lr, wd, lr_1d, wd_1d = 0.01, 0.1, 0.02, 0.05
    tx = fadam.mars(lr, weight_decay=wd, lr_1d=lr_1d, weight_decay_1d=wd_1d)
    grads = _mars_grads(10)
    params = [torch.ones(3, 4, dtype=torch.float64), torch.full((5,), -0.5, dtype=torch.float64)]
    state = tx.init(params)
    mars_dirs = _mars_equations(grads, 0.95, 0.99, 1e-8, 0.025)
    b1, b2 = 0.9, 0.95
    m = v = torch.zeros(5, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        m, v = b1 * m + (1 - b1) * g[1], b2 * v + (1 - b2) * g[1] ** 2
        adam = (m / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t)) + 1e-8)
        want = [params[0] - lr * (mars_dirs[t - 1][0] + wd * params[0]), params[1] - lr_1d * (adam + wd_1d * params[1])]
        updates, state = tx.update(g, state, params)
        params = fadam.apply_updates(params, updates)
        for got, expected in zip(params, want):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    everything = fadam.mars(lr, optimize_1d=True)
    updates, _ = everything.update(grads[0], everything.init(params), params)
    torch.testing.assert_close(updates[1], -lr * _mars_equations(grads[:1], 0.95, 0.99, 1e-8, 0.025)[0][1])


# ----------------------------------------------------------------------------------------------------- Lookahead


def _quadratic_grad(x: torch.Tensor) -> torch.Tensor:
    return _f64(OPTAX["a"]) * (x - _f64(OPTAX["c"]))


def _build(spec: dict[str, float]) -> fadam.GradientTransformation:
    ((kind, rate),) = spec.items()
    if kind == "sgd":
        return fadam.sgd(rate)
    if kind == "adam":
        return fadam.adam(rate)
    return fadam.chain(fadam.normalize(), fadam.sgd(rate))


def _lookahead_run(case: dict, batched: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = {k: v for k, v in case["kwargs"].items() if k != "fast"}
    tx = fadam.lookahead(_build(case["kwargs"]["fast"]), **kwargs)
    params = fadam.LookaheadParams.init_synced(_f64(OPTAX["start"]))
    init, update = (vmap(tx.init), vmap(tx.update)) if batched else (tx.init, tx.update)
    if batched:
        params = fadam.LookaheadParams(params.fast[None], params.slow[None])
    state = init(params)
    fast, slow = [], []
    for _ in range(OPTAX["steps"]):
        updates, state = update(_quadratic_grad(params.fast), state, params)
        params = fadam.apply_updates(params, updates)
        fast.append(params.fast.reshape(-1))
        slow.append(params.slow.reshape(-1))
    return torch.stack(fast), torch.stack(slow)


LOOKAHEAD_CASES = [case for case in OPTAX["cases"] if case["kind"] == "lookahead"]
SAM_CASES = [case for case in OPTAX["cases"] if case["kind"] == "sam"]


@pytest.mark.parametrize("batched", [False, True], ids=["eager", "vmap"])
@pytest.mark.parametrize("case", LOOKAHEAD_CASES, ids=lambda case: case["name"])
def test_lookahead_matches_optax_float64_trajectory(case, batched):
    fast, slow = _lookahead_run(case, batched)
    torch.testing.assert_close(fast, _f64(case["fast"]), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(slow, _f64(case["slow"]), rtol=1e-12, atol=1e-14)


def test_lookahead_follows_the_papers_two_loops():
    """Algorithm 1: k fast SGD steps from the slow weights, then ``slow += alpha (fast - slow)``; a ``None`` gradient
    on the last fast step still synchronises its leaf."""
    k, alpha, lr = 3, 0.4, 0.1
    tx = fadam.lookahead(fadam.sgd(lr), k, alpha)
    start = [_f64([1.0, -2.0]), _f64([0.5])]
    params = fadam.LookaheadParams.init_synced(start)
    state = tx.init(params)
    slow = [p.clone() for p in start]
    for _ in range(4):
        fast = [p.clone() for p in slow]
        for inner in range(k):
            grads = [2 * fast[0], None if inner == k - 1 else fast[1] - 3]
            fast = [f if g is None else f - lr * g for f, g in zip(fast, grads)]
            updates, state = tx.update([2 * params.fast[0], grads[1]], state, params)
            params = fadam.apply_updates(params, updates)
        slow = [s + alpha * (f - s) for s, f in zip(slow, fast)]
        for got_fast, got_slow, want in zip(params.fast, params.slow, slow):
            torch.testing.assert_close(got_slow, want, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(got_fast, want, rtol=1e-12, atol=1e-15)


def test_lookahead_reset_state_and_contract():
    tx = fadam.lookahead(fadam.adam(0.1), sync_period=2, slow_step_size=0.5, reset_state=True)
    params = fadam.LookaheadParams.init_synced([_f64([1.0])])
    assert params.slow[0] is not params.fast[0]
    state = tx.init(params.fast)  # init also takes the fast params alone
    for expected_count in (1, 0, 1):
        updates, state = tx.update([_f64([1.0])], state, params)
        params = fadam.apply_updates(params, updates)
        assert int(state.fast_state[0].count) == expected_count  # adam's moments restart after each sync
    with pytest.raises(ValueError, match="LookaheadParams"):
        tx.update([_f64([1.0])], state, [_f64([1.0])])
    with pytest.raises(ValueError, match="sync_period"):
        fadam.lookahead(fadam.sgd(0.1), 0, 0.5)


# ----------------------------------------------------------------------------------------------------------- SAM


def _sam_run(case: dict, batched: bool = False) -> torch.Tensor:
    kwargs = {k: v for k, v in case["kwargs"].items() if k not in ("optimizer", "adv_optimizer")}
    tx = fadam.sam(_build(case["kwargs"]["optimizer"]), _build(case["kwargs"]["adv_optimizer"]), **kwargs)
    params = _f64(OPTAX["start"])
    init, update = (vmap(tx.init), vmap(tx.update)) if batched else (tx.init, tx.update)
    if batched:
        params = params[None]
    state = init(params)
    extra = {"grad_fn": lambda p, i: _quadratic_grad(p)} if kwargs.get("opaque_mode") else {}
    rows = []
    for _ in range(OPTAX["steps"]):
        updates, state = update(_quadratic_grad(params), state, params, **extra)
        params = fadam.apply_updates(params, updates)
        rows.append(params.reshape(-1))
    return torch.stack(rows)


# opaque mode calls grad_fn in a Python loop: there is no traced branch to check under vmap
_SAM_RUNS = [
    pytest.param(case, batched, id=f"{case['name']}-{'vmap' if batched else 'eager'}")
    for case in SAM_CASES
    for batched in (False, True)
    if not (batched and case["kwargs"].get("opaque_mode"))
]


@pytest.mark.parametrize(("case", "batched"), _SAM_RUNS)
def test_sam_matches_optax_float64_trajectory(case, batched):
    torch.testing.assert_close(_sam_run(case, batched), _f64(case["params"]), rtol=1e-12, atol=1e-14)


def test_sam_follows_the_papers_two_step_update():
    """``e = rho g / ||g||``, then ``theta -= lr * grad(theta + e)``, on two leaves (the norm is global)."""
    rho, lr = 0.2, 0.1
    tx = fadam.sam(fadam.sgd(lr), fadam.chain(fadam.normalize(), fadam.sgd(rho)))
    theta = [_f64([1.0, -0.5]), _f64([2.0])]

    def grad(x: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.sin(x[0]) + x[0], x[1] ** 3]

    params, state = theta, tx.init(theta)
    for _ in range(5):
        g = grad(theta)
        norm = math.sqrt(sum(float((t * t).sum()) for t in g))
        theta = [t - lr * ga for t, ga in zip(theta, grad([t + rho * gt / norm for t, gt in zip(theta, g)]))]
        for _ in range(2):
            updates, state = tx.update(grad(params), state, params)
            params = fadam.apply_updates(params, updates)
        for got, want in zip(params, theta):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_normalize_divides_by_the_global_norm_and_keeps_zero_gradients_zero():
    tx = fadam.normalize()
    updates, _ = tx.update([_f64([3.0]), _f64([[0.0, 4.0]])], tx.init(None))
    assert updates[0].tolist() == [0.6] and updates[1].tolist() == [[0.0, 0.8]]
    zeros, _ = tx.update([torch.zeros(2, dtype=torch.float64)], tx.init(None))
    assert torch.equal(zeros[0], torch.zeros(2, dtype=torch.float64))  # optax's gives NaN


def test_sam_with_sync_period_1_is_the_outer_optimizer():
    tx, plain = fadam.sam(fadam.adam(0.1), fadam.sgd(0.5), sync_period=1), fadam.adam(0.1)
    params = other = [_f64([1.0, -2.0])]
    state, plain_state = tx.init(params), plain.init(params)
    for _ in range(4):
        updates, state = tx.update([2 * params[0]], state, params)
        params = fadam.apply_updates(params, updates)
        plain_updates, plain_state = plain.update([2 * other[0]], plain_state, other)
        other = fadam.apply_updates(other, plain_updates)
        torch.testing.assert_close(params[0], other[0], rtol=1e-15, atol=1e-15)


def test_sam_contract():
    tx = fadam.sam(fadam.sgd(0.1), fadam.sgd(0.1), opaque_mode=True)
    params = [_f64([1.0])]
    with pytest.raises(ValueError, match="grad_fn"):
        tx.update([_f64([1.0])], tx.init(params), params)
    with pytest.raises(ValueError, match="needs params"):
        fadam.sam(fadam.sgd(0.1), fadam.sgd(0.1)).update([_f64([1.0])], tx.init(params))
