"""Writes tests/data/optax_catalogue.json: optax's float64 trajectories of the optimizers, transforms and wrappers
of tests/test_optax_catalogue.py (NovoGrad, LARS, Adan, SM3, Fromage, noisy SGD without noise, Polyak SGD,
optimistic gradient descent and Adam (both interfaces), centralize, adaptive_grad_clip, normalize_by_update_norm,
keep_params_nonnegative, apply_every, conditionally_mask and conditionally_transform, flatten,
per_example_global_norm_clip, AMSGrad, AdamaxW, DoG, scale_by_param_block_norm), the measurements of monitor, snapshot
and measure_with_ema along a trajectory, the outputs of microbatch with each accumulation type, the line searches
and L-BFGS on two objectives, inject_hyperparams with a stateful schedule, per_example_layer_norm_clip,
power_iteration, matrix_inverse_pth_root, safe_norm, safe_root_mean_squares (values and gradients),
incremental_update, periodic_update, scale_gradient and multi_normal's log density.

Each case runs a transform (its updates at every step, at the fixed params ``START``) or an alias (the params after
every step, from ``START``) of optax on a fixed sequence of gradients over three leaves (a matrix, a vector and a
3-d tensor), and, for the Polyak step size, of loss values; all are stored with the results, so the tests need
neither jax nor optax.

Needs jax and optax, which fadam does not depend on; run once where they are installed:
    PYTHONPATH=<dir with jax, optax> python scripts/optax_catalogue_reference.py
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402  (float64 must be enabled before arrays are made)
import numpy as np  # noqa: E402
import optax  # noqa: E402

STEPS = 20
SHAPES = {"b": (3,), "c": (2, 2, 2), "w": (2, 3)}


def _leaf(name: str, t: int) -> list:
    """Step ``t``'s gradient of one leaf: signs that flip, magnitudes that differ by leaf and element, a component
    that is zero for the first steps (square roots of zero moments), and growth (clipping engages)."""
    size = math.prod(SHAPES[name])
    offset = {"b": 0.3, "c": 1.1, "w": 2.0}[name]
    values = []
    for i in range(size):
        v = math.sin(0.7 * t + 1.3 * i + offset) * (1 + 0.2 * i) + 0.05 * t * (-1) ** i
        if i == 0 and t < 3:
            v = 0.0
        values.append(v * (1.0 + (t % 5 == 4) * 3.0))
    return np.asarray(values).reshape(SHAPES[name]).tolist()


def gradients() -> list[dict[str, list]]:
    return [{name: _leaf(name, t) for name in SHAPES} for t in range(STEPS)]


def start() -> dict[str, list]:
    return {
        name: np.asarray([0.8 * math.cos(0.9 * i + k) for i in range(math.prod(shape))]).reshape(shape).tolist()
        for k, (name, shape) in enumerate(SHAPES.items())
    }


def values() -> list[float]:
    """Loss values for the Polyak step size (some below the ``f_min`` of 0.5 used by a case)."""
    return [0.3 + 2.0 * (1 + math.sin(0.8 * t)) / (1 + 0.1 * t) for t in range(STEPS)]


LINEAR_LR = {"schedule": "linear_schedule", "kwargs": {"init_value": 0.2, "end_value": 0.02, "transition_steps": 20}}
MASK = {"b": False, "c": True, "w": True}
DECAY_MASK = {"b": False, "c": False, "w": True}

# (name, optax function, kwargs, kind): kind "transform" records updates, "alias" the params
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("novograd-default", "scale_by_novograd", {}, "transform"),
    ("novograd-decay", "scale_by_novograd", {"b1": 0.8, "b2": 0.5, "eps_root": 1e-8, "weight_decay": 0.1}, "transform"),
    ("novograd-alias", "novograd", {"learning_rate": 0.05, "weight_decay": 0.01}, "alias"),
    ("adan-default", "scale_by_adan", {}, "transform"),
    ("adan-fast", "scale_by_adan", {"b1": 0.9, "b2": 0.8, "b3": 0.95, "eps_root": 1e-8, "eps": 1e-6}, "transform"),
    ("adan-alias", "adan", {"learning_rate": 0.02, "weight_decay": 0.1}, "alias"),
    ("adan-alias-mask", "adan", {"learning_rate": 0.02, "weight_decay": 0.1, "mask": DECAY_MASK}, "alias"),
    ("lars-alias", "lars", {"learning_rate": 0.5, "weight_decay": 1e-2}, "alias"),
    (
        "lars-nesterov-masks",
        "lars",
        {
            "learning_rate": 0.3,
            "weight_decay": 1e-2,
            "weight_decay_mask": DECAY_MASK,
            "trust_ratio_mask": MASK,
            "trust_coefficient": 0.01,
            "eps": 1e-3,
            "momentum": 0.8,
            "nesterov": True,
        },
        "alias",
    ),
    ("sm3-default", "scale_by_sm3", {}, "transform"),
    ("sm3-decayed", "scale_by_sm3", {"b1": 0.5, "b2": 0.9, "eps": 1e-6}, "transform"),
    ("sm3-alias", "sm3", {"learning_rate": 0.1}, "alias"),
    ("fromage-alias", "fromage", {"learning_rate": 0.1}, "alias"),
    ("fromage-schedule", "fromage", {"learning_rate": LINEAR_LR, "min_norm": 1e-3}, "alias"),
    ("noisy-sgd-no-noise", "noisy_sgd", {"learning_rate": 0.1, "eta": 0.0, "key": 0}, "alias"),
    ("add-noise-no-noise", "add_noise", {"eta": 0.0, "gamma": 0.55, "key": 0}, "transform"),
    ("polyak-default", "scale_by_polyak", {}, "transform"),
    (
        "polyak-plus",
        "scale_by_polyak",
        {"f_min": 0.5, "max_learning_rate": 0.2, "eps": 1e-3, "variant": "sps+"},
        "transform",
    ),
    ("polyak-sgd-alias", "polyak_sgd", {"max_learning_rate": 0.3, "scaling": 0.5}, "alias"),
    ("optimistic-default", "scale_by_optimistic_gradient", {}, "transform"),
    ("optimistic-weights", "scale_by_optimistic_gradient", {"alpha": 0.5, "beta": 2.0}, "transform"),
    ("ogd-alias", "optimistic_gradient_descent", {"learning_rate": 0.1, "alpha": 0.7, "beta": 0.3}, "alias"),
    ("optimistic-adam-alias", "optimistic_adam", {"learning_rate": 0.01}, "alias"),
    ("optimistic-adam-v2-alias", "optimistic_adam_v2", {"learning_rate": 0.01}, "alias"),
    (
        "optimistic-adam-v2-schedule",
        "optimistic_adam_v2",
        {"learning_rate": LINEAR_LR, "alpha": 0.5, "beta": 2.0, "nesterov": False, "eps_root": 1e-10},
        "alias",
    ),
    (
        "optimistic-adam-plain",
        "optimistic_adam",
        {"learning_rate": 0.02, "optimism": 0.05, "nesterov": False, "eps_root": 1e-10},
        "alias",
    ),
    ("centralize", "centralize", {}, "transform"),
    ("normalize-default", "normalize_by_update_norm", {}, "transform"),
    ("normalize-scaled", "normalize_by_update_norm", {"scale_factor": 2.0, "eps": 0.1}, "transform"),
    ("agc", "adaptive_grad_clip", {"clipping": 0.3}, "transform"),
    ("agc-axis", "adaptive_grad_clip", {"clipping": 0.5, "eps": 0.1, "axis": 0}, "transform"),
    ("nonnegative", "keep_params_nonnegative", {}, "transform"),
    ("apply-every", "apply_every", {"k": 3}, "transform"),
    # wrappers: {"inner": [name, kwargs], "every": n} runs the inner transform where step % n != 0
    ("conditionally-mask", "conditionally_mask", {"inner": ["scale_by_adam", {}], "every": 3}, "transform"),
    (
        "conditionally-transform",
        "conditionally_transform",
        {"inner": ["scale_by_adam", {"b1": 0.5}], "every": 4},
        "transform",
    ),
    # flatten: {"inner": [name, kwargs]} run on the concatenation of the leaves
    ("flatten-adam", "flatten", {"inner": ["scale_by_adam", {"b1": 0.8}]}, "transform"),
    ("flatten-trust-ratio", "flatten", {"inner": ["scale_by_trust_ratio", {"trust_coefficient": 0.5}]}, "transform"),
    ("flatten-lars", "flatten", {"inner": ["lars", {"learning_rate": 0.5, "weight_decay": 1e-2}]}, "alias"),
    ("amsgrad-default", "scale_by_amsgrad", {}, "transform"),
    (
        "amsgrad-uncorrected",
        "scale_by_amsgrad",
        {"b1": 0.8, "b2": 0.9, "eps": 1e-6, "eps_root": 1e-8, "bias_correction_mu": False, "bias_correction_nu": False},
        "transform",
    ),
    ("amsgrad-alias", "amsgrad", {"learning_rate": 0.05, "b2": 0.99}, "alias"),
    ("adamaxw-alias", "adamaxw", {"learning_rate": 0.02, "weight_decay": 0.1}, "alias"),
    (
        "adamaxw-mask-schedule",
        "adamaxw",
        {"learning_rate": LINEAR_LR, "weight_decay": 0.05, "mask": DECAY_MASK},
        "alias",
    ),
    # DoG's update has the gradient's sign: global_scale -1 descends
    (
        "dog-float64-start",
        "scale_by_distance_over_gradients",
        {"reps_rel": 1e-2, "global_scale": -1.0, "param_dtype": {"dtype": "float64"}},
        "alias",
    ),
    ("dog-default-float32-start", "scale_by_distance_over_gradients", {"global_scale": -1.0}, "alias"),
    ("param-block-norm", "scale_by_param_block_norm", {}, "transform"),
    ("param-block-norm-floor", "scale_by_param_block_norm", {"min_scale": 1.2}, "transform"),
]


def _resolve(name: str, value: Any) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        return getattr(jnp, value["dtype"])
    if isinstance(value, dict) and "schedule" in value:
        schedule = getattr(optax, value["schedule"])(**value["kwargs"])
        # optax's schedules compute in float32 on an int32 count even with x64: an int64 count gives float64
        return lambda count: schedule(jnp.asarray(count).astype(jnp.int64))
    return value


def _build(path: str, kwargs: dict[str, Any]) -> Any:
    if "inner" in kwargs:
        inner_name, inner_kwargs = kwargs["inner"]
        inner = getattr(optax, inner_name)(**inner_kwargs)
        if "every" not in kwargs:
            return getattr(optax, path)(inner)
        every = kwargs["every"]
        return getattr(optax, path)(inner, lambda step: step % every != 0)
    return getattr(optax, path)(**{k: _resolve(k, v) for k, v in kwargs.items()})


def _tree(values: dict[str, list]) -> dict[str, jnp.ndarray]:
    return {name: jnp.asarray(v, dtype=jnp.float64) for name, v in values.items()}


def _lists(tree: dict[str, jnp.ndarray]) -> dict[str, list]:
    for leaf in tree.values():
        assert leaf.dtype == jnp.float64, leaf.dtype
    return {name: np.asarray(leaf).tolist() for name, leaf in tree.items()}


def run(path: str, kwargs: dict[str, Any], kind: str, grads: list, losses: list[float]) -> list:
    tx = _build(path, kwargs)
    params = _tree(start())
    state = tx.init(params)
    trajectory = []
    for g, loss in zip(grads, losses):
        extra = {"value": jnp.asarray(loss, dtype=jnp.float64)} if "polyak" in path else {}
        updates, state = tx.update(_tree(g), state, params, **extra)
        if kind == "alias":
            params = optax.apply_updates(params, updates)
            trajectory.append(_lists(params))
        else:
            trajectory.append(_lists(updates))
    return trajectory


def per_example() -> dict[str, Any]:
    """``per_example_global_norm_clip`` on a batch of 5 examples, two of them below the bound and one zero."""
    rng = np.random.default_rng(0)
    grads = {"b": rng.normal(size=(5, 3)), "w": rng.normal(size=(5, 2, 2))}
    grads["b"][1] *= 0.05
    grads["w"][1] *= 0.05
    grads["b"][3] = 0.0
    grads["w"][3] = 0.0
    summed, clipped = optax.per_example_global_norm_clip(_tree(grads), 1.0)
    return {"grads": _lists(_tree(grads)), "l2_norm_clip": 1.0, "sum": _lists(summed), "num_clipped": int(clipped)}


def monitoring() -> dict[str, Any]:
    """A momentum step whose chain measures its updates before clipping (monitor: a norm, the debiased average of
    a flag of a norm above 20, the plain average of the squares) and after (snapshot: the largest element): the
    params and the measurements after every step, and the snapshot of the params at init."""
    tx = optax.chain(
        optax.trace(decay=0.9),
        optax.monitor(
            {
                "norm": optax.tree.norm,
                "large": optax.measure_with_ema(lambda u: optax.tree.norm(u) > 20.0, 0.9),
                "squares": optax.measure_with_ema(lambda u: jax.tree.map(jnp.square, u), 0.8, debias=False),
            }
        ),
        optax.clip_by_global_norm(2.0),
        optax.snapshot("max", optax.tree.max),
        optax.scale(-0.1),
    )
    params = _tree(start())
    state = tx.init(params)
    out: dict[str, Any] = {"init_max": float(state[3].measurement["max"]), "steps": []}
    for g in gradients():
        updates, state = tx.update(_tree(g), state, params)
        params = optax.apply_updates(params, updates)
        measured = state[1].measurements
        out["steps"].append(
            {
                "params": _lists(params),
                "norm": float(measured["norm"]),
                "large": float(measured["large"]),
                "squares": _lists(measured["squares"]),
                "max": float(state[3].measurement["max"]),
            }
        )
    return out


def _loss(w: jnp.ndarray, x: jnp.ndarray, y: jnp.ndarray, s: jnp.ndarray) -> jnp.ndarray:
    """Weighted squared error of a tanh layer; ``s`` has its batch axis second."""
    return 0.5 * jnp.sum(s.T * (jnp.tanh(x @ w) - y) ** 2)


def _outputs(w: jnp.ndarray, x: jnp.ndarray, y: jnp.ndarray, *, s: jnp.ndarray) -> dict[str, jnp.ndarray]:
    return {"loss": _loss(w, x, y, s), "pred": jnp.tanh(x @ w), "rows": jnp.asarray(x.shape[0])}


def _gradient(w: jnp.ndarray, x: jnp.ndarray, y: jnp.ndarray, *, s: jnp.ndarray) -> jnp.ndarray:
    return jax.grad(_loss)(w, x, y, s)


def _largest() -> Any:
    """An accumulator of one's own: the elementwise maximum over microbatches."""
    return optax.microbatching.Accumulator(
        init=lambda shape: jnp.full(shape.shape, -jnp.inf, shape.dtype),
        update=lambda carry, value, _: jnp.maximum(carry, value),
        finalize=lambda carry: carry,
        aggregate=lambda values: jnp.max(values, axis=0),
    )


