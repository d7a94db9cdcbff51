r"""Schedules: functions ``step -> value`` for learning rates and other hyperparameters, with optax's names,
arguments and values.

A schedule takes the 0-d int32 step tensor a transform keeps in its state (a Python int works too) and returns a
tensor. The step is only ever used in tensor ops (``where``, ``clamp``, ``cos``): no Python branch depends on its value
and nothing is read back to the host, so a schedule runs under ``torch.func.vmap`` (a batch of steps), under
``torch.compile(fullgraph=True)`` without recompiling when the step changes, and on any device.

Values are computed in float64 (an int32 step is exact there, and torch.optim computes learning rates in Python
doubles); a tensor ``init_value`` or ``peak_value`` of another dtype follows torch's promotion rules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from fadam._base import Schedule

__all__ = [
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_onecycle_schedule",
    "linear_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "sgdr_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]

Value = float | torch.Tensor


def _step(count: int | torch.Tensor) -> torch.Tensor:
    """The step as a float64 tensor (exact for every int32 count)."""
    return torch.as_tensor(count).to(torch.float64)


def constant_schedule(value: Value) -> Schedule:
    """A schedule that holds ``value`` at every step.

    Args:
        value: the value (a float or a 0-d tensor).

    Example:
        >>> import torch, fadam
        >>> fadam.constant_schedule(0.5)(torch.tensor(7, dtype=torch.int32))
        tensor(0.5000, dtype=torch.float64)
    """

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        return value + torch.zeros_like(_step(count))

    return schedule


def polynomial_schedule(
    init_value: Value, end_value: Value, power: Value, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    r"""Polynomial transition from ``init_value`` to ``end_value`` over ``transition_steps`` steps.

    .. math::
        v(t) = (I - E)\left(1 - \frac{\min(\max(t - B, 0), T)}{T}\right)^{P} + E

    Args:
        init_value: the value :math:`I` before and at ``transition_begin``.
        end_value: the value :math:`E` from ``transition_begin + transition_steps`` on.
        power: the power :math:`P` of the polynomial.
        transition_steps: the length :math:`T` of the transition; ``<= 0`` gives the constant ``init_value``.
        transition_begin: the step :math:`B` where the transition starts (a negative value counts as 0).

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.polynomial_schedule(1.0, 0.01, power=2, transition_steps=100)
        >>> round(float(schedule(torch.tensor(50))), 6)
        0.2575

    References:
        optax.polynomial_schedule (same arguments and values).
    """
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        elapsed = torch.clamp(_step(count) - transition_begin, 0, transition_steps)
        frac = 1 - elapsed / transition_steps
        return (init_value - end_value) * frac**power + end_value

    return schedule


def linear_schedule(init_value: Value, end_value: Value, transition_steps: int, transition_begin: int = 0) -> Schedule:
    r"""Linear transition from ``init_value`` to ``end_value``: ``polynomial_schedule`` with ``power=1``.

    .. math::
        v(t) = I + \frac{\min(\max(t - B, 0), T)}{T}\,(E - I)

    Args:
        init_value: the value :math:`I` before and at ``transition_begin``.
        end_value: the value :math:`E` from ``transition_begin + transition_steps`` on.
        transition_steps: the length :math:`T` of the transition; ``<= 0`` gives the constant ``init_value``.
        transition_begin: the step :math:`B` where the transition starts.

    Example:
        >>> import torch, fadam
        >>> fadam.linear_schedule(1.0, 0.0, transition_steps=10)(torch.tensor(3))
        tensor(0.7000, dtype=torch.float64)

    References:
        optax.linear_schedule.
    """
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def piecewise_constant_schedule(
    init_value: Value, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    r"""``init_value`` multiplied by every scale whose boundary the step has reached.

    .. math::
        v(t) = I \prod_{i:\ t \ge b_i} s_i

    Args:
        init_value: the value before the first boundary.
        boundaries_and_scales: ``{step: scale}``; the scales must be non-negative.

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.piecewise_constant_schedule(1.0, {100: 0.1, 200: 0.1})
        >>> [round(float(schedule(torch.tensor(t))), 6) for t in (50, 100, 250)]
        [1.0, 0.1, 0.01]

    References:
        optax.piecewise_constant_schedule.
    """
    items = sorted((boundaries_and_scales or {}).items())
    if any(not scale >= 0.0 for _, scale in items):
        raise ValueError(f"piecewise_constant_schedule expects non-negative scales, got {dict(items)}")

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        step = _step(count)
        value = init_value + torch.zeros_like(step)
        for boundary, scale in items:
            passed = step >= boundary
            value = torch.where(passed, value * scale, value)
        return value

    return schedule


def exponential_decay(
    init_value: Value,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Value | None = None,
) -> Schedule:
    r"""Exponential decay: :math:`v(t) = I \cdot r^{(t - B)/T}` from ``transition_begin`` on, ``I`` before.

    With ``staircase`` the exponent is :math:`\lfloor (t-B)/T \rfloor`. ``end_value`` bounds the result: from below
    when ``decay_rate < 1``, from above otherwise.

    Args:
        init_value: the initial value :math:`I`.
        transition_steps: :math:`T`; ``<= 0`` gives the constant ``init_value``.
        decay_rate: :math:`r`; ``0`` gives the constant ``init_value`` (as optax).
        transition_begin: :math:`B`, the step where the decay starts (a negative value counts as 0).
        staircase: decay in discrete steps every ``transition_steps``.
        end_value: the bound the value never passes.

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.exponential_decay(1.0, transition_steps=10, decay_rate=0.5, staircase=True)
        >>> schedule(torch.tensor(25))
        tensor(0.2500, dtype=torch.float64)

    References:
        optax.exponential_decay.
    """
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)
    bound = None if end_value is None else (torch.maximum if decay_rate < 1.0 else torch.minimum)

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        elapsed = _step(count) - transition_begin
        exponent = elapsed / transition_steps
        if staircase:
            exponent = torch.floor(exponent)
        decayed = torch.where(elapsed <= 0, init_value + torch.zeros_like(elapsed), init_value * decay_rate**exponent)
        if bound is not None:
            decayed = bound(decayed, torch.as_tensor(end_value, dtype=decayed.dtype))
        return decayed

    return schedule


def cosine_decay_schedule(init_value: Value, decay_steps: int, alpha: Value = 0.0, exponent: Value = 1.0) -> Schedule:
    r"""Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``, constant afterwards.

    .. math::
        v(t) = I\left((1-\alpha)\left[\tfrac12\left(1 + \cos\tfrac{\pi \min(t, T)}{T}\right)\right]^{p} + \alpha\right)

    Args:
        init_value: the initial value :math:`I`.
        decay_steps: :math:`T`, a positive number of steps.
        alpha: the final value as a fraction of ``init_value``.
        exponent: :math:`p`, sharpens (> 1) or flattens (< 1) the curve.

    Example:
        >>> import torch, fadam
        >>> fadam.cosine_decay_schedule(1.0, decay_steps=100, alpha=0.1)(torch.tensor(50))
        tensor(0.5500, dtype=torch.float64)

    References:
        Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", 2017. optax.cosine_decay_schedule.
    """
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule needs positive decay_steps, got {decay_steps}")

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        step = torch.clamp(_step(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * step / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def piecewise_interpolate_schedule(
    interpolate_type: str, init_value: Value, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    r"""Interpolates, linearly or by a half cosine, between the values ``init_value * prod(scales so far)`` reached at
    each boundary; constant after the last boundary.

    Args:
        interpolate_type: ``"linear"`` or ``"cosine"``.
        init_value: the value at step 0.
        boundaries_and_scales: ``{step: scale}``; the value at ``step`` is the previous one times ``scale``.

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
        >>> [round(float(schedule(torch.tensor(t))), 6) for t in (2, 4, 6, 10)]
        [0.55, 0.1, 0.0505, 0.001]

    References:
        optax.piecewise_interpolate_schedule.
    """
    if interpolate_type not in ("linear", "cosine"):
        raise ValueError(f"interpolate_type must be 'linear' or 'cosine', got {interpolate_type!r}")
    items = sorted((boundaries_and_scales or {}).items())
    if any(not scale >= 0.0 for _, scale in items):
        raise ValueError(f"piecewise_interpolate_schedule expects non-negative scales, got {dict(items)}")
    boundaries = [0] + [boundary for boundary, _ in items]
    scales = [scale for _, scale in items]

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        step = _step(count)
        bounds = torch.tensor(boundaries, dtype=torch.float64, device=step.device)
        values = [init_value + torch.zeros_like(step), *(torch.full_like(step, scale) for scale in scales)]
        values = torch.cumprod(torch.stack(values), 0)
        starts, ends = bounds[:-1], bounds[1:]
        inside = (starts <= step) & (step < ends)
        pct = (step - starts) / torch.clamp(ends - starts, min=1)
        if interpolate_type == "linear":
            interpolated = (values[1:] - values[:-1]) * pct + values[:-1]
        else:
            interpolated = values[1:] + (values[:-1] - values[1:]) / 2.0 * (torch.cos(math.pi * pct) + 1)
        inner = torch.where(inside, interpolated, torch.zeros_like(interpolated)).sum(0)
        return inner + torch.where(step >= bounds[-1], values[-1], torch.zeros_like(values[-1]))

    return schedule


def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: Value,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    r"""One cycle with three linear phases: ``peak/div`` up to ``peak`` (until ``pct_start``), back down to
    ``peak/div`` (until ``pct_final``), then down to ``peak/(div * final_div)`` at ``transition_steps``.

    Args:
        transition_steps: the length of the cycle (positive).
        peak_value: the maximum value.
        pct_start: fraction of the cycle spent rising.
        pct_final: fraction of the cycle at the end of the second phase.
        div_factor: the initial value is ``peak_value / div_factor``.
        final_div_factor: the final value is the initial value divided by this.

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.linear_onecycle_schedule(100, peak_value=1.0)
        >>> round(float(schedule(torch.tensor(30))), 6)
        1.0

    References:
        Smith & Topin, "Super-Convergence", 2017. optax.linear_onecycle_schedule.
    """
    if transition_steps <= 0:
        raise ValueError(f"linear_onecycle_schedule needs positive transition_steps, got {transition_steps}")
    return piecewise_interpolate_schedule(
        "linear",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(pct_final * transition_steps): 1.0 / div_factor,
            transition_steps: 1.0 / final_div_factor,
        },
    )


def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: Value,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    r"""One cycle with half-cosine phases: ``peak/div`` up to ``peak`` (until ``pct_start``), then down to
    ``peak/(div * final_div)`` at ``transition_steps``.

    Args:
        transition_steps: the length of the cycle (positive).
        peak_value: the maximum value.
        pct_start: fraction of the cycle spent rising.
        div_factor: the initial value is ``peak_value / div_factor``.
        final_div_factor: the final value is the initial value divided by this.

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.cosine_onecycle_schedule(100, peak_value=1.0)
        >>> round(float(schedule(torch.tensor(15))), 6)
        0.52

    References:
        Smith & Topin, "Super-Convergence", 2017. optax.cosine_onecycle_schedule.
    """
    if transition_steps <= 0:
        raise ValueError(f"cosine_onecycle_schedule needs positive transition_steps, got {transition_steps}")
    return piecewise_interpolate_schedule(
        "cosine",
        peak_value / div_factor,
        {int(pct_start * transition_steps): div_factor, int(transition_steps): 1.0 / (div_factor * final_div_factor)},
    )


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs ``schedules[0]`` until ``boundaries[0]``, then ``schedules[1]`` counting from 0 again, and so on.

    Args:
        schedules: the schedules, one more than ``boundaries``.
        boundaries: the steps where the next schedule takes over.

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.join_schedules([fadam.constant_schedule(1.0), fadam.linear_schedule(1.0, 0.0, 10)], [5])
        >>> schedule(torch.tensor(8))
        tensor(0.7000, dtype=torch.float64)

    References:
        optax.join_schedules.
    """
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules needs one more schedule than boundaries, got {len(schedules)} and {len(boundaries)}"
        )

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        step = torch.as_tensor(count)
        output = torch.as_tensor(schedules[0](step))
        for boundary, next_schedule in zip(boundaries, schedules[1:]):
            output = torch.where(step < boundary, output, next_schedule(step - boundary))
        return output

    return schedule


