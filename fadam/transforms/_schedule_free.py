"""Schedule-Free learning: ``schedule_free`` (any base optimizer), ``schedule_free_sgd``, ``schedule_free_adamw`` and
``schedule_free_eval_params``, following the ``schedulefree`` package's ``SGDScheduleFree`` and
``AdamWScheduleFree`` in train mode.

Three sequences: ``z`` takes the base optimizer's steps, ``x`` is their weighted average (the point to evaluate) and
the params are ``y = b1 x + (1 - b1) z``, where the gradients are taken. Only ``z`` is stored (the state's ``z``);
``x`` follows from ``y`` and ``z``. The step moves ``y`` in a way that is not a step of the base optimizer, so the
transform returns it as an update, ``u = y_{t+1} - y_t``, which ``apply_updates`` (or ``fadam.step``) adds to the
params, as optax's ``schedule_free`` does. The update is therefore only meaningful added to the params it was
computed at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._numerics import bias_correction, host_number, safe_increment, zero_count
from fadam._program import Carried, Elementwise, Slot, elementwise
from fadam._tree import PyTree, check_params, tree_map
from fadam.combinators._chain import chain
from fadam.transforms._decay import add_decayed_weights
from fadam.transforms._scaling import scale_by_learning_rate
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScheduleFreeState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (schedulefree's ``k``)
    b1: torch.Tensor  # 0-d float64: the interpolation b1, kept for schedule_free_eval_params (as optax keeps it)
    weight_sum: torch.Tensor  # 0-d float64: the sum of the averaging weights so far
    lr_max: torch.Tensor  # 0-d float64: the largest learning rate so far (-1 before the first step, as schedulefree)
    z: PyTree  # the base optimizer's sequence


class ScaleBySecondMomentState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    nu: PyTree  # second moment (schedulefree's ``exp_avg_sq``)


def _float64(value: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64)


def _scale_by_schedule_free(
    learning_rate: ScalarOrSchedule, b1: float, weight_lr_power: float, r: float
) -> GradientTransformation:
    """The schedule-free interpolation after a base optimizer whose update ``d`` is its step of ``z``: with
    :math:`c` the averaging weight of this step, ``z' = z + d`` and ``y' = lerp(y, z, c) + (1 - b1 (1 - c)) d``."""

    def init(params: PyTree) -> ScheduleFreeState:
        check_params(params)
        z = tree_map(lambda p: None if p is None else p.clone(), params)  # z starts at the params, as x and y do
        return ScheduleFreeState(zero_count(), *(c.init() for c in carried), z)

    def prologue(
        count: torch.Tensor, b1_state: torch.Tensor, weight_sum: torch.Tensor, lr_max: torch.Tensor
    ) -> dict[str, Any]:
        rate = learning_rate(count) if callable(learning_rate) else learning_rate
        lr_max = torch.maximum(lr_max, _float64(rate))
        weight = safe_increment(count).to(torch.float64) ** r * lr_max**weight_lr_power
        weight_sum = weight_sum + weight
        # no weight yet (a learning rate of 0 so far): schedulefree's ZeroDivisionError branch, c = 0
        ck = weight / torch.where(weight_sum > 0, weight_sum, 1.0)
        return {
            "ck": host_number(ck),
            "y_coef": host_number(1 - b1 * (1 - ck)),
            "b1": b1_state,
            "weight_sum": weight_sum,
            "lr_max": lr_max,
        }

    def body(o: Any, s: Any, d: Any, p: Any, z: Any) -> tuple:
        d = o.cast(d, z)
        y = o.add_scaled(o.lerp(p, z, s.ck), d, s.y_coef)  # the old z: schedulefree lerps before its z step
        return y - p, z + d

    carried = (
        Carried("b1", lambda: _float64(b1)),
        Carried("weight_sum", lambda: _float64(0.0)),
        Carried("lr_max", lambda: _float64(-1.0)),
    )
    decl = Elementwise(
        "schedule_free", ScheduleFreeState, (Slot("z"),), True, prologue, body, uses_params=True, carried=carried
    )
    return GradientTransformation(init, elementwise(decl).update)


def _scale_by_second_moment(b2: float, eps: float) -> GradientTransformation:
    """``g / (sqrt(v_t / (1 - b2^t)) + eps)``: Adam without a first moment, schedulefree's order of operations."""

    def prologue(count: torch.Tensor) -> dict[str, Any]:
        bc2 = host_number(bias_correction(b2, safe_increment(count)))
        return {"b2": b2, "one_minus_b2": 1 - b2, "eps": eps, "bc2": bc2}

    def body(o: Any, s: Any, g: Any, p: Any, nu: Any) -> tuple:
        g = o.cast(g, nu)
        nu = o.addcmul(nu * s.b2, g, g, s.one_minus_b2)
        return g / (o.sqrt(nu / s.bc2) + s.eps), nu

    slots = (Slot("nu", nonnegative=True),)
    return elementwise(Elementwise("scale_by_second_moment", ScaleBySecondMomentState, slots, True, prologue, body))