# (name, function, accumulator: an AccumulationType's name, "LARGEST" or a dict of them, microbatch_size, options)
MICROBATCH_CASES: list[tuple[str, str, Any, int, dict[str, Any]]] = [
    ("mean-concat-sum", "outputs", {"loss": "MEAN", "pred": "CONCAT", "rows": "SUM"}, 2, {}),
    (
        "running-mean-early-stop",
        "outputs",
        {"loss": "RUNNING_MEAN", "pred": "CONCAT", "rows": "SUM"},
        2,
        {"num_real_microbatches": 2},
    ),
    ("mean-early-stop", "outputs", {"loss": "MEAN", "pred": "SUM", "rows": "SUM"}, 2, {"num_real_microbatches": 2}),
    ("gradient-sum", "gradient", "SUM", 3, {}),
    ("gradient-running-mean", "gradient", "RUNNING_MEAN", 1, {}),
    ("largest", "outputs", {"loss": "SUM", "pred": "LARGEST", "rows": "SUM"}, 3, {}),
]


def _accumulator(spec: Any) -> Any:
    if isinstance(spec, dict):
        return {key: _accumulator(value) for key, value in spec.items()}
    return _largest() if spec == "LARGEST" else getattr(optax.microbatching.AccumulationType, spec)


def microbatching() -> dict[str, Any]:
    """``microbatch`` over a batch of 6 rows (``x``, ``y`` on axis 0, the keyword argument ``s`` on axis 1)."""
    rng = np.random.default_rng(1)
    inputs = {"w": rng.normal(size=(3, 2)), "x": rng.normal(size=(6, 3)), "y": rng.normal(size=(6, 2))}
    inputs["s"] = rng.uniform(0.5, 1.5, size=(2, 6))
    w, x, y, s = (jnp.asarray(inputs[k]) for k in ("w", "x", "y", "s"))
    functions = {"outputs": _outputs, "gradient": _gradient}
    cases = []
    for name, function, spec, size, options in MICROBATCH_CASES:
        fun = optax.microbatch(
            functions[function], (1, 2), size, _accumulator(spec), argnames="s", in_axes=(0, 0, 1), **options
        )
        result = jax.tree.map(lambda leaf: np.asarray(leaf).tolist(), fun(w, x, y, s=s))
        cases.append({"name": name, "function": function, "accumulator": spec, "microbatch_size": size, **options})
        cases[-1]["result"] = result
    return {"inputs": {k: v.tolist() for k, v in inputs.items()}, "cases": cases}


