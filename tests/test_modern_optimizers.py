"""ADOPT, AdEMAMix, Yogi and AdaBelief against optax's float64 trajectories; the cautious wrapper against the
Cautious optimizers' equations written out here; ademamix8bit against full-precision AdEMAMix.

The optax values (tests/data/optax_modern.json) were computed by optax 0.2.8 with jax in float64, on the fixed
gradient sequence stored beside them (scripts/optax_modern_reference.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fadam

REFERENCE = json.loads((Path(__file__).parent / "data" / "optax_modern.json").read_text())
GRADS = torch.tensor(REFERENCE["grads"], dtype=torch.float64)
START = torch.tensor(REFERENCE["start"], dtype=torch.float64)

# optax's function -> fadam's of the same name and arguments
FADAM_NAMES = {
    "contrib.scale_by_adopt": "scale_by_adopt",
    "contrib.adopt": "adopt",
    "contrib.scale_by_ademamix": "scale_by_ademamix",
    "contrib.ademamix": "ademamix",
    "scale_by_yogi": "scale_by_yogi",
    "yogi": "yogi",
    "scale_by_belief": "scale_by_belief",
    "adabelief": "adabelief",
}


def _resolve(value: Any) -> Any:
    """A stored argument: a number, a flag, or ``{"schedule": name, "kwargs": ...}`` (fadam's schedule of optax's
    name, checked against optax's values in tests/test_schedules.py)."""
    if isinstance(value, dict) and "schedule" in value:
        return getattr(fadam, value["schedule"])(**value["kwargs"])
    return value


def _trajectory(tx: fadam.GradientTransformation, kind: str, grads: torch.Tensor) -> torch.Tensor:
    """Updates (a transform) or params (an alias) after each step, from ``START``."""
    params = START.clone()
    state = tx.init(params)
    rows = []
    for g in grads:
        updates, state = tx.update(g.clone(), state, params)
        if kind == "alias":
            params = fadam.apply_updates(params, updates)
            rows.append(params)
        else:
            rows.append(updates)
    return torch.stack(rows)


def _build(case: dict) -> fadam.GradientTransformation:
    factory = getattr(fadam, FADAM_NAMES[case["optax"]])
    return factory(**{name: _resolve(value) for name, value in case["kwargs"].items()})


@pytest.mark.parametrize("backend", ["eager", "kernel"])
@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda case: case["name"])
def test_matches_optax_float64_trajectory(case, backend):
    with fadam.backend(backend):
        got = _trajectory(_build(case), case["kind"], GRADS)
    want = torch.tensor(case["values"], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-15)


def test_every_new_optax_name_has_a_reference_case():
    assert {case["optax"] for case in REFERENCE["cases"]} == set(FADAM_NAMES)
    assert REFERENCE["optax_version"] == "0.2.8"


def test_the_reference_comparison_can_fail():
    """A small change of a hyperparameter moves the trajectory outside the tolerance."""
    case = next(case for case in REFERENCE["cases"] if case["name"] == "adopt-default")
    got = _trajectory(fadam.scale_by_adopt(b1=0.9 + 1e-6), "transform", GRADS)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, torch.tensor(case["values"], dtype=torch.float64), rtol=1e-10, atol=1e-15)


# ---------------------------------------------------------------------------------------------------------- ADOPT


