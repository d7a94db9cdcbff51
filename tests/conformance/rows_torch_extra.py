"""Rows for torch.optim's Adadelta, ASGD, Rprop and Adafactor (``fadam.adafactor_torch``; ``fadam.adafactor`` is
optax's), each checked against its class; their 300-step float64 trajectories in tests/test_torch_aliases.py."""

from __future__ import annotations

import torch

import fadam
from tests.conformance.table import Row

ROWS: list[Row] = [
    Row("adadelta", fadam.adadelta, {"lr": 1.0}, torch.optim.Adadelta),
    Row(
        "adadelta-wd-max",
        fadam.adadelta,
        {"lr": 1.0, "rho": 0.85, "eps": 2e-6, "weight_decay": 1e-3, "maximize": True},
        torch.optim.Adadelta,
    ),
    Row("asgd", fadam.asgd, {"lr": 2e-2}, torch.optim.ASGD),
    # t0 = 5: the averaging (mu < 1) starts on the 7th step, inside every battery run
    Row(
        "asgd-averaging-wd-max",
        fadam.asgd,
        {"lr": 2e-2, "lambd": 1e-3, "alpha": 0.6, "t0": 5.0, "weight_decay": 0.01, "maximize": True},
        torch.optim.ASGD,
    ),
    Row("rprop", fadam.rprop, {"lr": 1e-2}, torch.optim.Rprop),
    Row(
        "rprop-etas-max",
        fadam.rprop,
        {"lr": 5e-2, "etas": (0.3, 1.5), "step_sizes": (1e-4, 1.0), "maximize": True},
        torch.optim.Rprop,
    ),
    # torch's Adafactor refuses complex params; its statistics are not elementwise in the param (no FSDP2 yet)
    Row(
        "adafactor-torch",
        fadam.adafactor_torch,
        {"lr": 3e-2},
        torch.optim.Adafactor,
        complex_params=False,
        sharded=False,
    ),
    Row(
        "adafactor-torch-wd-max",
        fadam.adafactor_torch,
        {"lr": 5e-2, "beta2_decay": -0.5, "eps": (1e-20, 1e-2), "d": 1.5, "weight_decay": 0.05, "maximize": True},
        torch.optim.Adafactor,
        complex_params=False,
        sharded=False,
    ),
]