# ------------------------------------------------------------------------------------ line searches and L-BFGS


def rosenbrock(params: dict[str, jnp.ndarray]) -> jnp.ndarray:
    """Rosenbrock's function of the leaves' elements in the order b, c, w (17 of them)."""
    x = jnp.concatenate([params[name].reshape(-1) for name in sorted(params)])
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def data_loss(params: dict[str, jnp.ndarray], x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """A tanh layer's squared error on a batch (``x``, ``y``, the update's extra arguments) plus a penalty of c."""
    pred = jnp.tanh(x @ params["w"] + params["b"])
    return 0.5 * jnp.sum((pred - y) ** 2) + 0.05 * jnp.sum(params["c"] ** 2) + 0.01 * jnp.sum(params["c"] ** 4)


def batches(steps: int) -> dict[str, list]:
    rng = np.random.default_rng(2)
    return {"x": rng.normal(size=(steps, 4, 2)).tolist(), "y": rng.uniform(-0.8, 0.8, size=(steps, 4, 3)).tolist()}


LINESEARCH_STEPS = 12
ZOOM_ONE = {"max_linesearch_steps": 15, "initial_guess_strategy": "one"}
# (name, chain members [optax name, kwargs], objective, value and gradient from the state or computed)
LINESEARCH_CASES: list[tuple[str, list, str, bool]] = [
    (
        "lbfgs-zoom",
        [["scale_by_lbfgs", {}], ["scale", {"step_size": -1.0}], ["scale_by_zoom_linesearch", ZOOM_ONE]],
        "rosenbrock",
        True,
    ),
    (
        "lbfgs-memory3-unscaled-zoom",
        [
            ["scale_by_lbfgs", {"memory_size": 3, "scale_init_precond": False}],
            ["scale", {"step_size": -1.0}],
            [
                "scale_by_zoom_linesearch",
                {
                    "max_linesearch_steps": 20,
                    "initial_guess_strategy": "one",
                    "approx_dec_rtol": None,
                    "curv_rtol": 0.5,
                    "max_learning_rate": 2.0,
                },
            ],
        ],
        "rosenbrock",
        False,
    ),
    (
        "sgd-zoom-keep",
        [
            ["scale", {"step_size": -1.0}],
            [
                "scale_by_zoom_linesearch",
                {"max_linesearch_steps": 10, "increase_factor": 3.0, "stepsize_precision": 1e-3},
            ],
        ],
        "data",
        False,
    ),
    (
        "sgd-backtracking",
        [["scale", {"step_size": -1.0}], ["scale_by_backtracking_linesearch", {"max_backtracking_steps": 15}]],
        "data",
        False,
    ),
    (
        "sgd-backtracking-store-grad",
        [
            ["scale", {"step_size": -1.0}],
            [
                "scale_by_backtracking_linesearch",
                {
                    "max_backtracking_steps": 30,
                    "slope_rtol": 0.3,
                    "decrease_factor": 0.5,
                    "increase_factor": 2.0,
                    "max_learning_rate": 0.01,
                    "store_grad": True,
                },
            ],
        ],
        "rosenbrock",
        True,
    ),
]


def linesearches() -> dict[str, Any]:
    """Each chain run for LINESEARCH_STEPS updates from START on its objective (the data objective with batch t at
    step t): the params, and the line search's learning rate, value and number of steps after each update."""
    data = batches(LINESEARCH_STEPS)
    cases = []
    for name, members, objective, from_state in LINESEARCH_CASES:
        tx = optax.chain(*[getattr(optax, member)(**kwargs) for member, kwargs in members])
        fn = rosenbrock if objective == "rosenbrock" else data_loss
        params = _tree(start())
        state = tx.init(params)
        steps = []
        for t in range(LINESEARCH_STEPS):
            args = {} if objective == "rosenbrock" else {k: jnp.asarray(v[t]) for k, v in data.items()}
            if from_state:
                value, grad = optax.value_and_grad_from_state(fn)(params, state=state, **args)
            else:
                value, grad = jax.value_and_grad(fn)(params, **args)
            updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn, **args)
            params = optax.apply_updates(params, updates)
            search = state[-1]
            steps.append(
                {
                    "params": _lists(params),
                    "learning_rate": float(search.learning_rate),
                    "value": float(search.value),
                    "num_linesearch_steps": int(search.info.num_linesearch_steps),
                }
            )
        cases.append(
            {"name": name, "members": members, "objective": objective, "from_state": from_state, "steps": steps}
        )
    return {"batches": data, "cases": cases}


