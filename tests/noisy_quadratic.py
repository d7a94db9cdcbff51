"""The problem the matrix optimizers' tests share with their reference scripts (scripts/heavyball_soap_reference.py,
scripts/psgd_kron_reference.py): a noisy quadratic per leaf, in float64."""

from __future__ import annotations

from typing import Any

import torch


def f64(value: Any) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def gradient(name: str, p: torch.Tensor, t: int) -> torch.Tensor:
    """The gradient at ``p`` of leaf ``name``'s quadratic at step ``t``, plus a deterministic noise."""
    index = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
    a = 0.5 + 0.25 * torch.cos(index)
    c = torch.sin(index + len(name))
    return a * (p - c) + 0.5 * torch.sin(1.3 * t + 2.1 * index + len(name))


def start(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