def warmup_constant_schedule(init_value: Value, peak_value: Value, warmup_steps: int) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then constant.

    Args:
        init_value: the value at step 0.
        peak_value: the value from ``warmup_steps`` on.
        warmup_steps: the length of the warmup.

    Example:
        >>> import torch, fadam
        >>> fadam.warmup_constant_schedule(0.0, 1.0, warmup_steps=4)(torch.tensor(1))
        tensor(0.2500, dtype=torch.float64)

    References:
        optax.warmup_constant_schedule.
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_cosine_decay_schedule(
    init_value: Value,
    peak_value: Value,
    warmup_steps: int,
    decay_steps: int,
    end_value: Value = 0.0,
    exponent: Value = 1.0,
) -> Schedule:
    r"""Linear warmup to ``peak_value``, then cosine decay to ``end_value`` at ``decay_steps`` (counted from step 0,
    warmup included).

    Args:
        init_value: the value at step 0.
        peak_value: the value at ``warmup_steps``.
        warmup_steps: the length of the warmup.
        decay_steps: the step where the decay ends (includes the warmup, as optax).
        end_value: the value from ``decay_steps`` on.
        exponent: the exponent of the cosine (see ``cosine_decay_schedule``).

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
        >>> [round(float(schedule(torch.tensor(t))), 4) for t in (5, 10, 60, 110)]
        [0.5, 1.0, 0.5, 0.0]

    References:
        Loshchilov & Hutter, "SGDR", 2017. optax.warmup_cosine_decay_schedule.
    """
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent),
        ],
        [warmup_steps],
    )