class _Plateau:
    """A stateful schedule: the rate halves at each update whose loss (``value``) is above the best so far."""

    def init(self) -> dict[str, jnp.ndarray]:
        return {"rate": jnp.asarray(0.05), "best": jnp.asarray(jnp.inf)}

    def update(self, state: dict[str, jnp.ndarray], *, value: jnp.ndarray, **_: Any) -> dict[str, jnp.ndarray]:
        worse = value > state["best"]
        return {"rate": jnp.where(worse, 0.5 * state["rate"], state["rate"]), "best": jnp.minimum(state["best"], value)}

    def __call__(self, state: dict[str, jnp.ndarray], **_: Any) -> jnp.ndarray:
        return state["rate"]


def stateful_schedule() -> dict[str, Any]:
    """``inject_hyperparams(amsgrad)`` with the plateau schedule as its learning rate, the loss values as ``value``:
    the params and the rate used after each update."""
    tx = optax.inject_hyperparams(optax.amsgrad)(learning_rate=_Plateau(), b1=0.8)
    params = _tree(start())
    state = tx.init(params)
    steps = []
    for g, loss in zip(gradients(), values()):
        updates, state = tx.update(_tree(g), state, params, value=jnp.asarray(loss))
        params = optax.apply_updates(params, updates)
        steps.append({"params": _lists(params), "learning_rate": float(state.hyperparams["learning_rate"])})
    return {"b1": 0.8, "initial_rate": 0.05, "steps": steps}


