"""NovoGrad, LARS, Adan, SM3, Fromage, noisy SGD, Polyak SGD, optimistic gradient descent and Adam, and the
transforms and wrappers around them (add_noise, centralize, adaptive_grad_clip, normalize_by_update_norm,
keep_params_nonnegative, apply_every, conditionally_mask, conditionally_transform, per_example_global_norm_clip,
multi_transform) against optax's float64 trajectories.

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
        "centralize",
        "normalize_by_update_norm",
        "adaptive_grad_clip",
        "keep_params_nonnegative",
        "apply_every",
        "conditionally_mask",
        "conditionally_transform",
    )
}
# declared elementwise (fadam._program): they also run through the generated CPU kernel
ELEMENTWISE = {"scale_by_adan", "adan", "scale_by_optimistic_gradient", "optimistic_gradient_descent"}
ELEMENTWISE |= {"normalize_by_update_norm", "keep_params_nonnegative", "lars", "fromage"}


def _resolve(value: Any) -> Any:
    if isinstance(value, dict) and "schedule" in value:
        return getattr(fadam, value["schedule"])(**value["kwargs"])
    return value


def _build(case: dict) -> fadam.GradientTransformation:
    kwargs = case["kwargs"]
    factory = getattr(fadam, FADAM_NAMES[case["optax"]])
    if "inner" in kwargs:
        inner_name, inner_kwargs = kwargs["inner"]
        every = kwargs["every"]
        return factory(getattr(fadam, inner_name)(**inner_kwargs), lambda step: step % every != 0)
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
