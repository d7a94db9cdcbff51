"""NovoGrad, LARS, Adan, SM3, Fromage, noisy SGD, Polyak SGD, optimistic gradient descent and Adam (both
interfaces), AMSGrad, AdamaxW, and the transforms and wrappers around them (add_noise, centralize, adaptive_grad_clip,
normalize_by_update_norm, keep_params_nonnegative, apply_every, conditionally_mask, conditionally_transform, flatten,
per_example_global_norm_clip, multi_transform, monitor, snapshot, measure_with_ema, scale_by_distance_over_gradients,
scale_by_param_block_norm) against optax's float64 trajectories (the line searches and utilities:
tests/test_optax_utilities.py).

The optax values (tests/data/optax_catalogue.json) were computed by optax 0.2.8 with jax in float64, on the fixed
gradients, params and loss values stored beside them (scripts/optax_catalogue_reference.py). Noise cannot match jax's
generator: ``add_noise`` and ``noisy_sgd`` are compared without noise, and their noise is checked here for its
variance, its seeding and its purity.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fadam

REFERENCE = json.loads((Path(__file__).parent / "data" / "optax_catalogue.json").read_text())
RTOL, ATOL = 1e-10, 1e-14


def _tree(values: dict[str, list]) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(v, dtype=torch.float64) for name, v in values.items()}


START = _tree(REFERENCE["start"])
GRADS = [_tree(g) for g in REFERENCE["grads"]]
LOSSES = REFERENCE["losses"]

# optax's function -> fadam's of the same name and arguments (all of fadam's top level)
FADAM_NAMES = {
    name: name
    for name in (
        "scale_by_novograd",
        "novograd",
        "scale_by_adan",
        "adan",
        "lars",
        "scale_by_sm3",
        "sm3",
        "fromage",
        "noisy_sgd",
        "add_noise",
        "scale_by_polyak",
        "polyak_sgd",
        "scale_by_optimistic_gradient",
        "optimistic_gradient_descent",
        "optimistic_adam",
        "optimistic_adam_v2",
        "centralize",
        "normalize_by_update_norm",
        "adaptive_grad_clip",
        "keep_params_nonnegative",
        "apply_every",
        "conditionally_mask",
        "conditionally_transform",
        "flatten",
        "scale_by_amsgrad",
        "amsgrad",
        "adamaxw",
        "scale_by_distance_over_gradients",
        "scale_by_param_block_norm",
    )
}
# declared elementwise (fadam._program): they also run through the generated CPU kernel
ELEMENTWISE = {"scale_by_adan", "adan", "scale_by_optimistic_gradient", "optimistic_gradient_descent"}
ELEMENTWISE |= {"normalize_by_update_norm", "keep_params_nonnegative", "lars", "fromage"}
ELEMENTWISE |= {"scale_by_amsgrad", "amsgrad", "scale_by_param_block_norm"}


def _resolve(value: Any) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        return getattr(torch, value["dtype"])
    if isinstance(value, dict) and "schedule" in value:
        return getattr(fadam, value["schedule"])(**value["kwargs"])
    return value


def _build(case: dict) -> fadam.GradientTransformation:
    kwargs = case["kwargs"]
    factory = getattr(fadam, FADAM_NAMES[case["optax"]])
    if "inner" in kwargs:
        inner_name, inner_kwargs = kwargs["inner"]
        inner = getattr(fadam, inner_name)(**inner_kwargs)
        if "every" not in kwargs:
            return factory(inner)
        every = kwargs["every"]
        return factory(inner, lambda step: step % every != 0)
    return factory(**{name: _resolve(value) for name, value in kwargs.items()})


def _trajectory(tx: fadam.GradientTransformation, kind: str, polyak: bool) -> list[dict[str, torch.Tensor]]:
    """Updates (a transform, at the fixed params ``START``) or params (an alias) after each step."""
    params = dict(START)
    state = tx.init(params)
    rows = []
    for g, loss in zip(GRADS, LOSSES):
        extra = {"value": torch.tensor(loss, dtype=torch.float64)} if polyak else {}
        updates, state = tx.update(dict(g), state, params, **extra)
        if kind == "alias":
            params = fadam.apply_updates(params, updates)
            rows.append(params)
        else:
            rows.append(updates)
    return rows


def _error(got: list[dict[str, torch.Tensor]], case: dict) -> float:
    """The largest ``|got - want| / (ATOL + RTOL |want|)`` over the trajectory: within the tolerance iff <= 1."""
    worst = 0.0
    for row, want_row in zip(got, case["values"], strict=True):
        for name, want in _tree(want_row).items():
            excess = (row[name] - want).abs() / (ATOL + RTOL * want.abs())
            worst = max(worst, float(excess.max()))
    return worst


def _run(case: dict) -> list[dict[str, torch.Tensor]]:
    return _trajectory(_build(case), case["kind"], "polyak" in case["optax"])


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda case: case["name"])
def test_matches_optax_float64_trajectory(case):
    with fadam.backend("eager"):
        assert _error(_run(case), case) <= 1.0


KERNEL_CASES = [case for case in REFERENCE["cases"] if case["optax"] in ELEMENTWISE]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda case: case["name"])
def test_generated_kernel_matches_optax_float64_trajectory(case):
    with fadam.backend("kernel"):
        assert _error(_run(case), case) <= 1.0


def test_every_new_optax_name_has_a_reference_case():
    assert {case["optax"] for case in REFERENCE["cases"]} == set(FADAM_NAMES)
    assert REFERENCE["optax_version"] == "0.2.8"


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("adan-default", {"b3": 0.99 + 1e-7}),
        ("novograd-default", {"b2": 0.25 + 1e-7}),
        ("lars-alias", {"trust_coefficient": 0.001 * (1 + 1e-8)}),
        ("optimistic-adam-v2-alias", {"beta": 1.0 + 1e-6}),
        ("amsgrad-uncorrected", {"eps_root": 1e-8 * (1 + 1e-2)}),
        ("dog-float64-start", {"reps_rel": 1e-2 * (1 + 1e-8)}),
    ],
)
def test_the_reference_comparison_can_fail(name, change):
    """A small change of a hyperparameter moves the trajectory outside the tolerance."""
    case = next(case for case in REFERENCE["cases"] if case["name"] == name)
    changed = {**case, "kwargs": {**case["kwargs"], **change}}
    assert _error(_run(changed), case) > 1.0


def test_per_example_global_norm_clip_matches_optax():
    reference = REFERENCE["per_example_global_norm_clip"]
    summed, clipped = fadam.per_example_global_norm_clip(_tree(reference["grads"]), reference["l2_norm_clip"])
    for name, want in _tree(reference["sum"]).items():
        torch.testing.assert_close(summed[name], want, rtol=RTOL, atol=ATOL)
    assert int(clipped) == reference["num_clipped"] == 3  # the small and the zero example are not clipped
    with pytest.raises(ValueError, match="batch dimension"):
        fadam.per_example_global_norm_clip([torch.tensor(1.0)], 1.0)


def test_multi_transform_is_partition_under_optax_names():
    labels = {"b": "sgd", "c": "adam", "w": "adam"}
    transforms = {"sgd": fadam.sgd(0.1, momentum=0.9), "adam": fadam.adam(1e-2)}
    runs = []
    for tx in (fadam.multi_transform(transforms, labels), fadam.partition(transforms, labels)):
        params, state = dict(START), tx.init(START)
        for g in GRADS[:5]:
            updates, state = tx.update(dict(g), state, params)
            params = fadam.apply_updates(params, updates)
        runs.append(params)
    for name in START:
        assert torch.equal(runs[0][name], runs[1][name])


def _scaled_by_extra_weights() -> fadam.GradientTransformation:
    """Multiplies the updates by a tree of weights given to ``update`` as an extra argument."""

    def update(updates, state, params=None, *, weights, **_):
        return fadam.tree_map(lambda u, w: u * w, updates, weights), state

    return fadam.GradientTransformation(lambda params: fadam.EmptyState(), update)


def test_mask_compatible_extra_args_gives_each_group_its_leaves():
    labels = {"b": "double", "c": "half", "w": "half"}
    transforms = {"double": _scaled_by_extra_weights(), "half": _scaled_by_extra_weights()}
    weights = {"b": torch.tensor(2.0), "c": torch.tensor(0.5), "w": torch.tensor(0.25)}
    tx = fadam.multi_transform(transforms, labels, mask_compatible_extra_args=True)
    updates, _ = tx.update(dict(GRADS[0]), tx.init(START), START, weights=weights)
    for name in START:
        assert torch.equal(updates[name], GRADS[0][name] * weights[name]), name
    unmasked = fadam.multi_transform(transforms, labels)  # each group is given the whole tree: not its shape
    with pytest.raises(ValueError):
        unmasked.update(dict(GRADS[0]), unmasked.init(START), START, weights=weights)


# ------------------------------------------------------------------------------------------------------ the noise


def test_add_noise_has_the_annealed_variance_and_a_fresh_draw_each_step():
    eta, gamma = 0.04, 0.55
    tx = fadam.add_noise(eta, gamma, key=3)
    zeros = {"a": torch.zeros(20000, dtype=torch.float64), "b": torch.zeros(20000, dtype=torch.float32)}
    state = tx.init(zeros)
    draws = []
    for t in range(1, 4):
        noise, state = tx.update(zeros, state)
        for leaf in noise.values():
            sigma = (eta / t**gamma) ** 0.5
            # the sample's standard deviation is within 5 of its standard errors (1 / sqrt(2n))
            assert abs(float(leaf.double().std()) / sigma - 1) < 5 / (2 * 20000) ** 0.5
            assert abs(float(leaf.double().mean())) < 5 * sigma / 20000**0.5
        assert noise["a"].dtype == torch.float64 and noise["b"].dtype == torch.float32
        draws.append(noise["a"])
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert abs(float(torch.corrcoef(torch.stack([draws[0], draws[1]]))[0, 1])) < 0.05  # independent draws
    assert int(state.count) == 3


def test_add_noise_is_a_function_of_the_key_and_the_state():
    params = {"a": torch.zeros(5), "b": torch.zeros(2, 2)}

    def first_two(tx: fadam.GradientTransformation) -> list:
        state = tx.init(params)
        out = []
        for _ in range(2):
            noise, state = tx.update(params, state)
            out.append(noise)
        return out

    same = first_two(fadam.add_noise(0.01, 0.55, key=7)), first_two(fadam.add_noise(0.01, 0.55, key=7))
    other = first_two(fadam.add_noise(0.01, 0.55, key=8))
    for step in range(2):
        for name in params:
            assert torch.equal(same[0][step][name], same[1][step][name])
            assert not torch.equal(same[0][step][name], other[step][name])
    assert not torch.equal(same[0][0]["a"][:4], same[0][0]["b"].reshape(-1))  # each leaf has its own seed
    with pytest.warns(UserWarning, match="key"):
        fadam.add_noise(0.01, 0.55)
    with pytest.warns(DeprecationWarning):
        fadam.add_noise(0.01, 0.55, seed=1)


def test_noisy_sgd_is_sgd_plus_scaled_noise():
    params = {"a": torch.zeros(4, dtype=torch.float64)}
    g = {"a": torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)}
    tx, noise_tx = fadam.noisy_sgd(0.1, eta=0.5, key=11), fadam.add_noise(0.5, 0.55, key=11)
    updates, _ = tx.update(g, tx.init(params), params)
    noisy, _ = noise_tx.update(g, noise_tx.init(params))
    torch.testing.assert_close(updates["a"], -0.1 * noisy["a"], rtol=1e-15, atol=0)
    assert not torch.allclose(updates["a"], -0.1 * g["a"])


# --------------------------------------------------------------------------------------------- contracts and edges


def test_polyak_needs_the_loss_and_skips_a_zero_gradient():
    tx = fadam.scale_by_polyak()
    with pytest.raises(ValueError, match="value=loss"):
        tx.update([torch.ones(2)], tx.init(None))
    updates, _ = tx.update([torch.zeros(2)], tx.init(None), value=1.0)
    assert torch.equal(updates[0], torch.zeros(2))
    with pytest.raises(ValueError, match="variant"):
        fadam.scale_by_polyak(variant="sps++")


def test_sm3_keeps_one_vector_per_axis_and_refuses_complex():
    params = {"w": torch.zeros(3, 4, 5), "b": torch.zeros(5), "s": torch.tensor(0.0)}
    tx = fadam.scale_by_sm3()
    state = tx.init(params)
    assert [v.shape for v in state.mu["w"]] == [(3,), (4,), (5,)]
    assert [v.shape for v in state.mu["b"]] == [(5,)] and state.mu["s"][0].shape == ()
    g = {"w": torch.randn(3, 4, 5), "b": torch.randn(5), "s": torch.tensor(2.0)}
    updates, state = tx.update(g, state)
    torch.testing.assert_close(updates["s"], 0.1 * g["s"] / (g["s"] ** 2 + 1e-8) ** 0.5)
    with pytest.raises(ValueError, match="complex"):
        tx.init([torch.zeros(2, dtype=torch.complex64)])


def test_optimistic_adam_refuses_a_schedule():
    with pytest.raises(ValueError, match="schedules"):
        fadam.optimistic_adam(lambda count: 0.1)


def test_conditional_wrappers_keep_the_inner_state_on_skipped_steps():
    params = [torch.zeros(2)]
    for factory, skipped in ((fadam.conditionally_transform, [1.0, 1.0]), (fadam.conditionally_mask, [0.0, 0.0])):
        tx = factory(fadam.scale_by_adam(), lambda step: step == 1)
        state = tx.init(params)
        updates, state = tx.update([torch.ones(2)], state)
        assert updates[0].tolist() == skipped
        assert int(state.inner_state.count) == 0 and int(state.step) == 1
        _, state = tx.update([torch.ones(2)], state)
        assert int(state.inner_state.count) == 1 and int(state.step) == 2
    seen = []
    tx = fadam.conditionally_mask(fadam.identity(), lambda step, **extra: seen.append(extra) or True, True)
    tx.update([torch.ones(1)], tx.init(params), loss=3.0)
    assert seen == [{"loss": 3.0}]


def test_conditional_wrapper_under_vmap_selects_per_member():
    tx = fadam.conditionally_transform(fadam.scale_by_adam(), lambda step: step >= 1)
    g = torch.ones(3, 2)

    def two_steps(grad: torch.Tensor) -> torch.Tensor:
        state = tx.init([torch.zeros(2)])
        first, state = tx.update([grad], state)
        second, _ = tx.update([grad], state)
        return torch.stack([first[0], second[0]])

    out = torch.func.vmap(two_steps)(g)
    torch.testing.assert_close(out, torch.stack([two_steps(row) for row in g]))


VMAP_BUILDERS = {
    "scale_by_novograd": lambda: fadam.scale_by_novograd(weight_decay=0.1),
    "scale_by_adan": fadam.scale_by_adan,
    "scale_by_sm3": fadam.scale_by_sm3,
    "scale_by_optimistic_gradient": fadam.scale_by_optimistic_gradient,
    "apply_every": lambda: fadam.apply_every(2),
    "normalize_by_update_norm": fadam.normalize_by_update_norm,
    "adaptive_grad_clip": lambda: fadam.adaptive_grad_clip(0.1),
    "centralize": fadam.centralize,
    "keep_params_nonnegative": fadam.keep_params_nonnegative,
    "scale_by_amsgrad": lambda: fadam.scale_by_amsgrad(bias_correction_nu=False),
    "scale_by_distance_over_gradients": lambda: fadam.scale_by_distance_over_gradients(reps_rel=0.1),
    "scale_by_param_block_norm": fadam.scale_by_param_block_norm,
}


@pytest.mark.parametrize("name", sorted(VMAP_BUILDERS))
def test_vmap_over_an_ensemble_equals_the_members(name):
    tx = VMAP_BUILDERS[name]()
    params = [torch.full((2, 3), 0.5)]

    def three_steps(g: torch.Tensor) -> torch.Tensor:
        state, out = tx.init(params), []
        for k in range(3):
            updates, state = tx.update([g * (k - 1.5)], state, params)
            out.append(updates[0])
        return torch.stack(out)

    grads = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.func.vmap(three_steps)(grads), torch.stack([three_steps(g) for g in grads]))


# ------------------------------------------------------------------------------------------- optimistic_adam_v2


def test_optimistic_adam_is_v2_with_its_rate_as_alpha_and_a_unit_rate():
    params = dict(START)
    runs = []
    for tx in (fadam.optimistic_adam(0.02, 0.05), fadam.optimistic_adam_v2(1.0, alpha=0.02, beta=0.05)):
        state, out = tx.init(params), []
        for g in GRADS[:4]:
            updates, state = tx.update(dict(g), state, params)
            out.append(updates)
        runs.append(out)
    for first, second in zip(*runs):
        for name in START:
            torch.testing.assert_close(first[name], second[name], rtol=1e-15, atol=0)


# ------------------------------------------------------------------------------------------------------ flatten


def test_flatten_runs_one_vector_in_the_promoted_dtype_and_returns_each_dtype():
    params = {"a": torch.ones(2, 2), "b": torch.ones(3, dtype=torch.float64)}
    tx = fadam.flatten(fadam.scale_by_adam())
    state = tx.init(params)
    assert state.mu.shape == (7,) and state.mu.dtype == torch.float64  # one vector, as optax (float32 + float64)
    grads = {"a": torch.full((2, 2), 2.0), "b": torch.tensor([1.0, -3.0, 0.0], dtype=torch.float64)}
    updates, state = tx.update(grads, state, params)
    assert updates["a"].dtype == torch.float32 and updates["b"].dtype == torch.float64
    torch.testing.assert_close(updates["a"], torch.ones(2, 2))  # Adam's first step: the sign
    torch.testing.assert_close(updates["b"], torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))
    assert int(state.count) == 1


def test_flatten_reads_a_missing_gradient_as_zeros_and_keeps_it_missing():
    params = {"a": torch.ones(2), "b": torch.ones(3)}
    tx = fadam.flatten(fadam.trace(0.5))
    state = tx.init(params)
    _, state = tx.update({"a": torch.ones(2), "b": torch.ones(3)}, state, params)
    updates, state = tx.update({"a": None, "b": torch.ones(3)}, state, params)
    assert updates["a"] is None and updates["b"].tolist() == [1.5, 1.5, 1.5]
    assert state.trace.tolist() == [0.5, 0.5, 1.5, 1.5, 1.5]  # the missing gradient's elements decayed
    with pytest.raises(ValueError, match="pass the params"):
        tx.update({"a": None, "b": torch.ones(3)}, state)
    with pytest.raises(TypeError, match="GradientTransformation"):
        fadam.flatten(fadam.scale_by_adam)
    with pytest.raises(ValueError, match="shape"):
        tx.update({"a": torch.ones(3), "b": torch.ones(3)}, state, params)


def test_flatten_makes_a_per_leaf_rule_global_within_chain_and_under_vmap():
    params = [torch.full((2, 3), 0.5), torch.full((4,), -0.25)]
    tx = fadam.chain(fadam.flatten(fadam.scale_by_trust_ratio()), fadam.scale(-0.1))
    updates, _ = tx.update([torch.ones(2, 3), torch.full((4,), 3.0)], tx.init(params), params)
    ratio = fadam.tree_norm(params) / (6 + 4 * 9) ** 0.5  # the norms of the whole model
    torch.testing.assert_close(updates[1], torch.full((4,), -0.1 * 3.0) * ratio)

    def two_steps(g: torch.Tensor) -> torch.Tensor:
        inner = fadam.flatten(fadam.scale_by_adam())
        state = inner.init(params)
        first, state = inner.update([g, g[0, :1].expand(4)], state, params)
        second, _ = inner.update([-g, g[1, :1].expand(4)], state, params)
        return torch.cat([first[0].reshape(-1), second[1]])

    grads = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.func.vmap(two_steps)(grads), torch.stack([two_steps(g) for g in grads]))


def test_flatten_of_an_elementwise_transform_is_that_transform_under_grad():
    """An elementwise inner transform steps each element as it would unflattened: so do the meta-gradients."""
    params = [p.clone() for p in START.values()]
    grads = [[g.clone() for g in step.values()] for step in GRADS[:2]]

    def params_after(lr: torch.Tensor, flat: bool) -> torch.Tensor:
        tx = fadam.sgd(lr, momentum=0.9)
        tx = fadam.flatten(tx) if flat else tx
        state, current = tx.init(params), params
        for g in grads:
            updates, state = tx.update(g, state, current)
            current = fadam.apply_updates(current, updates)
        return sum(leaf.square().sum() for leaf in current)

    lr = torch.tensor(0.1, dtype=torch.float64)
    flat, plain = (torch.func.grad(params_after)(lr, flat) for flat in (True, False))
    torch.testing.assert_close(flat, plain, rtol=1e-14, atol=0)
    assert float(plain) != 0.0


# -------------------------------------------------------------------------- monitor, snapshot, measure_with_ema


def _monitored() -> fadam.GradientTransformation:
    """tests/data's monitoring chain (scripts/optax_catalogue_reference.py's ``monitoring``), in fadam's names."""
    return fadam.chain(
        fadam.trace(0.9),
        fadam.monitor(
            {
                "norm": fadam.tree_norm,
                "large": fadam.measure_with_ema(lambda u: fadam.tree_norm(u) > 20.0, 0.9),
                "squares": fadam.measure_with_ema(lambda u: fadam.tree_map(torch.square, u), 0.8, debias=False),
            }
        ),
        fadam.clip_by_global_norm(2.0),
        fadam.snapshot("max", fadam.tree_max),
        fadam.scale(-0.1),
    )