def per_example_layers() -> dict[str, Any]:
    """``per_example_layer_norm_clip`` of per_example's batch, with uniform and size-weighted bounds."""
    grads = _tree(per_example()["grads"])
    out: dict[str, Any] = {"global_l2_norm_clip": 1.0}
    for uniform in (True, False):
        summed, clipped = optax.per_example_layer_norm_clip(grads, 1.0, uniform=uniform)
        out["uniform" if uniform else "by_size"] = {
            "sum": _lists(summed),
            "num_clipped": {name: int(n) for name, n in clipped.items()},
        }
    return out


def linear_algebra() -> dict[str, Any]:
    """``power_iteration`` of a symmetric positive definite matrix (converged, and stopped after 3 products) and of a
    block matrix-vector product over a dict, from given start vectors; ``matrix_inverse_pth_root`` of it for p = 1,
    2, 4, of a rank-3 PSD matrix (the ridge makes it definite) and of a 1x1 matrix."""
    rng = np.random.default_rng(3)
    b = rng.normal(size=(5, 5))
    spd = b @ b.T / 5 + 0.5 * np.eye(5)
    low_rank = rng.normal(size=(5, 3))
    psd = low_rank @ low_rank.T
    v0 = rng.normal(size=5)
    a = jnp.asarray(spd)
    out: dict[str, Any] = {"spd": spd.tolist(), "psd": psd.tolist(), "v0": v0.tolist()}
    for name, iters in (("converged", 100), ("three_products", 3)):
        value, vector = optax.power_iteration(a, v0=jnp.asarray(v0), num_iters=iters)
        out[f"power_{name}"] = {"num_iters": iters, "value": float(value), "vector": np.asarray(vector).tolist()}

    def product(v: dict[str, jnp.ndarray]) -> dict[str, jnp.ndarray]:
        return {"a": a[:3, :3] @ v["a"] + a[:3, 3:] @ v["b"], "b": a[3:, :3] @ v["a"] + a[3:, 3:] @ v["b"]}

    value, vector = optax.power_iteration(product, v0={"a": jnp.asarray(v0[:3]), "b": jnp.asarray(v0[3:])})
    out["power_tree"] = {"value": float(value), "vector": _lists(vector)}
    roots = []
    for matrix_name, matrix, p in (("spd", spd, 1), ("spd", spd, 2), ("spd", spd, 4), ("psd", psd, 2)):
        root, error = optax.matrix_inverse_pth_root(jnp.asarray(matrix), p)
        roots.append({"matrix": matrix_name, "p": p, "root": np.asarray(root).tolist(), "error": float(error)})
    root, error = optax.matrix_inverse_pth_root(jnp.asarray([[2.5]]), 4)
    roots.append({"matrix": [[2.5]], "p": 4, "root": np.asarray(root).tolist(), "error": float(error)})
    out["inverse_pth_roots"] = roots
    return out


