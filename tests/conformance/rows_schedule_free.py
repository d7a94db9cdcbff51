"""Rows for Schedule-Free AdamW and SGD. Reference "equations": their float64 trajectories are checked against the
``schedulefree`` package's ``AdamWScheduleFree`` and ``SGDScheduleFree`` (train mode) in tests/test_schedule_free.py,
whose classes need ``train()`` before stepping and do not take the battery's torch.optim arguments."""

from __future__ import annotations

import fadam
from tests.conformance.table import Row

ROWS: list[Row] = [
    Row("schedule-free-adamw", fadam.schedule_free_adamw, {"learning_rate": 1e-2}, reference="equations"),
    Row(
        "schedule-free-adamw-warmup-wd",
        fadam.schedule_free_adamw,
        {"learning_rate": 2e-2, "warmup_steps": 10, "b1": 0.95, "weight_decay": 1e-3, "r": 1.0},
        reference="equations",
    ),
    Row("schedule-free-sgd", fadam.schedule_free_sgd, {"learning_rate": 1e-2}, reference="equations"),
    Row(
        "schedule-free-sgd-warmup-wd",
        fadam.schedule_free_sgd,
        {"learning_rate": 1e-2, "warmup_steps": 5, "weight_decay": 1e-4, "weight_lr_power": 1.0},
        reference="equations",
    ),
]
