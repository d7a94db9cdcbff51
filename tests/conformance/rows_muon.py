"""Rows for Muon. The battery's trees and problems hold vectors and 0-d params, which torch.optim.Muon refuses, so
the rows run ``muon_with_adamw`` (Muon on the 2-D leaves, AdamW on the others) against ``TorchMuonWithAdamW``: the
same split over torch.optim.Muon and torch.optim.AdamW. ``fadam.muon`` alone (2-D params only) is checked against
torch.optim.Muon in tests/test_muon.py."""

from __future__ import annotations

from collections.abc import Iterable

import torch

import fadam
from tests.conformance.table import Row


class TorchMuonWithAdamW:
    """torch.optim.Muon on the real 2-D params and torch.optim.AdamW on the others, stepped together: the reference
    for ``fadam.muon_with_adamw`` without ``adamw_for``; it takes that function's arguments."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        foreach: bool | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        **muon_kwargs: object,
    ) -> None:
        params = list(params)
        matrices = [p for p in params if p.dim() == 2 and not p.is_complex()]
        others = [p for p in params if not (p.dim() == 2 and not p.is_complex())]
        self.muon = torch.optim.Muon(matrices, **muon_kwargs)
        self.adamw = torch.optim.AdamW(others, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, foreach=foreach)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


ROWS: list[Row] = [
    Row("muon-with-adamw", fadam.muon_with_adamw, {"lr": 0.02, "adamw_lr": 1e-2}, TorchMuonWithAdamW),
    Row(
        "muon-with-adamw-moonlight",
        fadam.muon_with_adamw,
        {
            "lr": 1e-2,
            "weight_decay": 0.05,
            "momentum": 0.9,
            "nesterov": False,
            "adjust_lr_fn": "match_rms_adamw",
            "adamw_lr": 1e-2,
            "adamw_betas": (0.9, 0.95),
            "adamw_weight_decay": 0.05,
        },
        TorchMuonWithAdamW,
    ),
]