# (x, min_norm, ord, axis, keepdims) of safe_norm; x a matrix whose second row is zero
SAFE_NORM_CASES: list[tuple[list, float, Any, Any, bool]] = [
    ([[3.0, -4.0], [0.0, 0.0]], 0.5, None, None, False),
    ([[3.0, -4.0], [0.0, 0.0]], 0.5, None, 1, False),
    ([[3.0, -4.0], [0.0, 0.0]], 0.5, None, 1, True),
    ([[3.0, -4.0], [0.0, 0.0]], 6.0, None, None, True),
    ([[3.0, -4.0], [0.0, 0.0]], 0.5, 1, 1, False),
    ([[3.0, -4.0], [0.0, 1e-3]], 0.5, "inf", 1, False),
    ([[3.0, -4.0], [0.5, 2.0]], 0.5, "nuc", [0, 1], False),
]


def numerics() -> dict[str, Any]:
    """safe_norm and safe_root_mean_squares, with the gradients of their sums (0 where the floor holds)."""
    norms = []
    for x, min_norm, order, axis, keepdims in SAFE_NORM_CASES:
        ord_ = jnp.inf if order == "inf" else order
        axis_ = tuple(axis) if isinstance(axis, list) else axis

        def total(y: jnp.ndarray, m: float = min_norm, o: Any = ord_, a: Any = axis_, k: bool = keepdims) -> Any:
            return jnp.sum(optax.safe_norm(y, m, o, a, k))

        value = optax.safe_norm(jnp.asarray(x), min_norm, ord_, axis_, keepdims)
        grad = jax.grad(total)(jnp.asarray(x))
        norms.append(
            {
                "x": x,
                "min_norm": min_norm,
                "ord": order,
                "axis": axis,
                "keepdims": keepdims,
                "value": np.asarray(value).tolist(),
                "grad": np.asarray(grad).tolist(),
            }
        )
    rms = []
    for x, min_rms in (([3.0, -4.0, 0.0], 0.5), ([0.0, 0.0, 0.0], 0.5), ([0.1, -0.2, 0.0], 0.5)):
        value = optax.safe_root_mean_squares(jnp.asarray(x), min_rms)
        grad = jax.grad(lambda y, m=min_rms: optax.safe_root_mean_squares(y, m))(jnp.asarray(x))
        rms.append({"x": x, "min_rms": min_rms, "value": float(value), "grad": np.asarray(grad).tolist()})
    return {"safe_norm": norms, "safe_root_mean_squares": rms}


