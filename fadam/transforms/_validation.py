"""Argument checks shared by transform factories; messages name the argument and its value, as torch.optim does."""

from __future__ import annotations

import torch

from fadam._dispatch import functorch_wrapped
from fadam._numerics import is_resident


class UnsupportedParamsError(ValueError, RuntimeError):
    """A param a transform cannot step (a complex one for Muon or torch's Adafactor): a ``ValueError``, as fadam
    refuses it when the state is initialized, and a ``RuntimeError``, as torch.optim refuses it at its step."""


def _unread(x: torch.Tensor) -> bool:
    """Whether a tensor hyperparameter is left unchecked: inside vmap/grad or while compiling its value cannot be read
    without a graph break (it is checked outside), and a resident step (``fadam.capturable``) reads nothing on the
    host, as torch.optim's capturable steps do not read a tensor lr (a schedule's value there is not checked)."""
    return functorch_wrapped(x) or is_resident()  # functorch_wrapped: always while torch.compile traces


def _value(x: float | torch.Tensor, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if _unread(x):
            return 0.0
        if x.is_meta:
            raise ValueError(f"{name} is a tensor on the meta device, which holds no value: give a number or a tensor")
        return float(x.detach())
    return float(x)


def known_value(x: float | torch.Tensor, unknown: float, name: str = "a hyperparameter") -> float:
    """The value of a hyperparameter, or ``unknown`` inside ``torch.func`` transforms where it cannot be read."""
    if isinstance(x, torch.Tensor) and _unread(x):
        return unknown
    return _value(x, name)


def check_non_negative(name: str, value: float | torch.Tensor) -> None:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
    if not _value(value, name) >= 0.0:
        raise ValueError(f"Invalid {name}: {value} (expected >= 0)")


def check_unit_interval(name: str, value: float | torch.Tensor) -> None:
    """0 <= value < 1, torch.optim's rule for beta parameters."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
    if not 0.0 <= _value(value, name) < 1.0:
        raise ValueError(f"Invalid {name}: {value} (expected 0 <= {name} < 1)")


def check_state(state: object, expected: type | tuple[type, ...], transform: str) -> None:
    """Refuses a state that another transform made: another optimizer's state would be read as this one's."""
    if not isinstance(state, expected):
        names = " or ".join(t.__name__ for t in expected) if isinstance(expected, tuple) else expected.__name__
        raise ValueError(
            f"{transform} was given a {type(state).__name__} as its state, expected a {names}: "
            "pass the state that this transform's init made"
        )
