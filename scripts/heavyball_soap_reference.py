"""Writes tests/data/heavyball_soap.json: float64 trajectories of ``heavyball.SOAP`` for the cases of
tests/test_soap_shampoo.py.

Each case steps the reference on the gradients of a noisy quadratic taken at its own params, and stores those
gradients with the params after every step (float64, exact in JSON), so the tests replay them without the package.
heavyball's options are set to the official SOAP's algorithm where heavyball has one: no dim merging, no clipping,
no warmup, float64 state, eager steps. One schedule is replaced: heavyball moves the eigenbases on the calls whose
count (from 1, the first call included) is a multiple of ``precondition_frequency``, the official implementation
after the Adam steps whose count (from 1, the first call excluded) is; the script gives heavyball a schedule that
moves them on the official steps.

What stays heavyball's own (the tests' tolerance covers it): its power step adds ``1e-8`` times the largest
estimated eigenvalue to the statistic (a lift of its null space), Adam's denominator is ``max(sqrt(v_hat), eps)``
rather than ``sqrt(v) + eps``, and its statistics are bias-corrected EMAs (a scale, which leaves the eigenbases as
they are).

Needs heavyball, which fadam does not depend on; run once where it is installed:
    pip install --target /tmp/heavyball-deps --no-deps heavyball opt-einsum
    PYTHONPATH=/tmp/heavyball-deps python scripts/heavyball_soap_reference.py
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import heavyball
import torch

STEPS = 15
SHAPES = {"vector": [3], "matrix": [4, 5], "cube": [2, 3, 4], "wide": [3, 12]}  # "wide": 12 > max_precond_dim

# (name, heavyball.SOAP's kwargs, shapes); every case has max_precond_dim=10
CASES: list[tuple[str, dict[str, Any], dict[str, list[int]]]] = [
    (
        "official-defaults-frequency-2",
        {"lr": 0.05, "betas": (0.95, 0.95), "shampoo_beta": 0.95, "eps": 1e-8, "weight_decay": 0.01},
        SHAPES,
    ),
    (
        "frequency-3-precondition-1d",
        {
            "lr": 0.02,
            "betas": (0.9, 0.99),
            "shampoo_beta": 0.9,
            "eps": 1e-10,
            "weight_decay": 0.1,
            "precondition_frequency": 3,
            "precondition_1d": True,
        },
        {**SHAPES, "vector": [2]},  # a vector's first statistic has rank 1: 2 dims give it a unique eigenbasis
    ),
]
MATCHED = {"merge_dims": False, "max_precond_dim": 10, "storage_dtype": "float64", "compile_step": False}


def gradient(name: str, p: torch.Tensor, t: int) -> torch.Tensor:
    """The gradient of ``sum a (p - c)^2 / 2`` plus a deterministic oscillation, at step ``t``."""
    index = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
    a = 0.5 + 0.25 * torch.cos(index)
    c = torch.sin(index + len(name))
    return a * (p - c) + 0.5 * torch.sin(1.3 * t + 2.1 * index + len(name))


def start(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}


def official_schedule(frequency: int) -> Any:
    """heavyball's precondition probability at call ``k``: 1 after the official Adam steps ``k - 1`` that move the
    eigenbases (multiples of ``frequency``), 0 otherwise."""
    return lambda k: 1.0 if k > 1 and (k - 1) % frequency == 0 else 0.0


def run(kwargs: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, Any]:
    params = {name: p.clone().requires_grad_(True) for name, p in start(shapes).items()}
    frequency = kwargs.get("precondition_frequency", 2)
    opt = heavyball.SOAP(list(params.values()), **{"precondition_frequency": frequency, **kwargs, **MATCHED})
    opt.precond_schedule = official_schedule(frequency)
    grads, trajectory = [], []
    for t in range(1, STEPS + 1):
        step_grads = {}
        for name, p in params.items():
            g = gradient(name, p.detach(), t)
            step_grads[name] = g.tolist()
            p.grad = g.clone()
        grads.append(step_grads)
        opt.step()
        trajectory.append({name: p.detach().tolist() for name, p in params.items()})
    return {"grads": grads, "params": trajectory}


def main() -> None:
    cases = []
    for name, kwargs, shapes in CASES:
        start_params = {k: v.tolist() for k, v in start(shapes).items()}
        cases.append({"name": name, "kwargs": kwargs, "start": start_params, **run(kwargs, shapes)})
    out = {
        "heavyball_version": version("heavyball"),
        "torch_version": torch.__version__,
        "steps": STEPS,
        "matched": MATCHED,
        "cases": cases,
    }
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "heavyball_soap.json"
    head = {key: out[key] for key in ("heavyball_version", "torch_version", "steps", "matched")}
    lines = [json.dumps(head)[:-1] + ","]
    lines.append(' "cases": [\n  ' + ",\n  ".join(json.dumps(case) for case in cases) + "\n ]}")
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(cases)} cases to {target} (heavyball {out['heavyball_version']})")


if __name__ == "__main__":
    main()
