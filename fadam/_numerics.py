"""Small numeric helpers shared by stateful transforms: step counters, bias corrections, a twice-differentiable sqrt."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch

from fadam._dispatch import functorch_wrapped

_INT32_MAX = torch.iinfo(torch.int32).max
_CPU = torch.device("cpu")
_resident: ContextVar[bool] = ContextVar("fadam_resident", default=False)


@contextlib.contextmanager
def resident() -> Iterator[None]:
    """Inside the block, a step reads nothing on the host: every count, and every scalar computed from one, stays a
    tensor where it lives, as it does on an accelerator (``fadam.capturable`` runs its steps so). On the CPU this is
    what makes such a step testable: its counts are CPU tensors, which ``host_number`` would otherwise read.
    """
    token = _resident.set(True)
    try:
        yield
    finally:
        _resident.reset(token)


def is_resident() -> bool:
    """Whether the current step keeps its scalars as tensors (``resident``)."""
    return _resident.get()


def zero_count() -> torch.Tensor:
    """A fresh step counter: a 0-d int32 tensor on torch's default device, the CPU.

    It lives on the CPU, as torch.optim's step does on its default path: a 0-d CPU tensor mixes with tensors on any
    device without a host-device copy, and bias corrections computed from it cost no kernel launch on an accelerator.
    ``fadam.capturable`` makes it on the params' device instead (their device as the default one), as torch.optim's
    capturable mode does.
    """
    return torch.zeros([], dtype=torch.int32)


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1`` that saturates at the int32 maximum instead of wrapping (optax's convention)."""
    value = host_number(count)
    if not isinstance(value, torch.Tensor):  # a plain CPU count: a new 0-d tensor, half the cost of ``count + 1``
        return torch.full((), value + 1, dtype=count.dtype, device=_CPU) if value < _INT32_MAX else count
    return torch.where(count < _INT32_MAX, count + 1, count)


def is_first_step(count: torch.Tensor) -> bool | torch.Tensor:
    """``count == 0``: a Python bool for a plain CPU count (``host_number``: read once, no comparison op), else a 0-d
    bool tensor (a count that is traced, batched or resident)."""
    value = host_number(count)
    return count == 0 if isinstance(value, torch.Tensor) else value == 0


