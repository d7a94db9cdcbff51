"""Writes tests/data/schedulefree.json: float64 trajectories of the ``schedulefree`` package's ``AdamWScheduleFree``
and ``SGDScheduleFree`` for the cases of tests/test_schedule_free.py.

Each case steps the reference in train mode on a fixed sequence of gradients (stored with the results, so the tests
need neither the package nor a loss) for two params, and records at the checkpoint steps the params (the train point
``y``) and the evaluation point ``x`` that ``eval()`` gives, read from a copy so the trajectory itself is not switched.
Cases with ``switch_every`` call ``eval()`` then ``train()`` on the optimizer itself after every that many steps, as a
training loop that evaluates does; the round trip moves ``y`` by its rounding, which fadam must reproduce.

Needs schedulefree, which fadam does not depend on; run once where it is installed:
    python3 -m venv /tmp/sf-venv && /tmp/sf-venv/bin/pip install torch==2.13.0 schedulefree
    /tmp/sf-venv/bin/python scripts/schedulefree_reference.py
"""

from __future__ import annotations

import copy
import json
import math
from importlib.metadata import version
from pathlib import Path
from typing import Any

import schedulefree
import torch

STEPS = 240
CHECKPOINTS = [1, 2, 3, 10, 25, 50, 100, 150, 200, 240]
START = {"w": [[0.5, -1.0, 2.0], [0.0, -0.25, 3.0]], "b": [0.1, -0.2, 0.0]}

# (name, class, kwargs, switch_every)
CASES: list[tuple[str, str, dict[str, Any], int]] = [
    ("adamw-default", "AdamWScheduleFree", {}, 0),
    (
        "adamw-warmup-decay",
        "AdamWScheduleFree",
        {
            "lr": 0.05,
            "betas": (0.8, 0.99),
            "eps": 1e-6,
            "weight_decay": 0.1,
            "warmup_steps": 20,
            "r": 1.0,
            "weight_lr_power": 1.5,
        },
        0,
    ),
    ("adamw-eval-train", "AdamWScheduleFree", {"lr": 0.02, "warmup_steps": 5, "weight_decay": 0.01}, 40),
    ("sgd-default", "SGDScheduleFree", {}, 0),
    (
        "sgd-warmup-decay",
        "SGDScheduleFree",
        {"lr": 0.1, "momentum": 0.95, "weight_decay": 0.01, "warmup_steps": 30, "r": 0.5, "weight_lr_power": 3.0},
        0,
    ),
    ("sgd-eval-train", "SGDScheduleFree", {"lr": 0.3, "momentum": 0.8}, 40),
]


def gradients() -> list[dict[str, list]]:
    """A fixed sequence, 6 significant digits (exact in JSON): oscillating signs, slow drifts, a component that is 0
    for the first steps (a zero second moment) and a tiny one."""
    sequence = []
    for t in range(STEPS):
        w = [
            [math.sin(1.3 * t + 0.4), -0.5 + 0.01 * t, 0.0 if t < 5 else math.cos(0.7 * t)],
            [1e-6 * math.cos(0.2 * t), 2.0 * math.cos(0.9 * t) - 0.3, math.sin(0.05 * t) * (-1) ** t],
        ]
        b = [0.3 * math.sin(2.1 * t), -0.1, math.exp(-0.02 * t) * math.cos(t)]
        sequence.append({"w": [[float(f"{v:.6g}") for v in row] for row in w], "b": [float(f"{v:.6g}") for v in b]})
    return sequence


def _values(params: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: p.tolist() for name, p in params.items()}


def run(cls_name: str, kwargs: dict[str, Any], switch_every: int, grads: list[dict[str, list]]) -> dict[str, Any]:
    params = {name: torch.tensor(v, dtype=torch.float64, requires_grad=True) for name, v in START.items()}
    opt = getattr(schedulefree, cls_name)(list(params.values()), **kwargs)
    opt.train()
    ys, xs = [], []
    for t, g in enumerate(grads, start=1):
        for name, p in params.items():
            p.grad = torch.tensor(g[name], dtype=torch.float64)
        opt.step()
        if t in CHECKPOINTS:
            twin_params, twin = copy.deepcopy((params, opt))
            twin.eval()
            ys.append(_values({n: p.detach() for n, p in params.items()}))
            xs.append(_values({n: p.detach() for n, p in twin_params.items()}))
        if switch_every and t % switch_every == 0:
            opt.eval()
            opt.train()
    return {"y": ys, "x": xs}


def main() -> None:
    torch.set_default_dtype(torch.float64)
    grads = gradients()
    cases = [
        {"name": name, "class": cls, "kwargs": kwargs, "switch_every": every, **run(cls, kwargs, every, grads)}
        for name, cls, kwargs, every in CASES
    ]
    out = {
        "schedulefree_version": version("schedulefree"),
        "torch_version": torch.__version__,
        "steps": STEPS,
        "checkpoints": CHECKPOINTS,
        "start": START,
        "grads": grads,
        "cases": cases,
    }
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "schedulefree.json"
    head = {key: out[key] for key in ("schedulefree_version", "torch_version", "steps", "checkpoints", "start")}
    lines = [json.dumps(head)[:-1] + ","]
    lines.append(' "grads": [' + ",\n  ".join(json.dumps(g) for g in grads) + "],")
    lines.append(' "cases": [\n  ' + ",\n  ".join(json.dumps(case) for case in cases) + "\n ]}")
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(cases)} cases to {target} (schedulefree {out['schedulefree_version']})")


if __name__ == "__main__":
    main()
