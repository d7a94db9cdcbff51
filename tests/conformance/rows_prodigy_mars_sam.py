"""Rows for Prodigy, MARS and SAM. Reference "equations": Prodigy is checked against prodigyopt's float64
trajectories, MARS against the paper's equations and SAM against optax's trajectories and the paper's two-step update
in tests/test_prodigy_mars_lookahead.py. (Lookahead's params are a ``LookaheadParams`` pair, which the battery's
trees are not: it is checked there only.)"""

from __future__ import annotations

import fadam
from tests.conformance.table import Row


def sam_sgd(lr: float = 1e-2, rho: float = 0.05, sync_period: int = 2) -> fadam.GradientTransformation:
    """The paper's SAM: normalized SGD ascent of ``rho``, then SGD from where it started."""
    return fadam.sam(fadam.sgd(lr), fadam.chain(fadam.normalize(), fadam.sgd(rho)), sync_period=sync_period)


# one row each (the battery's compile checks cost seconds a row); their variants are covered in that test file
ROWS: list[Row] = [
    # d0 above the default 1e-6, whose first steps are below a bfloat16 param's resolution
    Row(
        "prodigy-decay-bias-safeguard",
        fadam.prodigy,
        {"weight_decay": 1e-3, "use_bias_correction": True, "safeguard_warmup": True, "d0": 1e-3},
        reference="equations",
    ),
    # MARS on every leaf: the alias's default split (AdamW for the vectors) is a partition, which other rows check
    Row("mars-all-leaves", fadam.mars, {"lr": 1e-2, "weight_decay": 1e-3, "optimize_1d": True}, reference="equations"),
    # half the steps are adversarial: on Rosenbrock the outer SGD needs twice the rate, and a smaller ascent
    Row("sam-sgd", sam_sgd, {"lr": 1e-2}, reference="equations", converge_kwargs={"lr": 2e-2, "rho": 1e-3}),
]