def bias_correction(decay: float | torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``1 - decay ** count`` in float64, matching torch.optim, which computes it with Python floats (doubles)."""
    number = bias_correction_number(decay, count)
    if number is not None:
        return torch.full((), number, dtype=torch.float64, device=_CPU)  # one op where the tensor formula takes three
    exponent = count.to(torch.float64)
    if isinstance(decay, torch.Tensor):
        return 1 - decay.to(torch.float64) ** exponent
    return 1 - torch.pow(decay, exponent)


def bias_correction_number(decay: float | torch.Tensor, count: torch.Tensor) -> float | None:
    """``1 - decay ** count`` as torch.optim computes it, with Python floats, where ``decay`` is a number and
    ``count`` a plain CPU count (``host_number``); ``None`` otherwise. C's ``pow``, as ``torch.pow`` of a 0-d tensor
    (tests/test_numerics.py compares them)."""
    if isinstance(decay, torch.Tensor):
        return None
    value = host_number(count)
    if isinstance(value, torch.Tensor):
        return None
    try:
        return 1.0 - float(decay) ** value
    except OverflowError:  # |decay| > 1: torch.pow's inf instead
        return None


def device_vector(values: Sequence[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """``values`` (scalars of a step: numbers and 0-d tensors) as a 1-d float64 tensor on ``device``, built by torch
    ops there: each tensor converted on the device, each number written by a fill. Nothing is read on the host and
    nothing is copied from host memory, so a CUDA graph that captures it replays it."""
    parts = [
        value.detach().to(device, torch.float64).reshape(1)
        if isinstance(value, torch.Tensor)
        else torch.full((1,), value, dtype=torch.float64, device=device)
        for value in values
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)


def dtype_for(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype | None:
    """``dtype``'s precision for ``tensor`` (``None``: keep the tensor's): a complex tensor stays complex.

    Used for state dtypes (``mu_dtype``, ``accumulator_dtype``) and casts: a real dtype applied to a complex param
    (``float64`` -> ``complex128``) would otherwise silently drop the imaginary part.
    """
    if dtype is None or not tensor.is_complex() or dtype.is_complex:
        return dtype
    return dtype.to_complex()


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` whose derivatives of every order are finite at 0 (they are 0 there); equal to ``torch.sqrt``.

    ``d sqrt(x)/dx = 1 / (2 sqrt(x))`` is infinite at 0, and autograd multiplies it by the zero derivative of the
    argument (Adam's ``v`` where the gradient is exactly zero), giving NaN meta-gradients. Where ``x == 0`` the inner
    ``where`` takes the square root of 1 instead and the outer one returns ``x * 0`` (0 with ``x``'s sign, as the
    IEEE root of -0 is -0), so no infinity is ever formed; NaN and negative inputs give NaN as ``torch.sqrt`` does.
    The two ``where`` cost about 10% of a small meta-learning step, so a CPU tensor with no zero (checked with one
    reduction, free of host syncs on the CPU) takes ``torch.sqrt`` directly: same values and same derivatives.

    Example:
        >>> import torch
        >>> from fadam._numerics import safe_sqrt
        >>> v = torch.tensor([0.0, 4.0], requires_grad=True)
        >>> torch.autograd.grad(safe_sqrt(v).sum(), v)[0]
        tensor([0.0000, 0.2500])
    """
    if no_zero_on_cpu(x):
        return torch.sqrt(x)
    zero = x == 0
    return torch.where(zero, x * 0.0, torch.sqrt(torch.where(zero, 1.0, x)))


def no_zero_on_cpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is a plain CPU tensor (not traced, vmapped or compiled) whose elements are all > 0."""
    if type(x) is not torch.Tensor or x.device.type != "cpu" or not x.numel():
        return False
    if functorch_wrapped(x):  # always while torch.compile traces
        return False  # data-dependent control flow is not allowed there
    if _resident.get():  # a capturable step reads nothing back, not even a CPU tensor
        return False
    return torch.amin(x.detach()).item() > 0  # NaN or a negative value also take the general path


def host_number(value: float | torch.Tensor | None) -> float | torch.Tensor | None:
    """``value`` as a Python float when it is a plain 0-d CPU tensor outside autograd, ``vmap`` and compilation.

    Bias corrections are computed from the step count as 0-d float64 tensors. Mixed into a param-shaped tensor they
    round to the param's dtype exactly as the same number passed as a Python float does, but each use costs an extra
    dtype conversion inside the op, which is a large share of a small tensor's update (meta-learning's inner loops).
    Reading a CPU tensor is not a device sync. A traced, batched or differentiable value is returned as it is, and so
    is every value in a ``resident`` step.
    """
    if (
        torch.compiler.is_compiling()  # first: the tracer must not see the checks below
        or type(value) is not torch.Tensor
        or _resident.get()
        or value.dim()
        or value.device.type != "cpu"
        or value.requires_grad
        or functorch_wrapped(value)
    ):
        return value
    return value.item()


def for_leaf(value: float | torch.Tensor, leaf: torch.Tensor) -> float | torch.Tensor:
    """``value``, derived from a step count (a bias correction, a scheduled rate), in a form that mixes with ``leaf``.

    A 0-d CPU tensor combines with tensors on any device, which is why step counts live on the CPU. Under
    ``torch.func.vmap`` a per-member count is a CPU tensor with a hidden batch dimension, which does not combine with
    an accelerator's tensors, so it is copied to the leaf's device (a few bytes; no host sync for a host-to-device
    copy). Anything else is returned as it is.
    """
    if isinstance(value, torch.Tensor) and value.device != leaf.device and functorch_wrapped(value):
        return value.to(leaf.device, non_blocking=leaf.device.type != "cpu")
    return value