@pytest.fixture
def float64_default():
    """torch's default dtype float64, as jax's x64 mode of the reference: a bool measurement is averaged in it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_monitor_snapshot_and_measure_with_ema_match_optax(float64_default):
    reference = REFERENCE["monitoring"]
    tx = _monitored()
    params = dict(START)
    state = tx.init(params)
    assert state[1].measurements == {} and float(state[3].measurement["max"]) == reference["init_max"]
    for g, want in zip(GRADS, reference["steps"], strict=True):
        updates, state = tx.update(dict(g), state, params)
        params = fadam.apply_updates(params, updates)
        measured = state[1].measurements
        got = {"norm": measured["norm"], "large": measured["large"], "max": state[3].measurement["max"]}
        for name, value in got.items():
            torch.testing.assert_close(value, torch.tensor(want[name]), rtol=RTOL, atol=ATOL, msg=name)
        for tree, want_tree in ((params, want["params"]), (measured["squares"], want["squares"])):
            for name, leaf in _tree(want_tree).items():
                torch.testing.assert_close(tree[name], leaf, rtol=RTOL, atol=ATOL)
    large_state = state[1].measure_states[1]  # measure_with_ema's state: optax's chain of (measure, ema)
    assert isinstance(large_state[0], fadam.EmptyState) and int(large_state[1].count) == len(GRADS)
    assert 0.0 < float(measured["large"]) < 1.0  # the flag was on for some steps only


def test_measurements_are_of_the_updates_given_and_pass_them_through():
    seen = []

    def counting(updates, state, params=None, **extra):
        seen.append(extra)
        return fadam.tree_sum(updates), state

    tx = fadam.monitor({"sum": fadam.GradientTransformation(lambda params: fadam.EmptyState(), counting)})
    g = [torch.tensor([1.0, 2.0])]
    updates, state = tx.update(g, tx.init([torch.zeros(2)]), loss=3.0)
    assert updates is g and float(state.measurements["sum"]) == 3.0 and seen == [{"loss": 3.0}]
    average = fadam.measure_with_ema(lambda u: fadam.tree_norm(u) > 1.0, 0.5)
    flag, average_state = average.update(g, average.init([torch.zeros(2)]))
    assert flag.dtype == torch.get_default_dtype() and float(flag) == 1.0  # debiased: 0.5 / (1 - 0.5)
    assert average_state[1].ema.dtype == torch.get_default_dtype()
    with pytest.raises(TypeError, match="expected a GradientTransformation or a callable"):
        fadam.monitor({"norm": 2.0})
    with pytest.raises(TypeError, match="dict"):
        fadam.monitor([fadam.tree_norm])
    with pytest.raises(TypeError, match="measure_name"):
        fadam.snapshot(fadam.tree_norm, "norm")


def test_monitor_under_vmap_measures_each_member():
    tx = fadam.chain(fadam.monitor({"norm": fadam.tree_norm, "ema": fadam.measure_with_ema(fadam.tree_norm, 0.5)}))
    params = [torch.zeros(3)]

    def measured(g: torch.Tensor) -> torch.Tensor:
        state = tx.init(params)
        _, state = tx.update([g], state)
        _, state = tx.update([2 * g], state)
        return torch.stack([state[0].measurements["norm"], state[0].measurements["ema"]])

    grads = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    out = torch.func.vmap(measured)(grads)
    torch.testing.assert_close(out, torch.stack([measured(g) for g in grads]))
    torch.testing.assert_close(out[:, 0], 2 * grads.norm(dim=1))
    torch.testing.assert_close(out[:, 1], (0.25 * 1 + 0.5 * 2) / 0.75 * grads.norm(dim=1))
