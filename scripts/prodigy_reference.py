"""Writes tests/data/prodigy.json: float64 trajectories of ``prodigyopt.Prodigy`` for the cases of
tests/test_prodigy_mars_lookahead.py.

Each case steps the reference on the gradients of a noisy quadratic taken at its own params (so that the params move
the way a training run moves them and ``d`` grows), and stores those gradients with the results (float64, exact in
JSON), so the tests replay them without the package or the loss. Recorded after every step: ``d``, ``d_max`` and
``d_numerator``; at the checkpoint steps: the params. Some cases give zero gradients for the first steps (prodigyopt
then takes no step) or no gradient to one param on some steps; one warms the lr up from 0 (a ``LambdaLR`` stepped
after every step: prodigyopt takes no step, and counts none, while the lr is 0).

Needs prodigyopt, which fadam does not depend on (it is pure Python over torch); run once where it is installed:
    python3 -m venv /tmp/prodigy-venv && /tmp/prodigy-venv/bin/pip install prodigyopt
    PYTHONPATH=$(echo /tmp/prodigy-venv/lib/python3*/site-packages) python scripts/prodigy_reference.py
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import prodigyopt
import torch

STEPS = 120
CHECKPOINTS = [1, 2, 5, 10, 20, 40, 60, 80, 100, 120]
START = {"w": [[0.5, -1.0, 2.0], [0.0, -0.25, 3.0]], "b": [0.1, -0.2, 0.0], "s": 1.5}

# (name, kwargs, zero_steps: leading steps with zero gradients, none_steps: steps where "b" has no gradient)
CASES: list[tuple[str, dict[str, Any], int, list[int]]] = [
    ("default", {}, 0, []),
    ("decoupled-decay-bias-correction", {"weight_decay": 0.1, "use_bias_correction": True}, 0, []),
    (
        "coupled-decay-safeguard-growth",
        {
            "lr": 0.5,
            "weight_decay": 0.05,
            "decouple": False,
            "safeguard_warmup": True,
            "growth_rate": 1.05,
            "d_coef": 2.0,
            "beta3": 0.9,
        },
        0,
        [],
    ),
    ("no-first-moment", {"betas": (0.0, 0.99), "eps": 1e-6, "d0": 1e-4}, 0, []),
    ("zero-start-missing-grads", {"betas": (0.8, 0.95), "d0": 1e-3}, 3, [6, 7, 30]),
    ("warmup-from-zero-bias-correction", {"use_bias_correction": True, "weight_decay": 0.01}, 0, []),
]
# name -> steps of a linear warmup of the lr from 0 (the factor min(1, n / steps) at the n-th step from 0)
WARMUP_STEPS = {"warmup-from-zero-bias-correction": 5}


def gradient(name: str, p: torch.Tensor, t: int) -> torch.Tensor:
    """The gradient of ``sum a (p - c)^2 / 2`` plus a deterministic oscillation, at step ``t``."""
    index = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
    a = 0.5 + 0.25 * index
    c = torch.cos(index + len(name))
    return a * (p - c) + 0.3 * torch.sin(1.7 * t + index)


def run(kwargs: dict[str, Any], zero_steps: int, none_steps: list[int], warmup: int) -> dict[str, Any]:
    params = {name: torch.tensor(v, dtype=torch.float64, requires_grad=True) for name, v in START.items()}
    opt = prodigyopt.Prodigy(list(params.values()), **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: min(1.0, n / warmup)) if warmup else None
    grads, trace, checkpoints = [], {"d": [], "d_max": [], "d_numerator": []}, []
    for t in range(1, STEPS + 1):
        step_grads = {}
        for name, p in params.items():
            if name == "b" and t in none_steps:
                p.grad = None
                step_grads[name] = None
                continue
            g = gradient(name, p.detach(), t) * (0.0 if t <= zero_steps else 1.0)
            step_grads[name] = g.tolist()
            p.grad = g.clone()  # prodigyopt adds the coupled decay into p.grad
        grads.append(step_grads)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        group = opt.param_groups[0]
        for key in trace:
            trace[key].append(float(group[key]))
        if t in CHECKPOINTS:
            checkpoints.append({name: p.detach().tolist() for name, p in params.items()})
    return {"grads": grads, **trace, "params": checkpoints}


def main() -> None:
    cases = []
    for name, kwargs, zero_steps, none_steps in CASES:
        warmup = WARMUP_STEPS.get(name, 0)
        result = run(kwargs, zero_steps, none_steps, warmup)
        case = {"name": name, "kwargs": kwargs, "zero_steps": zero_steps, "none_steps": none_steps}
        cases.append({**case, **({"warmup_steps": warmup} if warmup else {}), **result})
    out = {
        "prodigyopt_version": version("prodigyopt"),
        "torch_version": torch.__version__,
        "steps": STEPS,
        "checkpoints": CHECKPOINTS,
        "start": START,
        "cases": cases,
    }
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "prodigy.json"
    head = {key: out[key] for key in ("prodigyopt_version", "torch_version", "steps", "checkpoints", "start")}
    lines = [json.dumps(head)[:-1] + ","]
    lines.append(' "cases": [\n  ' + ",\n  ".join(json.dumps(case) for case in cases) + "\n ]}")
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(cases)} cases to {target} (prodigyopt {out['prodigyopt_version']})")
    for case in cases:
        print(f"  {case['name']}: d from {case['d'][0]:.3g} to {case['d'][-1]:.3g}")


if __name__ == "__main__":
    main()