def test_adopt_first_step_only_initialises_the_second_moment():
    tx = fadam.scale_by_adopt(use_clipping=False)
    g = torch.tensor([3.0, -0.5, 0.0], dtype=torch.float64)
    updates, state = tx.update(g, tx.init(torch.zeros(3, dtype=torch.float64)))
    assert torch.equal(updates, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(state.mu, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(state.nu, g * g)
    assert int(state.count) == 1


def test_adopt_normalizes_by_the_previous_second_moment_and_clips():
    b1, b2, eps = 0.8, 0.6, 1e-6
    tx = fadam.scale_by_adopt(b1, b2, eps, clip_value_fn=lambda step: 0.5 * step)
    g1 = torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64)
    g2 = torch.tensor([0.2, 5.0, 1e-9], dtype=torch.float64)
    _, state = tx.update(g1, tx.init(torch.zeros(3, dtype=torch.float64)))
    updates, state = tx.update(g2, state)
    # the bound is clip_value_fn(1) = 0.5; the normalized gradient uses v_1 = g1^2 (and eps where it is 0)
    normalized = torch.clamp(g2 / torch.clamp(g1.abs(), min=eps), -0.5, 0.5)
    torch.testing.assert_close(updates, (1 - b1) * normalized, rtol=1e-15, atol=0)
    torch.testing.assert_close(state.nu, b2 * g1 * g1 + (1 - b2) * g2 * g2, rtol=1e-15, atol=0)


def test_adopt_clip_value_fn_sees_the_steps_taken_as_float64():
    seen = []

    def bound(step: torch.Tensor) -> torch.Tensor:
        seen.append((step.dtype, float(step)))
        return step**0.25

    tx = fadam.scale_by_adopt(clip_value_fn=bound)
    state = tx.init(torch.zeros(2))
    with fadam.backend("eager"):
        for _ in range(3):
            _, state = tx.update(torch.ones(2), state)
    assert seen == [(torch.float64, 0.0), (torch.float64, 1.0), (torch.float64, 2.0)]


# ------------------------------------------------------------------------------------------------------- AdEMAMix


def test_ademamix_slow_momentum_is_not_bias_corrected():
    b1, b2, b3, alpha = 0.9, 0.999, 0.99, 4.0
    tx = fadam.scale_by_ademamix(b1, b2, b3, alpha, eps=0.0)
    g = torch.tensor([0.5, -2.0], dtype=torch.float64)
    updates, state = tx.update(g, tx.init(torch.zeros(2, dtype=torch.float64)))
    # step 1: m1 / (1 - b1) = g, m2 = (1 - b3) g, sqrt(v / (1 - b2)) = |g|
    torch.testing.assert_close(updates, (g + alpha * (1 - b3) * g) / g.abs(), rtol=1e-14, atol=0)
    torch.testing.assert_close(state.m2, (1 - b3) * g, rtol=1e-15, atol=0)


def test_ademamix_schedules_are_evaluated_at_the_steps_taken():
    alphas = []
    tx = fadam.scale_by_ademamix(alpha=lambda count: alphas.append(int(count)) or 1.0)
    state = tx.init(torch.zeros(1))
    with fadam.backend("eager"):
        for _ in range(3):
            _, state = tx.update(torch.ones(1), state)
    assert alphas == [0, 1, 2]


def test_ademamix8bit_matches_full_precision_on_small_leaves_and_stays_close_on_quantized_ones():
    params = {"small": torch.randn(8, generator=torch.Generator().manual_seed(0)), "big": torch.zeros(4096)}
    grads = [fadam.tree_map(lambda p, i=i: torch.sin(torch.arange(p.numel()) * 0.1 + i), params) for i in range(5)]
    quantized = fadam.ademamix8bit(lr=1e-2, weight_decay=0.1, min_size=1000)
    plain = fadam.chain(
        fadam.scale_by_ademamix(alpha=5.0),
        fadam.scale_by_learning_rate(1e-2),
        fadam.add_decoupled_weight_decay(1e-2, 0.1),
    )
    runs = []
    for tx in (quantized, plain):
        p, state = dict(params), tx.init(params)
        for g in grads:
            updates, state = tx.update(g, state, p)
            p = fadam.apply_updates(p, updates)
        runs.append((p, state))
    (got, state), (want, _) = runs
    assert torch.equal(got["small"], want["small"])  # below min_size: full-precision moments
    assert type(state[0].inner_state.m2["big"]).__name__ == "QuantizedArray"
    torch.testing.assert_close(got["big"], want["big"], rtol=0, atol=2e-3)
    assert not torch.equal(got["big"], want["big"])


# --------------------------------------------------------------------------------------------------- Yogi, belief


def test_yogi_second_moment_moves_by_at_most_the_squared_gradient():
    b2 = 0.9
    tx = fadam.scale_by_yogi(b2=b2, initial_accumulator_value=1.0)
    g = torch.tensor([3.0, 0.5, 1.0], dtype=torch.float64)
    _, state = tx.update(g, tx.init(torch.zeros(3, dtype=torch.float64)))
    # v = 1 - (1 - b2) sign(1 - g^2) g^2: grows where g^2 > v, shrinks where g^2 < v, stays where equal
    want = torch.tensor([1 + 0.1 * 9, 1 - 0.1 * 0.25, 1.0], dtype=torch.float64)
    torch.testing.assert_close(state.nu, want, rtol=1e-15, atol=0)
    torch.testing.assert_close(state.mu, 0.9 + 0.1 * g, rtol=1e-15, atol=0)  # it starts at the initial value too


def test_belief_second_moment_is_the_prediction_errors():
    b1, b2, eps_root = 0.9, 0.99, 1e-12
    tx = fadam.scale_by_belief(b1, b2, eps=0.0, eps_root=eps_root)
    g1 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    g2 = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    _, state = tx.update(g1, tx.init(torch.zeros(2, dtype=torch.float64)))
    _, state = tx.update(g2, state)
    m1 = (1 - b1) * g1
    m2 = b1 * m1 + (1 - b1) * g2
    s1 = (1 - b2) * (g1 - m1) ** 2 + eps_root
    s2 = b2 * s1 + (1 - b2) * (g2 - m2) ** 2 + eps_root
    torch.testing.assert_close(state.nu, s2, rtol=1e-14, atol=0)


# ------------------------------------------------------------------------------------------------------- cautious


def _cautious_reference(u: torch.Tensor, g: torch.Tensor, min_fraction: float = 1e-3) -> torch.Tensor:
    """The Cautious optimizers' step on one leaf, written from the paper's equations (the reference code's C-AdamW
    normalisation): keep u where u g > 0, divide by the kept fraction (at least ``min_fraction``)."""
    u_real, g_real = (torch.view_as_real(x) if x.is_complex() else x for x in (u, g))
    kept = [1.0 if a * b > 0 else 0.0 for a, b in zip(u_real.flatten().tolist(), g_real.flatten().tolist())]
    fraction = max(sum(kept) / len(kept), min_fraction)
    out = torch.tensor([a * k / fraction for a, k in zip(u_real.flatten().tolist(), kept)], dtype=u_real.dtype)
    out = out.reshape(u_real.shape)
    return torch.view_as_complex(out) if u.is_complex() else out


def test_cautious_adam_follows_the_equations_over_many_steps():
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(4, 3, generator=gen, dtype=torch.float64), "z": torch.randn(5, dtype=torch.complex128)}
    inner = fadam.scale_by_adam(0.8, 0.99)
    tx = fadam.cautious(fadam.scale_by_adam(0.8, 0.99))
    state, inner_state = tx.init(params), inner.init(params)
    for _ in range(12):
        g = fadam.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params)
        got, state = tx.update(g, state, params)
        u, inner_state = inner.update(g, inner_state, params)
        for key in params:
            torch.testing.assert_close(got[key], _cautious_reference(u[key], g[key]), rtol=1e-15, atol=0)
    assert float(torch.count_nonzero(got["w"])) < got["w"].numel()  # the mask did remove disagreeing elements


