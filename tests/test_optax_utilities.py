"""optax's line searches, L-BFGS direction, stateful schedules and utilities under their names, against optax 0.2.8's
float64 values (tests/data/optax_catalogue.json, written by scripts/optax_catalogue_reference.py): the zoom and
backtracking searches driving L-BFGS and SGD on Rosenbrock's function and on a batched loss,
``inject_stateful_hyperparams``, ``per_example_layer_norm_clip``, ``power_iteration``, ``matrix_inverse_pth_root``,
``safe_norm`` and ``safe_root_mean_squares`` with their gradients, ``incremental_update``, ``periodic_update``,
``scale_gradient`` and ``multi_normal``; and the contracts optax leaves to JAX: errors, ``None`` gradients,
``torch.func``, the helpers of the transform protocol."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fadam

DATA = json.loads((Path(__file__).parent / "data" / "optax_catalogue.json").read_text())
RTOL, ATOL = 1e-10, 1e-14
F64 = torch.float64


def _tensor(value: Any) -> torch.Tensor:
    return torch.tensor(value, dtype=F64)


def _tree(values: dict[str, list]) -> dict[str, torch.Tensor]:
    return {name: _tensor(v) for name, v in values.items()}


def _close(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want)
        for name in want:
            _close(got[name], want[name])
        return
    torch.testing.assert_close(torch.as_tensor(got, dtype=F64), _tensor(want), rtol=RTOL, atol=ATOL)


START = _tree(DATA["start"])
GRADS = [_tree(g) for g in DATA["grads"]]

# ------------------------------------------------------------------------------------------------- line searches


def rosenbrock(params: dict[str, torch.Tensor]) -> torch.Tensor:
    x = torch.cat([params[name].reshape(-1) for name in sorted(params)])
    return torch.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def data_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    pred = torch.tanh(x @ params["w"] + params["b"])
    return 0.5 * torch.sum((pred - y) ** 2) + 0.05 * torch.sum(params["c"] ** 2) + 0.01 * torch.sum(params["c"] ** 4)


LINESEARCH = DATA["linesearch"]
BATCHES = {name: _tensor(v) for name, v in LINESEARCH["batches"].items()}


def _run_linesearch(case: dict, members: list | None = None) -> list[dict[str, Any]]:
    """The reference's loop, in fadam: the params and the line search's numbers after each update."""
    tx = fadam.chain(*[getattr(fadam, name)(**kwargs) for name, kwargs in members or case["members"]])
    fn = rosenbrock if case["objective"] == "rosenbrock" else data_loss
    value_and_grad = fadam.value_and_grad_from_state(fn)
    params = dict(START)
    state = tx.init(params)
    steps = []
    for t in range(len(case["steps"])):
        args = {} if case["objective"] == "rosenbrock" else {name: batch[t] for name, batch in BATCHES.items()}
        if case["from_state"]:
            value, grad = value_and_grad(params, state=state, **args)
        else:
            grad, value = torch.func.grad_and_value(fn)(params, **args)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn, **args)
        params = fadam.apply_updates(params, updates)
        search = state[-1]
        steps.append(
            {
                "params": params,
                "learning_rate": search.learning_rate,
                "value": search.value,
                "num_linesearch_steps": int(search.info.num_linesearch_steps),
            }
        )
    return steps


@pytest.mark.parametrize("case", LINESEARCH["cases"], ids=lambda case: case["name"])
def test_line_searches_match_optax(case):
    for got, want in zip(_run_linesearch(case), case["steps"], strict=True):
        assert got["num_linesearch_steps"] == want["num_linesearch_steps"]
        for name in ("params", "learning_rate", "value"):
            _close(got[name], want[name])


def test_the_line_search_comparison_can_fail():
    """L-BFGS's direction scaled by 1 + 1e-8 moves the trajectory outside the tolerance."""
    case = next(c for c in LINESEARCH["cases"] if c["name"] == "lbfgs-zoom")
    members = [list(m) for m in case["members"]]
    members[1] = ["scale", {"step_size": -1.0 - 1e-8}]
    got = _run_linesearch(case, members)
    with pytest.raises(AssertionError):
        for row, want in zip(got, case["steps"]):
            _close(row["params"], want["params"])


