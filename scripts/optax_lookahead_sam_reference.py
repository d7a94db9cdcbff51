"""Writes tests/data/optax_lookahead_sam.json: optax's float64 trajectories of ``optax.lookahead`` and
``optax.contrib.sam`` for the cases of tests/test_prodigy_mars_lookahead.py.

Each case steps on the gradient of the quadratic ``sum a (x - c)^2 / 2`` below (written out again in the test) at the
params the gradients must be taken at (lookahead's fast params; SAM's current params, or ``grad_fn``'s argument in
opaque mode), from ``START``, and records the params after every step (lookahead: fast and slow).

Needs jax and optax, which fadam does not depend on; run once where they are installed:
    PYTHONPATH=<dir with jax, optax> python scripts/optax_lookahead_sam_reference.py
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402  (float64 must be enabled before arrays are made)
import optax  # noqa: E402

STEPS = 24
START = [0.5, -1.0, 2.0, 0.0, -0.25, 3.0]
A = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
C = [1.0, -0.5, 0.25, 0.0, 2.0, -1.0]

# (name, kind, kwargs): optimizers given as {"sgd": lr}, {"adam": lr}, or {"normalized_sgd": rho}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("lookahead-sgd", "lookahead", {"fast": {"sgd": 0.1}, "sync_period": 3, "slow_step_size": 0.5}),
    (
        "lookahead-adam-reset",
        "lookahead",
        {"fast": {"adam": 0.05}, "sync_period": 4, "slow_step_size": 0.3, "reset_state": True},
    ),
    ("lookahead-every-step", "lookahead", {"fast": {"adam": 0.05}, "sync_period": 1, "slow_step_size": 0.8}),
    ("sam-sgd", "sam", {"optimizer": {"sgd": 0.05}, "adv_optimizer": {"normalized_sgd": 0.1}, "sync_period": 2}),
    (
        "sam-adam-no-reset",
        "sam",
        {
            "optimizer": {"adam": 0.02},
            "adv_optimizer": {"adam": 0.05},
            "sync_period": 3,
            "reset_state": False,
        },
    ),
    (
        "sam-opaque",
        "sam",
        {
            "optimizer": {"adam": 0.02},
            "adv_optimizer": {"normalized_sgd": 0.1},
            "sync_period": 3,
            "opaque_mode": True,
        },
    ),
]


def gradient(x: jnp.ndarray) -> jnp.ndarray:
    return jnp.asarray(A) * (x - jnp.asarray(C))


def build(spec: dict[str, float]) -> optax.GradientTransformation:
    ((kind, rate),) = spec.items()
    if kind == "sgd":
        return optax.sgd(rate)
    if kind == "adam":
        return optax.adam(rate)
    return optax.chain(optax.contrib.normalize(), optax.sgd(rate))


def run_lookahead(kwargs: dict[str, Any]) -> dict[str, list]:
    options = {k: v for k, v in kwargs.items() if k != "fast"}
    tx = optax.lookahead(build(kwargs["fast"]), **options)
    params = optax.LookaheadParams.init_synced(jnp.asarray(START, dtype=jnp.float64))
    state = tx.init(params)
    fast, slow = [], []
    for _ in range(STEPS):
        updates, state = tx.update(gradient(params.fast), state, params)
        params = optax.apply_updates(params, updates)
        fast.append([float(v) for v in params.fast])
        slow.append([float(v) for v in params.slow])
    return {"fast": fast, "slow": slow}


def run_sam(kwargs: dict[str, Any]) -> dict[str, list]:
    options = {k: v for k, v in kwargs.items() if k not in ("optimizer", "adv_optimizer")}
    tx = optax.contrib.sam(build(kwargs["optimizer"]), build(kwargs["adv_optimizer"]), **options)
    params = jnp.asarray(START, dtype=jnp.float64)
    state = tx.init(params)
    trajectory = []
    for _ in range(STEPS):
        extra = {"grad_fn": lambda p, i: gradient(p)} if kwargs.get("opaque_mode") else {}
        updates, state = tx.update(gradient(params), state, params, **extra)
        params = optax.apply_updates(params, updates)
        trajectory.append([float(v) for v in params])
    return {"params": trajectory}


def main() -> None:
    cases = []
    for name, kind, kwargs in CASES:
        result = run_lookahead(kwargs) if kind == "lookahead" else run_sam(kwargs)
        cases.append({"name": name, "kind": kind, "kwargs": kwargs, **result})
    out = {
        "optax_version": version("optax"),
        "jax_version": version("jax"),
        "steps": STEPS,
        "start": START,
        "a": A,
        "c": C,
        "cases": cases,
    }
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "optax_lookahead_sam.json"
    head = {key: out[key] for key in ("optax_version", "jax_version", "steps", "start", "a", "c")}
    lines = [json.dumps(head)[:-1] + ","]
    lines.append(' "cases": [\n  ' + ",\n  ".join(json.dumps(case) for case in cases) + "\n ]}")
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(cases)} cases to {target} (optax {out['optax_version']})")


if __name__ == "__main__":
    main()
