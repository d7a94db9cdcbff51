"""Writes tests/data/optax_modern.json: optax's float64 trajectories of ADOPT, AdEMAMix, Yogi and AdaBelief for the
cases of tests/test_modern_optimizers.py.

Each case runs a transform (``scale_by_*``: its updates at every step) or an alias (the params after every step) of
optax on a fixed sequence of gradients, stored with the results, so the tests need neither jax nor optax.

Needs jax and optax, which fadam does not depend on; run once where they are installed:
    PYTHONPATH=<dir with jax, optax> python scripts/optax_modern_reference.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402  (float64 must be enabled before arrays are made)
import optax  # noqa: E402

STEPS = 15
START = [0.5, -1.0, 2.0, 0.0, -0.25, 3.0]


def gradients() -> list[list[float]]:
    """A fixed sequence: signs that flip, a component that grows (ADOPT's clipping engages on it), a component that is
    exactly zero at first (the square roots of zero second moments) and one tiny one."""
    sequence = []
    for t in range(STEPS):
        sequence.append(
            [
                math.sin(1.3 * t + 0.4),
                -0.5 + 0.1 * t,
                (1.5**t) * 0.01 * (-1) ** t,
                0.0 if t < 3 else math.cos(0.7 * t),
                1e-7 * (t + 1),
                2.0 * math.cos(0.9 * t) - 0.3,
            ]
        )
    return sequence


# kwargs values of the form {"schedule": name, "kwargs": {...}} are optax schedules (fadam has the same names)
LINEAR_ALPHA = {"schedule": "linear_schedule", "kwargs": {"init_value": 0.0, "end_value": 5.0, "transition_steps": 8}}
LINEAR_B3 = {"schedule": "linear_schedule", "kwargs": {"init_value": 0.9, "end_value": 0.999, "transition_steps": 10}}

# (name, optax function path, kwargs, kind): kind "transform" records updates, "alias" the params
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("adopt-default", "contrib.scale_by_adopt", {}, "transform"),
    ("adopt-fast-b2", "contrib.scale_by_adopt", {"b1": 0.8, "b2": 0.5, "eps": 1e-3}, "transform"),
    ("adopt-no-clipping", "contrib.scale_by_adopt", {"b2": 0.9, "use_clipping": False}, "transform"),
    ("adopt-nesterov", "contrib.scale_by_adopt", {"b2": 0.7, "nesterov": True}, "transform"),
    ("adopt-alias", "contrib.adopt", {"learning_rate": 0.05, "b2": 0.9}, "alias"),
    ("ademamix-default", "contrib.scale_by_ademamix", {}, "transform"),
    (
        "ademamix-schedules",
        "contrib.scale_by_ademamix",
        {"b3": LINEAR_B3, "alpha": LINEAR_ALPHA, "eps_root": 1e-10},
        "transform",
    ),
    ("ademamix-alias", "contrib.ademamix", {"learning_rate": 0.02, "b3": 0.99, "weight_decay": 0.1}, "alias"),
    ("yogi-default", "scale_by_yogi", {}, "transform"),
    ("yogi-init-eps-root", "scale_by_yogi", {"initial_accumulator_value": 0.5, "eps_root": 1e-6}, "transform"),
    ("yogi-alias", "yogi", {"learning_rate": 0.05, "b2": 0.99}, "alias"),
    ("belief-default", "scale_by_belief", {}, "transform"),
    ("belief-nesterov", "scale_by_belief", {"b1": 0.8, "eps_root": 0.0, "eps": 1e-10, "nesterov": True}, "transform"),
    ("belief-alias", "adabelief", {"learning_rate": 0.05}, "alias"),
]


def _resolve(value: Any) -> Any:
    if isinstance(value, dict) and "schedule" in value:
        schedule = getattr(optax, value["schedule"])(**value["kwargs"])
        # optax's transforms call schedules with their int32 count, on which optax's schedules compute in float32
        # even with x64 enabled; an int64 count gives their float64 values, which fadam's schedules compute
        return lambda count: schedule(count.astype(jnp.int64))
    return value


def _function(path: str) -> Any:
    target: Any = optax
    for part in path.split("."):
        target = getattr(target, part)
    return target


def run(path: str, kwargs: dict[str, Any], kind: str, grads: list[list[float]]) -> list[list[float]]:
    tx = _function(path)(**{k: _resolve(v) for k, v in kwargs.items()})
    params = jnp.asarray(START, dtype=jnp.float64)
    state = tx.init(params)
    trajectory = []
    for g in grads:
        updates, state = tx.update(jnp.asarray(g, dtype=jnp.float64), state, params)
        assert updates.dtype == jnp.float64
        if kind == "alias":
            params = optax.apply_updates(params, updates)
            trajectory.append([float(x) for x in params])
        else:
            trajectory.append([float(x) for x in updates])
    return trajectory


def main() -> None:
    grads = gradients()
    cases = [
        {"name": name, "optax": path, "kwargs": kwargs, "kind": kind, "values": run(path, kwargs, kind, grads)}
        for name, path, kwargs, kind in CASES
    ]
    out = {"optax_version": optax.__version__, "start": START, "grads": grads, "cases": cases}
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "optax_modern.json"
    lines = [f'{{"optax_version": {json.dumps(out["optax_version"])}, "start": {json.dumps(START)},']
    lines.append(' "grads": [' + ",\n  ".join(json.dumps(g) for g in grads) + "],")
    lines.append(' "cases": [\n  ' + ",\n  ".join(json.dumps(case) for case in cases) + "\n ]}")
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(cases)} cases to {target} (optax {optax.__version__})")


if __name__ == "__main__":
    main()