def test_value_and_grad_from_state_reads_the_search_or_computes():
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x**3).sum()

    x = _tensor([1.0, -2.0])
    value_and_grad = fadam.value_and_grad_from_state(f)
    tx = fadam.chain(fadam.scale(-1.0), fadam.scale_by_zoom_linesearch(10))
    value, grad = value_and_grad(x, state=tx.init(x))  # an infinite value in the state: computed
    assert float(value) == -7.0 and grad.tolist() == [3.0, 12.0] and not grad.requires_grad
    held = (tx.init(x)[0], tx.init(x)[1]._replace(value=_tensor(5.0), grad=_tensor([1.0, 1.0])))
    assert value_and_grad(x, state=held)[0] is held[1].value
    with pytest.raises(ValueError, match="store_grad"):
        plain = fadam.scale_by_backtracking_linesearch(10)
        value_and_grad(x, state=plain.init(x)._replace(value=_tensor(1.0)))
    with pytest.raises(ValueError, match="2 fields named 'value'"):
        value_and_grad(x, state=(held[1], held[1]))


def test_line_searches_refuse_missing_arguments_and_torch_func():
    x = _tensor([1.0])
    for tx in (fadam.scale_by_zoom_linesearch(5), fadam.scale_by_backtracking_linesearch(5)):
        with pytest.raises(ValueError, match="value_fn=f"):
            tx.update(x, tx.init(x), x, value=1.0, grad=x)

        def step(g: torch.Tensor, tx: Any = tx) -> torch.Tensor:
            return tx.update(g, tx.init(x), x, value=g.sum(), grad=g, value_fn=lambda p: (p**2).sum())[0]

        with pytest.raises(ValueError, match=r"torch\.func"):
            torch.func.vmap(step)(x.expand(2, 1))
    with pytest.raises(ValueError, match="initial guess"):
        fadam.scale_by_zoom_linesearch(5, initial_guess_strategy="two")
    with pytest.raises(ValueError, match="decrease_factor"):
        fadam.scale_by_backtracking_linesearch(5, decrease_factor=1.0)


def test_backtracking_stays_where_the_loss_is_not_finite_and_passes_named_extra_args():
    seen = []

    def f(p: torch.Tensor, *, scale: float) -> torch.Tensor:
        seen.append(scale)
        return torch.where(p.sum() > 0.5, torch.inf, p.sum()) * scale

    tx = fadam.scale_by_backtracking_linesearch(3, store_grad=True)
    x = _tensor([0.0])
    updates, state = tx.update(
        _tensor([1.0]), tx.init(x), x, value=0.0, grad=_tensor([1.0]), value_fn=f, scale=2.0, unused=1
    )
    assert updates.tolist() == [0.0] and float(state.learning_rate) == 0.0  # 1, 0.8, 0.64, 0.512: all infinite
    assert math.isinf(float(state.info.decrease_error)) and int(state.info.num_linesearch_steps) == 4
    assert set(seen) == {2.0}  # the argument f names, not the others


# --------------------------------------------------------------------------------------------------- L-BFGS


