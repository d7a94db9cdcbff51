"""Rows for the paged aliases: the state lives in host memory or in a temporary file, results as torch.optim."""

from __future__ import annotations

from functools import partial

import torch

import fadam
from tests.conformance.table import Row

ROWS = [
    Row(
        "paged_adam",
        partial(fadam.paged_adam, chunk_bytes=4096),
        {"lr": 1e-2},
        torch.optim.Adam,
        value_state=False,
    ),
    Row(
        "paged_adamw-disk-amsgrad",
        partial(fadam.paged_adamw, storage="disk", chunk_bytes=4096),
        {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1},
        torch.optim.AdamW,
        value_state=False,
    ),
]
