"""Argument checks shared by transform factories; messages name the argument and its value, as torch.optim does."""

from __future__ import annotations

import torch

from fadam._dispatch import functorch_wrapped


def _value(x: float | torch.Tensor) -> float:
    if isinstance(x, torch.Tensor):
        # inside vmap/grad or while compiling the value cannot be read without a graph break; it is checked outside
        if functorch_wrapped(x):  # always while torch.compile traces
            return 0.0
        return float(x.detach())
    return float(x)


def known_value(x: float | torch.Tensor, unknown: float) -> float:
    """The value of a hyperparameter, or ``unknown`` inside ``torch.func`` transforms where it cannot be read."""
    if isinstance(x, torch.Tensor) and functorch_wrapped(x):
        return unknown
    return _value(x)


def check_non_negative(name: str, value: float | torch.Tensor) -> None:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
    if not _value(value) >= 0.0:
        raise ValueError(f"Invalid {name}: {value} (expected >= 0)")


def check_unit_interval(name: str, value: float | torch.Tensor) -> None:
    """0 <= value < 1, torch.optim's rule for beta parameters."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
    if not 0.0 <= _value(value) < 1.0:
        raise ValueError(f"Invalid {name}: {value} (expected 0 <= {name} < 1)")