def test_scale_by_lbfgs_reads_a_missing_gradient_as_zero_and_keeps_it_missing():
    params = {"a": _tensor([1.0, 2.0]), "b": _tensor([0.5])}
    tx = fadam.scale_by_lbfgs(memory_size=2)
    state = tx.init(params)
    assert state.diff_params_memory["a"].shape == (2, 2) and state.weights_memory.shape == (2,)
    first, state = tx.update({"a": _tensor([3.0, 4.0]), "b": None}, state, params)
    assert first["b"] is None
    torch.testing.assert_close(first["a"], _tensor([3.0, 4.0]) / 5.0)  # the first step: u / |u|
    moved = {"a": _tensor([0.4, 1.2]), "b": _tensor([0.5])}
    _, state = tx.update({"a": _tensor([0.8, 2.4]), "b": _tensor([0.0])}, state, moved)
    dw, du = torch.cat([moved["a"] - params["a"], _tensor([0.0])]), _tensor([-2.2, -1.6, 0.0])
    torch.testing.assert_close(state.weights_memory[0], 1 / du.dot(dw))  # the pair in slot (count - 1) % 2
    assert float(state.weights_memory[1]) == 0.0 and int(state.count) == 2
    leaf = params["a"].clone().requires_grad_(True)  # a module's param: read, no graph built
    third, state = tx.update({"a": _tensor([1.0, 1.0]), "b": None}, state, {"a": leaf, "b": params["b"]})
    assert not third["a"].requires_grad and not state.params["a"].requires_grad
    with pytest.raises(ValueError, match="memory_size"):
        fadam.scale_by_lbfgs(memory_size=0)
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"a": _tensor([3.0, 4.0]), "b": None}, state)


def test_scale_by_lbfgs_of_complex_params_is_that_of_their_real_pairs():
    z = torch.tensor([1 + 2j, -0.5 + 1j], dtype=torch.complex128)
    grads = [torch.tensor([0.3 - 1j, 2 + 0.5j], dtype=torch.complex128), torch.tensor([0.1 + 0j, 1 - 1j])]
    runs = []
    for as_real in (False, True):
        tx, params = fadam.scale_by_lbfgs(), torch.view_as_real(z) if as_real else z
        state, out = tx.init(params), []
        for g in grads:
            g = torch.view_as_real(g.to(torch.complex128)) if as_real else g.to(torch.complex128)
            u, state = tx.update(g, state, params)
            params = params - 0.1 * u
            out.append(u if as_real else torch.view_as_real(u))
        runs.append(out)
    for complex_run, real_run in zip(*runs):
        torch.testing.assert_close(complex_run, real_run, rtol=1e-14, atol=0)


def test_distance_over_gradients_composes_and_skips_a_missing_gradient():
    params = {"a": _tensor([1.0, -1.0]), "b": _tensor([2.0])}
    chained = fadam.chain(fadam.scale_by_distance_over_gradients(reps_rel=0.1), fadam.scale(-1.0))
    alone = fadam.scale_by_distance_over_gradients(reps_rel=0.1, global_scale=-1.0)
    states = [tx.init(params) for tx in (chained, alone)]
    assert states[1].init_params["a"].dtype == torch.float32  # optax's default param_dtype
    for g in ({"a": _tensor([0.5, 1.0]), "b": _tensor([-1.0])}, {"a": _tensor([0.2, 0.0]), "b": None}):
        first, states[0] = chained.update(g, states[0], params)
        second, states[1] = alone.update(g, states[1], params)
        assert torch.equal(first["a"], second["a"]) and (first["b"] is None) == (g["b"] is None)
        params = fadam.apply_updates(params, second)
    assert float(states[1].grad_sum_of_squares["b"]) == 1.0  # b's second gradient was missing: not added
    with pytest.raises(ValueError, match="needs params"):
        alone.update({"a": _tensor([0.5, 1.0]), "b": None}, states[1])


# ------------------------------------------------------------------------------------------- stateful schedules


