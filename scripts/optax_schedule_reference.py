"""Writes tests/data/optax_schedules.json: optax's schedule values (float64) for the cases of tests/test_schedules.py.

Needs jax and optax, which fadam does not depend on; run once where they are installed:
    PYTHONPATH=<dir with jax, optax> python scripts/optax_schedule_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

STEPS = [0, 1, 2, 3, 5, 7, 10, 15, 24, 25, 26, 30, 49, 50, 51, 60, 75, 99, 100, 101, 110, 150, 200, 250, 1000]

CYCLE = {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 5, "decay_steps": 40, "end_value": 0.1}

# (function name, keyword arguments); boundaries_and_scales are lists of [step, scale] pairs (JSON has no int keys)
CASES = [
    ("constant_schedule", {"value": 0.3}),
    ("linear_schedule", {"init_value": 1.0, "end_value": 0.01, "transition_steps": 100}),
    ("linear_schedule", {"init_value": 0.1, "end_value": 1.0, "transition_steps": 50, "transition_begin": 25}),
    ("linear_schedule", {"init_value": 0.5, "end_value": 0.0, "transition_steps": 0}),
    ("polynomial_schedule", {"init_value": 1.0, "end_value": 0.01, "power": 2, "transition_steps": 100}),
    (
        "polynomial_schedule",
        {"init_value": 2.0, "end_value": 0.5, "power": 0.5, "transition_steps": 75, "transition_begin": 25},
    ),
    ("exponential_decay", {"init_value": 1.0, "transition_steps": 10, "decay_rate": 0.9}),
    ("exponential_decay", {"init_value": 1.0, "transition_steps": 10, "decay_rate": 0.5, "staircase": True}),
    (
        "exponential_decay",
        {"init_value": 0.5, "transition_steps": 7, "decay_rate": 0.8, "transition_begin": 25, "end_value": 0.1},
    ),
    ("exponential_decay", {"init_value": 0.1, "transition_steps": 20, "decay_rate": 1.5, "end_value": 0.5}),
    ("exponential_decay", {"init_value": 0.1, "transition_steps": 20, "decay_rate": 0.0}),
    ("cosine_decay_schedule", {"init_value": 1.0, "decay_steps": 100}),
    ("cosine_decay_schedule", {"init_value": 0.5, "decay_steps": 60, "alpha": 0.1, "exponent": 2.0}),
    ("warmup_cosine_decay_schedule", {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 10, "decay_steps": 110}),
    (
        "warmup_cosine_decay_schedule",
        {
            "init_value": 0.01,
            "peak_value": 0.5,
            "warmup_steps": 25,
            "decay_steps": 200,
            "end_value": 0.05,
            "exponent": 1.5,
        },
    ),
    ("warmup_constant_schedule", {"init_value": 0.0, "peak_value": 0.2, "warmup_steps": 25}),
    (
        "warmup_exponential_decay_schedule",
        {
            "init_value": 0.0,
            "peak_value": 1.0,
            "warmup_steps": 10,
            "transition_steps": 15,
            "decay_rate": 0.7,
            "transition_begin": 5,
            "staircase": True,
            "end_value": 0.2,
        },
    ),
    ("piecewise_constant_schedule", {"init_value": 1.0, "boundaries_and_scales": [[100, 0.1], [200, 0.01]]}),
    ("piecewise_constant_schedule", {"init_value": 0.3, "boundaries_and_scales": [[50, 0.5], [25, 2.0], [75, 0.0]]}),
    (
        "piecewise_interpolate_schedule",
        {"interpolate_type": "linear", "init_value": 1.0, "boundaries_and_scales": [[4, 0.1], [8, 0.01]]},
    ),
    (
        "piecewise_interpolate_schedule",
        {"interpolate_type": "cosine", "init_value": 2.0, "boundaries_and_scales": [[25, 0.5], [50, 3.0], [100, 0.1]]},
    ),
    ("linear_onecycle_schedule", {"transition_steps": 100, "peak_value": 1.0}),
    (
        "linear_onecycle_schedule",
        {
            "transition_steps": 200,
            "peak_value": 0.3,
            "pct_start": 0.2,
            "pct_final": 0.6,
            "div_factor": 10.0,
            "final_div_factor": 100.0,
        },
    ),
    ("cosine_onecycle_schedule", {"transition_steps": 100, "peak_value": 1.0}),
    (
        "cosine_onecycle_schedule",
        {"transition_steps": 150, "peak_value": 0.2, "pct_start": 0.1, "div_factor": 5.0, "final_div_factor": 50.0},
    ),
    ("sgdr_schedule", {"cosine_kwargs": [CYCLE, {**CYCLE, "peak_value": 0.5, "decay_steps": 60}, CYCLE]}),
]


def as_call_kwargs(kwargs: dict) -> dict:
    """The JSON kwargs with boundaries_and_scales turned back into a dict."""
    out = dict(kwargs)
    if "boundaries_and_scales" in out:
        out["boundaries_and_scales"] = {int(step): scale for step, scale in out["boundaries_and_scales"]}
    return out


def main() -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import optax

    records = []
    for name, kwargs in CASES:
        schedule = getattr(optax, name)(**as_call_kwargs(kwargs))
        values = [float(jnp.asarray(schedule(jnp.asarray(step, dtype=jnp.int64)), dtype=jnp.float64)) for step in STEPS]
        records.append({"name": name, "kwargs": kwargs, "values": values})
    header = {"optax_version": optax.__version__, "steps": STEPS}
    lines = ",\n  ".join(json.dumps(record) for record in records)  # one case per line, readable in diffs
    path = Path(__file__).resolve().parents[1] / "tests" / "data" / "optax_schedules.json"
    path.write_text(json.dumps(header)[:-1] + ',\n "cases": [\n  ' + lines + "\n ]\n}\n")
    print(f"wrote {len(records)} cases to {path}")


if __name__ == "__main__":
    main()
