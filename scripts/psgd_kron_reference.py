"""Writes tests/data/psgd_kron.json: float64 trajectories of kron_torch's ``Kron`` (PSGD Kron) for the cases of
tests/test_psgd_kron.py.

Each case steps the reference on the gradients of a noisy quadratic taken at its own params, and stores those
gradients, the params after every step and the final factors Q (float64, exact in JSON), so the tests replay them
without the package. kron_torch runs eagerly (torch.compile disabled) with float64 factors (``precond_dtype``).

Its random draws are fadam's: ``torch.randn_like`` (kron_torch's draw of the vector V of each param's fit, in param
order) returns the draw of ``fadam.transforms._psgd_kron.draw_generator(key, count, index)`` for that param's index,
and the optimizer's ``random.Random(42)`` (its rebalancing decision, one draw per step) returns fadam's shared draw
of the step. The key of each case is the first one whose draws rebalance the factors at least once in its steps.

One change to kron_torch's math: its fit adds the damping noise to the momentum in place, so the preconditioned
update sees the damped momentum too; the script passes the fit a copy (psgd_jax and psgd_torch damp the fit's input
only, as fadam does). What stays kron_torch's own (the tests' tolerance covers it): its triangular solves run in
float32 whatever ``precond_dtype`` is.

Needs kron_torch, which fadam does not depend on; run once where it is installed:
    pip install --target /tmp/kron-deps --no-deps kron-torch
    PYTHONPATH=/tmp/kron-deps python scripts/psgd_kron_reference.py
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

torch._dynamo.config.disable = True  # kron_torch compiles its steps; the reference runs them eagerly

import kron_torch.kron as kron  # noqa: E402

from fadam.transforms._psgd_kron import BALANCE_PROBABILITY, draw_generator, shared_draw  # noqa: E402

STEPS = 10
# "wide": 8 > max_size_triangular; "tall" merges into (12, 2), not (6, 4): kron_torch compares signed differences
SHAPES = {"vector": [3], "matrix": [4, 5], "cube": [2, 3, 4], "wide": [3, 8], "tall": [6, 2, 2]}

# (name, kron_torch.Kron's kwargs, its update schedule's kwargs or None); every case has max_size_triangular=6
CASES: list[tuple[str, dict[str, Any], dict[str, float] | None]] = [
    (
        "probability-1-merged",
        {"lr": 0.05, "weight_decay": 0.01, "preconditioner_update_probability": 1.0},
        None,
    ),
    (
        "schedule-gradient-fit",
        {
            "lr": 0.03,
            "b1": 0.8,
            "min_ndim_triangular": 1,
            "memory_save_mode": "smart_one_diag",
            "momentum_into_precond_update": False,
            "precond_lr": 0.2,
            "precond_init_scale": 2.0,
            "merge_dims": False,
        },
        {"min_prob": 0.3, "decay": 0.5, "flat_start": 2},
    ),
]
MATCHED = {"max_size_triangular": 6, "precond_dtype": "float64", "compile": False}


def gradient(name: str, p: torch.Tensor, t: int) -> torch.Tensor:
    """The gradient of ``sum a (p - c)^2 / 2`` plus a deterministic oscillation, at step ``t``."""
    index = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
    a = 0.5 + 0.25 * torch.cos(index)
    c = torch.sin(index + len(name))
    return a * (p - c) + 0.5 * torch.sin(1.3 * t + 2.1 * index + len(name))


def start(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}


class _Draws:
    """fadam's draws for kron_torch: the vectors of one step's fits in param order, and the step's shared draw."""

    def __init__(self, key: int) -> None:
        self.key, self.count, self.index = key, 0, 0
        self.balanced: list[int] = []

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        generator = draw_generator(self.key, self.count, self.index)
        self.index += 1
        return torch.randn(x.shape, generator=generator, dtype=x.dtype)

    def random(self) -> float:
        return shared_draw(self.key, self.count)


def _fit_on_a_copy(update: Any) -> Any:
    def fit(Q: list, exprs: tuple, G: torch.Tensor, step: torch.Tensor, tiny: torch.Tensor) -> None:
        update(Q, exprs, G.clone(), step, tiny)

    return fit


def run(kwargs: dict[str, Any], schedule: dict[str, float] | None, key: int) -> dict[str, Any]:
    # in sorted order, as fadam flattens a dict: a param's index in kron_torch's list is its leaf index in fadam's
    params = {name: p.clone().requires_grad_(True) for name, p in sorted(start(SHAPES).items())}
    if schedule is not None:
        kwargs = {**kwargs, "preconditioner_update_probability": kron.precond_update_prob_schedule(**schedule)}
    opt = kron.Kron(list(params.values()), max_size_triangular=6, precond_dtype=torch.float64, **kwargs)
    draws = _Draws(key)
    opt.rng = draws
    randn_like, fit = torch.randn_like, kron._update_precond
    torch.randn_like, kron._update_precond = draws.randn_like, _fit_on_a_copy(fit)
    grads, trajectory = [], []
    try:
        for t in range(1, STEPS + 1):
            step_grads = {}
            for name, p in params.items():
                g = gradient(name, p.detach(), t)
                step_grads[name] = g.tolist()
                p.grad = g.clone()
            grads.append(step_grads)
            draws.count, draws.index = t - 1, 0
            opt.step()
            if draws.index and draws.random() < BALANCE_PROBABILITY:
                draws.balanced.append(t)
            trajectory.append({name: p.detach().tolist() for name, p in params.items()})
    finally:
        torch.randn_like, kron._update_precond = randn_like, fit
    factors = {name: [q.tolist() for q in opt.state[p]["Q"]] for name, p in params.items()}
    return {"grads": grads, "params": trajectory, "preconditioners": factors, "balanced_steps": draws.balanced}


def rebalancing_key(kwargs: dict[str, Any], schedule: dict[str, float] | None) -> int:
    """The first key whose shared draws rebalance the factors on some step that updates them."""
    for key in range(10_000):
        if run(kwargs, schedule, key)["balanced_steps"]:
            return key
    raise RuntimeError("no key rebalances the factors")


def main() -> None:
    cases = []
    for name, kwargs, schedule in CASES:
        key = rebalancing_key(kwargs, schedule)
        start_params = {k: v.tolist() for k, v in start(SHAPES).items()}
        cases.append(
            {"name": name, "kwargs": kwargs, "schedule": schedule, "key": key, "start": start_params}
            | run(kwargs, schedule, key)
        )
    out = {
        "kron_torch_version": version("kron-torch"),
        "torch_version": torch.__version__,
        "steps": STEPS,
        "matched": MATCHED,
        "cases": cases,
    }
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "psgd_kron.json"
    head = {key: out[key] for key in ("kron_torch_version", "torch_version", "steps", "matched")}
    lines = [json.dumps(head)[:-1] + ","]
    lines.append(' "cases": [\n  ' + ",\n  ".join(json.dumps(case) for case in cases) + "\n ]}")
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(cases)} cases to {target} (kron_torch {out['kron_torch_version']})")


if __name__ == "__main__":
    main()