def test_cautious_rescales_by_the_kept_fraction_with_a_floor():
    g = torch.tensor([1.0, -1.0, 1.0, 1.0])
    u = torch.tensor([2.0, 3.0, -1.0, 0.0])  # agrees only at index 0: a quarter kept
    inner = fadam.stateless(lambda updates, params: fadam.tree_map(lambda x: u.clone(), updates))
    assert torch.equal(fadam.cautious(inner).update(g, inner.init(None))[0], torch.tensor([8.0, 0.0, 0.0, 0.0]))
    floored = fadam.cautious(inner, min_fraction=0.5).update(g, inner.init(None))[0]
    assert torch.equal(floored, torch.tensor([4.0, 0.0, 0.0, 0.0]))
    nothing = fadam.cautious(inner).update(torch.tensor([-1.0, -1.0, 1.0, 1.0]), inner.init(None))[0]
    assert torch.equal(nothing, torch.zeros(4))  # no agreement: a zero step, not a division by zero


def test_cautious_keeps_none_leaves_and_the_inner_state():
    tx = fadam.cautious(fadam.scale_by_lion())
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    state = tx.init(params)
    assert type(state) is fadam.ScaleByLionState
    updates, new_state = tx.update({"a": torch.tensor([1.0, -1.0, 2.0]), "b": None}, state, params)
    assert updates["b"] is None and torch.equal(new_state.mu["b"], state.mu["b"])
    assert math.isclose(float(updates["a"][0]), 1.0)
