"""torch.optim.Adafactor's step: ``scale_by_adafactor_torch`` (``fadam.scale_by_factored_rms`` is optax's)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._numerics import for_leaf, host_number, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._validation import UnsupportedParamsError, check_state


class ScaleByAdafactorTorchState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (torch.optim.Adafactor's ``step``)
    row_var: PyTree  # row statistics of leaves with 2 dims or more (a 1-element placeholder for the others)
    col_var: PyTree  # column statistics of those leaves (placeholder for the others)
    variance: PyTree  # full second moment of leaves with fewer than 2 dims (placeholder for the others)


def check_adafactor_torch_args(
    lr: ScalarOrSchedule, beta2_decay: float, eps: tuple[float | None, float], d: float, weight_decay: float
) -> None:
    """torch.optim.Adafactor's checks, with its messages."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not callable(lr) and not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not beta2_decay <= 0.0:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
    if eps[0] is not None and not eps[0] >= 0.0:
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
    if not eps[1] >= 0.0:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
    if not d >= 1.0:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")


def _stat(p: torch.Tensor | None, part: str) -> torch.Tensor | None:
    """The zero statistic ``part`` of leaf ``p``: torch's shapes where it keeps one, a placeholder elsewhere."""
    if p is None:
        return None
    if p.is_complex():
        raise UnsupportedParamsError("Adafactor does not support complex parameters")
    if (p.dim() > 1) == (part == "variance"):
        return p.new_zeros(1)
    shape = list(p.shape)
    if part == "row_var":
        shape[-1] = 1
    elif part == "col_var":
        shape[-2] = 1
    return p.new_zeros(shape)


def _step_numbers(lr: Any, count: torch.Tensor, beta2_decay: float) -> tuple[Any, Any]:
    """The step's averaging weight ``t ** beta2_decay`` and relative step ``min(lr, t ** -0.5)``, ``t`` counted from
    1: Python doubles for a plain count and lr, as torch computes them, else 0-d float64 tensors."""
    n = host_number(count)
    if isinstance(n, int) and not isinstance(lr, torch.Tensor):
        t = n + 1
        return t**beta2_decay, min(lr, 1 / (t**0.5))
    t = count.to(torch.float64) + 1
    return t**beta2_decay, torch.minimum(torch.as_tensor(lr, dtype=torch.float64), 1 / t**0.5)


def _rms(x: torch.Tensor, d: float = 1.0) -> torch.Tensor:
    """``||x|| / (sqrt(numel) d)`` in float64: torch's ``x.norm(2).item() / (x.numel() ** 0.5 * d)`` (one division,
    as torch rounds it), without reading the norm on the host."""
    return torch.linalg.vector_norm(x).to(torch.float64) / (x.numel() ** 0.5 * d)


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: Any) -> torch.Tensor:
    """``start.lerp_(end, weight)``; a 0-d float64 weight in ``start``'s dtype, as torch casts a number weight."""
    return torch.lerp(start, end, weight.to(start.dtype) if isinstance(weight, torch.Tensor) else weight)


def _second_moment(
    g: torch.Tensor, row: torch.Tensor, col: torch.Tensor, var: torch.Tensor, weight: Any, eps1: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The variance estimate of ``g`` and the new statistics, in torch.optim.Adafactor's order of operations."""
    if g.dim() > 1:
        row = _lerp(row, torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.size(-1), weight)
        col = _lerp(col, torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / g.size(-2), weight)
        estimate = (row @ col) / row.mean(dim=-2, keepdim=True).clamp(min=eps1)
        return estimate, row, col, var
    var = _lerp(var, g * g, weight)
    return var, row, col, var


def scale_by_adafactor_torch(
    lr: ScalarOrSchedule = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
) -> GradientTransformation:
    r"""torch.optim.Adafactor's update (weight decay aside): a factored second moment, RMS clipping and a relative
    step. optax's Adafactor is ``fadam.scale_by_factored_rms`` (and ``fadam.adafactor``).

    With :math:`\beta_t = t^{c}` (``beta2_decay`` :math:`c \le 0`), a leaf of two dims or more keeps row and column
    means of :math:`g^2` over its last two dims, any other leaf the full :math:`V`:

    .. math::
        R_t = (1-\beta_t) R_{t-1} + \beta_t \tfrac{1}{m}\textstyle\sum_j g_{ij}^2,\quad
        C_t = (1-\beta_t) C_{t-1} + \beta_t \tfrac{1}{n}\textstyle\sum_i g_{ij}^2,\quad
        \hat V_t = \frac{R_t C_t}{\max(\operatorname{mean}_i R_t, \epsilon_1)}

    .. math::
        U_t = \frac{g_t}{\sqrt{\max(\hat V_t, \epsilon_1^2)}},\quad
        \alpha_t = \max(\epsilon_2, \operatorname{rms}(p_{t-1}))\, \min(\eta, t^{-1/2}),\quad
        u_t = -\frac{\alpha_t}{\max(1, \operatorname{rms}(U_t) / d)}\, U_t

    Args:
        lr: the learning rate :math:`\eta`, an upper bound of the relative step (a float, 0-d tensor or schedule).
        beta2_decay: the exponent :math:`c` of the averaging weight.
        eps: :math:`(\epsilon_1, \epsilon_2)`; ``None`` for :math:`\epsilon_1` takes the param dtype's machine
            epsilon (torch takes the first param's for all).
        d: the clipping threshold :math:`d` of the update's RMS.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_adafactor_torch(lr=0.1)
        >>> params = [torch.full((2,), 2.0)]
        >>> tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)[0]
        [tensor([-0.2000,  0.2000])]

    References:
        Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018.
    """
    check_adafactor_torch_args(lr, beta2_decay, eps, d, 0.0)

    def init(params: PyTree) -> ScaleByAdafactorTorchState:
        check_params(params)
        parts = (tree_map(lambda p, part=part: _stat(p, part), params) for part in ("row_var", "col_var", "variance"))
        return ScaleByAdafactorTorchState(zero_count(), *parts)

    def update(
        updates: PyTree, state: ScaleByAdafactorTorchState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByAdafactorTorchState]:
        if params is None:
            raise ValueError("scale_by_adafactor_torch needs params: call update(updates, state, params)")
        check_state(state, ScaleByAdafactorTorchState, "scale_by_adafactor_torch")
        grads, param_leaves, spec = check_leaves(updates, params)
        stats = [spec.flatten_up_to(x) for x in (state.row_var, state.col_var, state.variance)]
        weight, rho = _step_numbers(lr(state.count) if callable(lr) else lr, state.count, beta2_decay)
        outputs: list[list[Any]] = [[], [], [], []]
        for g, p, row, col, var in zip(grads, param_leaves, *stats):
            if g is None:
                new = (None, row, col, var)
            else:
                eps1 = torch.finfo(p.dtype).eps if eps[0] is None else eps[0]
                estimate, row, col, var = _second_moment(g, row, col, var, for_leaf(weight, g), eps1)
                scaled = estimate.clamp(min=eps1 * eps1).rsqrt() * g
                alpha = torch.clamp(_rms(p), min=eps[1]) * for_leaf(rho, g)
                denom = torch.clamp(_rms(scaled, d), min=1.0)
                new = (scaled * host_number(-alpha / denom), row, col, var)
            for out, value in zip(outputs, new):
                out.append(value)
        new_updates, *new_stats = (spec.unflatten(x) for x in outputs)
        return new_updates, ScaleByAdafactorTorchState(safe_increment(state.count), *new_stats)

    return GradientTransformation(init, update)
