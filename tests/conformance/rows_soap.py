"""A row for SOAP. Reference "equations": SOAP is checked against the official algorithm written out and against
heavyball's trajectories, Shampoo (not a row: the battery's fixed cost is a few seconds per row, and
tests/test_soap_shampoo.py compiles it) against its documented update, in tests/test_soap_shampoo.py.

The row preconditions vectors too, refreshes the eigenbases every 2 steps, and keeps dims above 4 unpreconditioned:
the models of tests/test_func.py and tests/test_ensembles.py compare ensemble members whose gradients differ by
rounding, and statistics of low rank (a dim much larger than the gradients seen so far) leave the basis of their
degenerate eigenspace to that rounding. DTensor params are refused (``sharded=False``)."""

from __future__ import annotations

import fadam
from tests.conformance.table import Row

ROWS: list[Row] = [
    Row(
        "soap-vectors",
        fadam.soap,
        {"learning_rate": 1e-2, "precondition_frequency": 2, "max_precond_dim": 4, "precondition_1d": True},
        reference="equations",
        complex_params=False,
        sharded=False,
    ),
]