def warmup_exponential_decay_schedule(
    init_value: Value,
    peak_value: Value,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Value | None = None,
) -> Schedule:
    """Linear warmup to ``peak_value``, then ``exponential_decay`` from it (its steps counted from the warmup's end).

    Args:
        init_value: the value at step 0.
        peak_value: the value at ``warmup_steps``.
        warmup_steps: the length of the warmup.
        transition_steps: see ``exponential_decay``.
        decay_rate: see ``exponential_decay``.
        transition_begin: see ``exponential_decay``.
        staircase: see ``exponential_decay``.
        end_value: see ``exponential_decay``.

    Example:
        >>> import torch, fadam
        >>> schedule = fadam.warmup_exponential_decay_schedule(0.0, 1.0, 10, transition_steps=10, decay_rate=0.5)
        >>> schedule(torch.tensor(20))
        tensor(0.5000, dtype=torch.float64)

    References:
        optax.warmup_exponential_decay_schedule.
    """
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            exponential_decay(peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value),
        ],
        [warmup_steps],
    )


def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    """SGD with warm restarts: ``warmup_cosine_decay_schedule`` cycles joined end to end.

    Args:
        cosine_kwargs: one dict of ``warmup_cosine_decay_schedule`` arguments per cycle; each cycle lasts its
            ``decay_steps``.

    Example:
        >>> import torch, fadam
        >>> cycle = {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 2, "decay_steps": 10}
        >>> schedule = fadam.sgdr_schedule([cycle, cycle])
        >>> [round(float(schedule(torch.tensor(t))), 4) for t in (2, 10, 12)]
        [1.0, 0.0, 1.0]

    References:
        Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", 2017. optax.sgdr_schedule.
    """
    schedules, boundaries, step = [], [], 0
    for kwargs in cosine_kwargs:
        schedules.append(warmup_cosine_decay_schedule(**kwargs))
        step += kwargs["decay_steps"]
        boundaries.append(step)
    return join_schedules(schedules, boundaries[:-1])