def _warmed_up(learning_rate: ScalarOrSchedule, warmup_steps: int) -> ScalarOrSchedule:
    """``learning_rate`` times schedulefree's linear warmup, ``min(1, (k + 1) / warmup_steps)`` at the ``k`` steps
    taken (the first step already has a nonzero rate)."""
    if warmup_steps == 0:
        return learning_rate

    def schedule(count: torch.Tensor) -> float | torch.Tensor:
        rate = learning_rate(count) if callable(learning_rate) else learning_rate
        steps = host_number(count)
        if isinstance(steps, int):
            return rate * min(1.0, (steps + 1) / warmup_steps)
        return rate * torch.clamp((count.to(torch.float64) + 1) / warmup_steps, max=1.0)

    return schedule


def _check(learning_rate: ScalarOrSchedule, b1: float, warmup_steps: int, weight_lr_power: float) -> None:
    if not callable(learning_rate):
        check_non_negative("learning_rate", learning_rate)
    if not 0.0 < b1 < 1.0:  # eval divides by b1; b1 = 1 would leave z out of y
        raise ValueError(f"Invalid b1: {b1} (expected 0 < b1 < 1)")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"Invalid warmup_steps: {warmup_steps} (expected an int >= 0)")
    check_non_negative("weight_lr_power", weight_lr_power)


def schedule_free(
    base_optimizer: GradientTransformation,
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    weight_lr_power: float = 2.0,
    r: float = 0.0,
) -> GradientTransformation:
    r"""Makes ``base_optimizer`` schedule-free: its steps move ``z``, the params are ``y``, evaluate at ``x``.

    .. math::
        \gamma_t^{\max} = \max_{s \le t} \gamma_s,\quad w_t = t^r\, (\gamma_t^{\max})^{p},\quad
        c_t = \frac{w_t}{\sum_{s \le t} w_s},\\
        z_{t+1} = z_t + d_t,\quad x_{t+1} = (1 - c_t)\, x_t + c_t z_{t+1},\quad
        y_{t+1} = \beta_1 x_{t+1} + (1 - \beta_1) z_{t+1}

    where :math:`d_t` is ``base_optimizer``'s update at :math:`y_t` (it includes the learning rate :math:`\gamma_t`,
    which must be the ``learning_rate`` given here) and :math:`p` is ``weight_lr_power``. Computed without
    :math:`x`, as :math:`y_{t+1} = \mathrm{lerp}(y_t, z_t, c_t) + (1 - \beta_1 (1 - c_t))\, d_t`; the update is
    :math:`y_{t+1} - y_t`. The state is ``(base_state, ScheduleFreeState)``, whose ``z`` starts at the params.
    ``schedule_free_eval_params`` gives :math:`x` (``fadam.Optimizer``'s ``eval()`` sets the params to it).

    Args:
        base_optimizer: the transform whose updates step ``z``, learning rate included (``fadam.sgd(lr)``,
            ``fadam.adam(lr, betas=(0.0, 0.999))``...).
        learning_rate: the base optimizer's learning rate (a float, a 0-d tensor or a schedule of the step count),
            which sets the averaging weights.
        b1: the interpolation :math:`\beta_1` between ``x`` and ``z`` (momentum), in (0, 1).
        weight_lr_power: the power :math:`p` of the largest learning rate so far in the weights.
        r: the power of the step in the weights (polynomial averaging; 0 averages uniformly).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.schedule_free(fadam.sgd(0.5), learning_rate=0.5)
        >>> params = [torch.tensor([1.0])]
        >>> updates, state = tx.update([torch.tensor([2.0])], tx.init(params), params)
        >>> updates, state[1].z
        ([tensor([-1.])], [tensor([0.])])

    References:
        Defazio et al., "The Road Less Scheduled", 2024.
    """
    _check(learning_rate, b1, 0, weight_lr_power)
    return chain(base_optimizer, _scale_by_schedule_free(learning_rate, b1, weight_lr_power, r))


