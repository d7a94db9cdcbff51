"""Paged versions of the torch.optim-compatible aliases: the optimizer state stays in host memory or on disk."""

from __future__ import annotations

import os
from typing import Literal

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam.aliases import adam, adamw
from fadam.paging._wrapper import DEFAULT_CHUNK_BYTES, page_state


def paged_adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    storage: Literal["host", "disk"] = "host",
    path: str | os.PathLike | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    resume: bool = False,
) -> GradientTransformation:
    """``torch.optim.Adam`` with its state paged: ``page_state(adam(...), storage, path, chunk_bytes, per_leaf=True)``.

    Bit-identical to ``fadam.adam``; see ``page_state`` for the storages, chunking and checkpoints. ``fadam.step`` runs
    torch's fused Adam kernel chunk by chunk.

    Example:
        >>> import torch, fadam
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> tx = fadam.paged_adam(lr=0.1)
        >>> params, state = fadam.step(tx, params, {"w": torch.tensor([0.5, -0.5])}, tx.init(params))
        >>> params["w"]
        tensor([ 0.9000, -0.9000])
    """
    inner = adam(lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
    return page_state(inner, storage, path, chunk_bytes, per_leaf=True, resume=resume)


def paged_adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    storage: Literal["host", "disk"] = "host",
    path: str | os.PathLike | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    resume: bool = False,
) -> GradientTransformation:
    """``torch.optim.AdamW`` with its state paged: ``page_state(adamw(...), ..., per_leaf=True)``.

    Example:
        >>> import torch, fadam
        >>> params = {"w": torch.tensor([2.0])}
        >>> tx = fadam.paged_adamw(lr=0.1, weight_decay=0.5)
        >>> params, state = fadam.step(tx, params, {"w": torch.tensor([1.0])}, tx.init(params))
        >>> params["w"]
        tensor([1.8000])
    """
    inner = adamw(lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
    return page_state(inner, storage, path, chunk_bytes, per_leaf=True, resume=resume)
