"""Rows for LARS and Adan. Reference "equations": each is checked against optax's float64 trajectories in
tests/test_optax_catalogue.py, with the other optimizers of optax's catalogue (NovoGrad, SM3, Fromage ...), which have
no row: a row costs about 10 s of CPU in the battery (its compile checks), measured on the 2-core test machine."""

from __future__ import annotations

import fadam
from tests.conformance.table import Row

# one row each (the battery's compile checks cost seconds a row); their variants are covered in that test file
ROWS: list[Row] = [
    # LARS's default trust coefficient (1e-3) makes steps of 1e-3 of a param's norm: a larger one converges in the
    # battery's step budget
    Row(
        "lars-nesterov",
        fadam.lars,
        {"learning_rate": 1e-2, "weight_decay": 1e-3, "trust_coefficient": 0.1, "nesterov": True},
        reference="equations",
    ),
    Row("adan-decay", fadam.adan, {"learning_rate": 1e-2, "weight_decay": 1e-3}, reference="equations"),
]