def schedule_free_sgd(
    learning_rate: ScalarOrSchedule = 1.0,
    warmup_steps: int = 0,
    b1: float = 0.9,
    weight_decay: float = 0.0,
    weight_lr_power: float = 2.0,
    r: float = 0.0,
) -> GradientTransformation:
    r"""Schedule-Free SGD, as ``schedulefree.SGDScheduleFree`` in train mode (its defaults).

    .. math::
        \gamma_t = \gamma \min\left(1, \tfrac{t}{T_w}\right),\quad
        z_{t+1} = z_t - \gamma_t (g_t + \lambda y_t),\quad
        y_{t+1} = \mathrm{lerp}(y_t, z_t, c_t) - \gamma_t (1 - \beta_1 (1 - c_t)) (g_t + \lambda y_t)

    with :math:`c_t` the averaging weight of ``schedule_free`` and :math:`T_w` ``warmup_steps``. The weight decay is
    taken at :math:`y_t`, the params. ``schedule_free_eval_params`` gives the evaluation point :math:`x`.

    Args:
        learning_rate: :math:`\gamma` (a float, a 0-d tensor or a schedule of the step count).
        warmup_steps: :math:`T_w`, the steps of the linear warmup (0: none).
        b1: the interpolation :math:`\beta_1` (schedulefree's ``momentum``), in (0, 1).
        weight_decay: :math:`\lambda`, added to the gradient times the params.
        weight_lr_power: the power of the largest learning rate so far in the averaging weights.
        r: the power of the step in the averaging weights.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.schedule_free_sgd(learning_rate=0.1)
        >>> params = [torch.tensor([1.0])]
        >>> updates, state = tx.update([torch.tensor([1.0])], tx.init(params), params)
        >>> updates, fadam.schedule_free_eval_params(state, fadam.apply_updates(params, updates))
        ([tensor([-0.1000])], [tensor([0.9000])])

    References:
        Defazio et al., "The Road Less Scheduled", 2024.
    """
    _check(learning_rate, b1, warmup_steps, weight_lr_power)
    check_non_negative("weight_decay", weight_decay)
    rate = _warmed_up(learning_rate, warmup_steps)
    decay = [add_decayed_weights(weight_decay)] if weight_decay else []
    return schedule_free(chain(*decay, scale_by_learning_rate(rate)), rate, b1, weight_lr_power, r)


def schedule_free_adamw(
    learning_rate: ScalarOrSchedule = 0.0025,
    warmup_steps: int = 0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_lr_power: float = 2.0,
    r: float = 0.0,
) -> GradientTransformation:
    r"""Schedule-Free AdamW, as ``schedulefree.AdamWScheduleFree`` in train mode (its defaults).

    .. math::
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2,\quad
        d_t = -\gamma_t \left(\frac{g_t}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon} + \lambda y_t\right)

    is the step of ``z`` (no first moment: ``b1`` is the interpolation), then ``schedule_free``'s
    :math:`y_{t+1} = \mathrm{lerp}(y_t, z_t, c_t) + (1 - \beta_1 (1 - c_t))\, d_t`, with
    :math:`\gamma_t = \gamma \min(1, t / T_w)`. The decay is decoupled from the normalisation and taken at
    :math:`y_t`, the params. ``schedule_free_eval_params`` gives the evaluation point :math:`x`.

    Args:
        learning_rate: :math:`\gamma` (a float, a 0-d tensor or a schedule of the step count).
        warmup_steps: :math:`T_w`, the steps of the linear warmup (0: none).
        b1: the interpolation :math:`\beta_1` (schedulefree's ``betas[0]``), in (0, 1).
        b2: decay of the second moment.
        eps: added to the denominator, outside the square root.
        weight_decay: :math:`\lambda`, decoupled.
        weight_lr_power: the power of the largest learning rate so far in the averaging weights.
        r: the power of the step in the averaging weights.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.schedule_free_adamw(learning_rate=0.1)
        >>> params = [torch.tensor([1.0])]
        >>> updates, state = tx.update([torch.tensor([3.0])], tx.init(params), params)
        >>> updates[0].round(decimals=4), state[1].z[0].round(decimals=4)
        (tensor([-0.1000]), tensor([0.9000]))

    References:
        Defazio et al., "The Road Less Scheduled", 2024.
    """
    _check(learning_rate, b1, warmup_steps, weight_lr_power)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("weight_decay", weight_decay)
    rate = _warmed_up(learning_rate, warmup_steps)
    decay = [add_decayed_weights(weight_decay)] if weight_decay else []
    base = chain(_scale_by_second_moment(b2, eps), *decay, scale_by_learning_rate(rate))
    return schedule_free(base, rate, b1, weight_lr_power, r)