class Plateau:
    """The reference's stateful schedule: the rate halves at each update whose loss (``value``) is above the best."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def init(self) -> dict[str, torch.Tensor]:
        return {"rate": _tensor(self.rate), "best": _tensor(math.inf)}

    def update(self, state: dict[str, torch.Tensor], *, value: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        worse = value > state["best"]
        return {
            "rate": torch.where(worse, 0.5 * state["rate"], state["rate"]),
            "best": torch.minimum(state["best"], value),
        }

    def __call__(self, state: dict[str, torch.Tensor], **_: Any) -> torch.Tensor:
        return state["rate"]


def test_inject_stateful_hyperparams_matches_optax():
    reference = DATA["stateful_schedule"]
    tx = fadam.inject_stateful_hyperparams(fadam.amsgrad)(
        learning_rate=Plateau(reference["initial_rate"]), b1=reference["b1"]
    )
    params = dict(START)
    state = tx.init(params)
    assert set(state.hyperparams_states) == {"learning_rate"} and float(state.hyperparams["learning_rate"]) == 0.05
    for g, loss, want in zip(GRADS, DATA["losses"], reference["steps"], strict=True):
        updates, state = tx.update(dict(g), state, params, value=_tensor(loss))
        params = fadam.apply_updates(params, updates)
        _close(params, want["params"])
        _close(state.hyperparams["learning_rate"], want["learning_rate"])
    assert isinstance(state.inner_state[0], fadam.ScaleByAmsgradCorrectedState) and int(state.count) == len(GRADS)


def test_inject_stateful_hyperparams_keeps_plain_numbers_and_schedules():
    tx = fadam.inject_stateful_hyperparams(fadam.sgd)(lr=fadam.linear_schedule(0.1, 0.0, 10), momentum=0.5)
    params = [torch.zeros(1)]
    state = tx.init(params)
    assert state.hyperparams_states == {}
    _, state = tx.update([torch.ones(1)], state, params)
    updates, state = tx.update([torch.ones(1)], state, params)
    torch.testing.assert_close(updates[0], torch.tensor([-0.09 * 1.5]))  # lr(1) (g + 0.5 m)
    assert float(state.hyperparams["momentum"]) == 0.5
    with pytest.raises(ValueError, match="InjectStatefulHyperparamsState"):
        tx.update([torch.ones(1)], state.inner_state, params)


# ----------------------------------------------------------------------------------- clipping and linear algebra


def test_per_example_layer_norm_clip_matches_optax():
    reference = DATA["per_example_layer_norm_clip"]
    grads = _tree(DATA["per_example_global_norm_clip"]["grads"])
    for uniform, key in ((True, "uniform"), (False, "by_size")):
        summed, clipped = fadam.per_example_layer_norm_clip(grads, reference["global_l2_norm_clip"], uniform)
        _close(summed, reference[key]["sum"])
        assert {name: int(n) for name, n in clipped.items()} == reference[key]["num_clipped"]
    with pytest.raises(ValueError, match="batch dimension"):
        fadam.per_example_layer_norm_clip([torch.tensor(1.0)], 1.0)


LINALG = DATA["linear_algebra"]


def test_power_iteration_matches_optax():
    matrix, v0 = _tensor(LINALG["spd"]), _tensor(LINALG["v0"])
    for name in ("power_converged", "power_three_products"):
        want = LINALG[name]
        value, vector = fadam.power_iteration(matrix, v0=v0, num_iters=want["num_iters"])
        _close(value, want["value"])
        _close(vector, want["vector"])

    def product(v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "a": matrix[:3, :3] @ v["a"] + matrix[:3, 3:] @ v["b"],
            "b": matrix[3:, :3] @ v["a"] + matrix[3:, 3:] @ v["b"],
        }

    value, vector = fadam.power_iteration(product, v0={"a": v0[:3], "b": v0[3:]})
    _close(value, LINALG["power_tree"]["value"])
    _close(vector, LINALG["power_tree"]["vector"])
    drawn, _ = fadam.power_iteration(matrix)  # a torch draw: the same eigenvalue
    torch.testing.assert_close(drawn, _tensor(LINALG["power_converged"]["value"]), rtol=1e-8, atol=0)
    with pytest.raises(ValueError, match="v0"):
        fadam.power_iteration(product)


def test_matrix_inverse_pth_root_matches_optax():
    for case in LINALG["inverse_pth_roots"]:
        matrix = _tensor(LINALG[case["matrix"]] if isinstance(case["matrix"], str) else case["matrix"])
        root, error = fadam.matrix_inverse_pth_root(matrix, case["p"])
        _close(root, case["root"])
        torch.testing.assert_close(error, _tensor(case["error"]), rtol=1e-6, atol=1e-14)  # a residual: rounding
    root, _ = fadam.matrix_inverse_pth_root(_tensor(LINALG["spd"]), 3)  # any p: the 3rd power of the iterate
    torch.testing.assert_close(
        torch.linalg.matrix_power(root, 3) @ _tensor(LINALG["spd"]), torch.eye(5, dtype=F64), rtol=0, atol=1e-5
    )
    with pytest.raises(ValueError, match="positive integer"):
        fadam.matrix_inverse_pth_root(torch.eye(2), 0)


# -------------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("case", DATA["numerics"]["safe_norm"], ids=lambda c: f"{c['ord']}-{c['axis']}-{c['keepdims']}")
def test_safe_norm_and_its_gradient_match_optax(case):
    order = math.inf if case["ord"] == "inf" else case["ord"]
    axis = tuple(case["axis"]) if isinstance(case["axis"], list) else case["axis"]
    x = _tensor(case["x"]).requires_grad_(True)
    value = fadam.safe_norm(x, case["min_norm"], order, axis, case["keepdims"])
    _close(value.detach(), case["value"])
    _close(torch.autograd.grad(value.sum(), x)[0], case["grad"])


def test_safe_root_mean_squares_and_its_gradient_match_optax():
    for case in DATA["numerics"]["safe_root_mean_squares"]:
        x = _tensor(case["x"]).requires_grad_(True)
        value = fadam.safe_root_mean_squares(x, case["min_rms"])
        _close(value.detach(), case["value"])
        _close(torch.autograd.grad(value, x)[0], case["grad"])


def test_safe_increment_saturates_at_the_dtype_maximum():
    top32, top64 = torch.iinfo(torch.int32).max, torch.iinfo(torch.int64).max
    assert fadam.safe_increment(torch.tensor(top32, dtype=torch.int32)).item() == top32
    assert fadam.safe_increment(torch.tensor(top32, dtype=torch.int64)).item() == top32 + 1
    assert fadam.safe_increment(torch.tensor(top64)).item() == top64
    assert fadam.safe_increment(torch.tensor(1.5)).item() == 2.5
    assert fadam.safe_int32_increment is fadam.safe_increment
    with pytest.raises(ValueError, match="integer or floating"):
        fadam.safe_increment(torch.tensor(True))


# ------------------------------------------------------------------------------------------------- utilities

UTILITIES = DATA["utilities"]


def test_incremental_and_periodic_updates_match_optax():
    average, copy = dict(START), dict(START)
    for t, g in enumerate(GRADS):
        average = fadam.incremental_update(dict(g), average, UTILITIES["incremental_update"]["step_size"])
        copy = fadam.periodic_update(dict(g), copy, t, UTILITIES["periodic_update"]["update_period"])
        _close(average, UTILITIES["incremental_update"]["values"][t])
        _close(copy, UTILITIES["periodic_update"]["values"][t])
    batched = torch.func.vmap(lambda t: fadam.periodic_update([torch.ones(2)], [torch.zeros(2)], t, 3)[0])
    assert batched(torch.arange(4)).tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert fadam.incremental_update([None], [torch.ones(1)], 0.5) == [None]


def test_scale_gradient_matches_optax_under_autograd_and_torch_func():
    reference = UTILITIES["scale_gradient"]
    x = _tensor(reference["x"])

    def loss(y: torch.Tensor) -> torch.Tensor:
        return torch.sum(torch.sin(fadam.scale_gradient(y, reference["scale"]) * y) ** 2)

    _close(torch.func.grad(loss)(x), reference["grad"])
    leaf = x.clone().requires_grad_(True)
    _close(torch.autograd.grad(loss(leaf), leaf)[0], reference["grad"])
    assert torch.equal(fadam.scale_gradient(x, 0.3), x) and fadam.scale_gradient([x], 1.0)[0] is x
    assert not fadam.scale_gradient(leaf, 0.0).requires_grad


def test_multi_normal_log_prob_matches_optax_and_samples_have_its_moments():
    reference = UTILITIES["multi_normal"]
    loc, log_scale = _tensor(reference["loc"]), _tensor(reference["log_scale"])
    dist = fadam.multi_normal(loc, log_scale)
    _close(dist.log_prob(_tensor(reference["points"])), reference["log_prob"])
    samples = dist.sample((20000,), key=1)
    assert samples.shape == (20000, 3) and torch.equal(samples, dist.sample((20000,), key=1))
    # within 5 standard errors: of the mean sigma / sqrt(n), of the standard deviation sigma / sqrt(2 n)
    sigma = log_scale.exp()
    assert bool(((samples.mean(0) - loc).abs() < 5 * sigma / 20000**0.5).all())
    assert bool(((samples.std(0) / sigma - 1).abs() < 5 / (2 * 20000) ** 0.5).all())
    assert dist.params[0] is dist._mean and torch.equal(dist.log_scale, log_scale)


def test_the_tree_moments_are_optax_names_of_the_tree_functions():
    assert fadam.bias_correction is fadam.tree_bias_correction
    assert fadam.update_moment is fadam.tree_update_moment
    assert fadam.update_infinity_moment is fadam.tree_update_infinity_moment
    assert fadam.update_moment_per_elem_norm is fadam.tree_update_moment_per_elem_norm


def test_protocol_helpers():
    assert fadam.init_empty_state({"w": torch.zeros(1)}) == fadam.EmptyState()
    adam = fadam.adam(1e-3)
    assert fadam.with_extra_args_support(adam) is adam
    bare = fadam.GradientTransformation(lambda params: (), lambda updates, state, params=None: (updates, state))
    wrapped = fadam.with_extra_args_support(bare)
    assert wrapped.update([torch.ones(1)], (), None, loss=1.0)[0][0].item() == 1.0
    with pytest.raises(TypeError, match="GradientTransformation"):
        fadam.with_extra_args_support(fadam.adam)
    tx = fadam.chain(fadam.scale_by_amsgrad(), fadam.scale_by_learning_rate(0.1))
    state = tx.init(dict(START))
    shapes = fadam.tree_map_params(
        tx, lambda p, q: p.shape == q.shape, state, dict(START), transform_non_params=lambda x: "other"
    )
    assert shapes[0].mu == {"b": True, "c": True, "w": True} and shapes[0].nu_max["w"] is True
    assert shapes[0].count == "other" and shapes[1] == fadam.EmptyState()


def test_scale_by_lbfgs_steps_a_complex_leaf_after_one_of_odd_size():
    """A complex leaf's reals start at an odd place of the flat vector: its update is still its own pairs of reals,
    as for the same leaf first in the tree."""
    z = torch.tensor([1.0 + 2.0j, -0.5 + 0.25j], dtype=torch.complex128)
    g = torch.tensor([0.3 - 0.1j, 0.2 + 0.4j], dtype=torch.complex128)
    tx = fadam.scale_by_lbfgs(memory_size=2)
    odd = {"a": _tensor([1.0, 2.0, 3.0]), "z": z}
    updates, _ = tx.update({"a": _tensor([0.0, 0.0, 0.0]), "z": g}, tx.init(odd), odd)
    alone, _ = tx.update({"z": g}, tx.init({"z": z}), {"z": z})
    torch.testing.assert_close(updates["z"], alone["z"], rtol=1e-12, atol=0)
