"""Rows for SOAP, Shampoo and PSGD Kron. Reference "equations": SOAP is checked against the official algorithm
written out and against heavyball's trajectories, Shampoo against its documented update (tests/test_soap_shampoo.py),
PSGD Kron against kron_torch's equations written out and its trajectories (tests/test_psgd_kron.py).

The SOAP and Shampoo rows precondition vectors too, refresh every 2 steps, and keep dims above 4 unpreconditioned:
the models of tests/test_func.py and tests/test_ensembles.py compare ensemble members whose gradients differ by
rounding, and statistics of low rank (a dim much larger than the gradients seen so far) leave the basis of their
degenerate eigenspace to that rounding (SOAP) or scale it by the inverse root of ``epsilon`` (Shampoo: members
2e-7 apart after tests/test_func.py's 5 steps with every dim preconditioned). PSGD Kron reads its step's decisions
on the host and draws outside the graph: torch.compile traces it with one graph break per step. All three take
DTensor (FSDP2) params, their state replicated (tests/fsdp_worker.py)."""

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
    ),
    Row(
        "shampoo-adam-grafting",
        fadam.shampoo,
        {
            "learning_rate": 1e-2,
            "betas": (0.9, 0.99),
            "grafting": "adam",
            "precondition_frequency": 2,
            "max_preconditioner_dim": 4,
            "precondition_1d": True,
        },
        reference="equations",
        complex_params=False,
    ),
    Row(
        "psgd-kron",
        fadam.psgd_kron,
        {"learning_rate": 1e-2},
        reference="equations",
        complex_params=False,
        graph_breaks="a step reads its count and update decision on the host and draws from torch.Generators, "
        "outside the graph (one break per step)",
    ),
]