def _schedule_free_states(state: PyTree) -> list[ScheduleFreeState]:
    """Every ``ScheduleFreeState`` in ``state`` (one per schedule-free transform, e.g. per ``partition`` label)."""
    nodes = optree.tree_leaves(state, is_leaf=lambda n: isinstance(n, ScheduleFreeState), none_is_leaf=True)
    return [n for n in nodes if isinstance(n, ScheduleFreeState)]


def is_schedule_free(state: PyTree) -> bool:
    """Whether ``state`` holds the state of a schedule-free transform."""
    return bool(_schedule_free_states(state))


def _interpolated(state: PyTree, params: PyTree, weight: Callable[[Any], Any]) -> PyTree:
    """``lerp(p, z, weight(b1))`` for each leaf with a ``z``, from every schedule-free state in ``state``."""
    found = _schedule_free_states(state)
    if not found:
        raise ValueError("the state holds no ScheduleFreeState: pass the state of a schedule-free transform")
    leaves, spec = optree.tree_flatten(params, none_is_leaf=True)
    for sf in found:
        b1 = host_number(sf.b1)
        w = weight(b1) if isinstance(b1, float) else weight(sf.b1)
        zs = spec.flatten_up_to(sf.z)
        leaves = [
            torch.lerp(p, z, w if isinstance(w, float) else w.to(p.dtype)) if isinstance(z, torch.Tensor) else p
            for p, z in zip(leaves, zs)
        ]
    return spec.unflatten(leaves)


def schedule_free_eval_params(state: PyTree, params: PyTree) -> PyTree:
    r"""The evaluation point ``x`` of a schedule-free transform from its train point ``y`` (the params).

    .. math::
        x = \frac{y - (1 - \beta_1) z}{\beta_1} = \mathrm{lerp}(y, z, 1 - 1/\beta_1)

    rounded as schedulefree's ``eval()`` computes it. Leaves that no schedule-free transform steps are returned as
    they are.

    Args:
        state: the state of ``schedule_free``, ``schedule_free_sgd``, ``schedule_free_adamw``, or any state holding
            one (a chain's, a ``partition``'s).
        params: the params ``y`` that state was stepped with.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.schedule_free_sgd(learning_rate=1.0)
        >>> params = [torch.tensor([2.0])]
        >>> updates, state = tx.update([torch.tensor([1.0])], tx.init(params), params)
        >>> params = fadam.apply_updates(params, updates)
        >>> params, fadam.schedule_free_eval_params(state, params)
        ([tensor([1.])], [tensor([1.])])

    References:
        Defazio et al., "The Road Less Scheduled", 2024.
    """
    return _interpolated(state, params, lambda b1: 1 - 1 / b1)


def schedule_free_train_params(state: PyTree, eval_params: PyTree) -> PyTree:
    r"""The train point ``y`` from the evaluation point ``x``: :math:`y = \mathrm{lerp}(x, z, 1 - \beta_1)`, the
    inverse of ``schedule_free_eval_params`` (up to rounding), as schedulefree's ``train()`` computes it."""
    return _interpolated(state, eval_params, lambda b1: 1 - b1)