def utilities() -> dict[str, Any]:
    """incremental_update and periodic_update of a slow copy of START along the gradients (step size 0.1, period
    3), the gradient through scale_gradient, and multi_normal's log density of three points."""
    average, copy = _tree(start()), _tree(start())
    averages, copies = [], []
    for t, g in enumerate(gradients()):
        average = optax.incremental_update(_tree(g), average, 0.1)
        copy = optax.periodic_update(_tree(g), copy, t, 3)
        averages.append(_lists(average))
        copies.append(_lists(copy))
    x = jnp.asarray(start()["w"])
    scaled = jax.grad(lambda y: jnp.sum(jnp.sin(optax.scale_gradient(y, 0.3) * y) ** 2))(x)
    loc, log_scale = np.asarray([0.5, -1.0, 2.0]), np.asarray([0.1, -0.3, 0.7])
    points = np.asarray([[0.0, 0.0, 0.0], [0.5, -1.0, 2.0], [1.5, 0.2, -3.0]])
    density = optax.multi_normal(jnp.asarray(loc), jnp.asarray(log_scale)).log_prob(jnp.asarray(points))
    return {
        "incremental_update": {"step_size": 0.1, "values": averages},
        "periodic_update": {"update_period": 3, "values": copies},
        "scale_gradient": {"scale": 0.3, "x": np.asarray(x).tolist(), "grad": np.asarray(scaled).tolist()},
        "multi_normal": {
            "loc": loc.tolist(),
            "log_scale": log_scale.tolist(),
            "points": points.tolist(),
            "log_prob": np.asarray(density).tolist(),
        },
    }


def main() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)  # optimistic_adam's
    grads, losses = gradients(), values()
    cases = [
        {"name": name, "optax": path, "kwargs": kwargs, "kind": kind, "values": run(path, kwargs, kind, grads, losses)}
        for name, path, kwargs, kind in CASES
    ]
    out = {
        "optax_version": optax.__version__,
        "start": start(),
        "grads": grads,
        "losses": losses,
        "cases": cases,
        "per_example_global_norm_clip": per_example(),
        "monitoring": monitoring(),
        "microbatch": microbatching(),
        "linesearch": linesearches(),
        "stateful_schedule": stateful_schedule(),
        "per_example_layer_norm_clip": per_example_layers(),
        "linear_algebra": linear_algebra(),
        "numerics": numerics(),
        "utilities": utilities(),
    }
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "optax_catalogue.json"
    target.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {len(cases)} cases to {target} (optax {optax.__version__})")


if __name__ == "__main__":
    main()
