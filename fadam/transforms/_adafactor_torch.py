"""torch.optim.Adafactor's step: ``scale_by_adafactor_torch`` (``fadam.scale_by_factored_rms`` is optax's)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._execute import run_update
from fadam._numerics import for_leaf, host_number
from fadam._program import Elementwise, Program, Spread, Stage, Statistic, elementwise, with_program
from fadam._tree import PyTree
from fadam.transforms._validation import UnsupportedParamsError


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


def _averaging_weight(count: torch.Tensor, beta2_decay: float) -> Any:
    """``t ** beta2_decay`` for the step after ``count`` (``t`` counted from 1): a Python double for a count on the
    host, as torch computes it, else a 0-d float64 tensor."""
    n = host_number(count)
    if isinstance(n, int):
        return (n + 1) ** beta2_decay
    return (count.to(torch.float64) + 1) ** beta2_decay


def _relative_step(lr: Any, count: torch.Tensor) -> Any:
    """``min(lr, t ** -0.5)`` for the step after ``count``, as ``_averaging_weight``."""
    n = host_number(count)
    if isinstance(n, int) and not isinstance(lr, torch.Tensor):
        return min(lr, 1 / ((n + 1) ** 0.5))
    t = count.to(torch.float64) + 1
    return torch.minimum(torch.as_tensor(lr, dtype=torch.float64), 1 / t**0.5)


def _rms(x: torch.Tensor, d: float = 1.0) -> torch.Tensor:
    """``||x|| / (sqrt(numel) d)`` in float64: torch's ``x.norm(2).item() / (x.numel() ** 0.5 * d)`` (one division,
    as torch rounds it), without reading the norm on the host."""
    return torch.linalg.vector_norm(x).to(torch.float64) / (x.numel() ** 0.5 * d)


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: Any) -> torch.Tensor:
    """``start.lerp_(end, weight)`` in ``start``'s dtype, which a stored format may make other than the gradient's
    (a 0-d float64 weight cast as torch casts a number weight)."""
    weight = weight.to(start.dtype) if isinstance(weight, torch.Tensor) else weight
    return torch.lerp(start, end.to(start.dtype), weight)


def _moment_values(
    g: torch.Tensor, row: torch.Tensor, col: torch.Tensor, var: torch.Tensor, weight: Any, eps1: float
) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The new statistics of ``g``'s leaf, in torch.optim.Adafactor's order of operations, and the body's values:
    its variance estimate is ``row * col / mean`` (torch's ``row @ col``, a product of one term per element, then its
    division by the rows' mean), which for a leaf of fewer than 2 dims is its full variance times 1 over 1."""
    if g.dim() > 1:
        row = _lerp(row, torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.size(-1), weight)
        col = _lerp(col, torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / g.size(-2), weight)
        mean = row.mean(dim=-2, keepdim=True).clamp(min=eps1)
        dims = g.dim()
        values = {
            "row": Spread(row.squeeze(-1), dims - 1),
            "col": Spread(col.squeeze(-2), dims - 2),
            "mean": Spread(mean.reshape(mean.shape[:-2]), dims - 2, span=2),
        }
    else:
        var = _lerp(var, g * g, weight)
        one = torch.ones((), dtype=var.dtype, device=var.device)
        values = {"row": Spread(var), "col": Spread(one), "mean": Spread(one)}
    return values | {"floor": eps1 * eps1}, (row, col, var)


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

    def moment_prologue(count: torch.Tensor) -> dict[str, Any]:
        return {"weight": _averaging_weight(count, beta2_decay)}

    def reduce_moment(
        scalars: dict[str, Any], g: torch.Tensor, p: torch.Tensor | None, row: Any, col: Any, var: Any
    ) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
        eps1 = torch.finfo(g.dtype).eps if eps[0] is None else eps[0]
        return _moment_values(g, row, col, var, for_leaf(scalars["weight"], g), eps1)

    def moment_body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (o.rsqrt(o.clamp(s.row * s.col / s.mean, s.floor, math.inf)) * g,)

    def step_prologue(count: torch.Tensor) -> dict[str, Any]:
        before = count - 1  # the count before the moment's stage advanced it
        return {"rho": _relative_step(lr(before) if callable(lr) else lr, before)}

    def reduce_step(
        scalars: dict[str, Any], u: torch.Tensor, p: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], tuple[()]]:
        alpha = torch.clamp(_rms(p), min=eps[1]) * for_leaf(scalars["rho"], u)
        denom = torch.clamp(_rms(u, d), min=1.0)
        return {"step": (-alpha / denom).to(u.dtype)}, ()  # one rounding, as torch's scalar ``alpha``

    def step_body(o: Any, s: Any, u: Any, p: Any) -> tuple:
        return (u * s.step,)

    def statistic(part: str) -> Statistic:
        return Statistic(part, lambda p: _stat(p, part))

    moment = Elementwise(
        "scale_by_adafactor_torch",
        ScaleByAdafactorTorchState,
        (),
        True,
        moment_prologue,
        moment_body,
        statistics=tuple(statistic(part) for part in ("row_var", "col_var", "variance")),
        reduce_statistics=reduce_moment,
        sparse="scale_by_adafactor_torch takes dense updates only",
    )
    # the relative step and the RMS clip need the whole scaled update: a second stage, on the same state
    step = Elementwise(
        "scale_by_adafactor_torch's relative step",
        ScaleByAdafactorTorchState,
        (),
        False,
        step_prologue,
        step_body,
        uses_params=True,
        reduce_statistics=reduce_step,
        sparse="scale_by_adafactor_torch takes dense updates only",
        shares_count=True,
    )
    moment_tx, step_tx = elementwise(moment), elementwise(step)
    program = Program((Stage(moment, ()), Stage(step, ())))

    def update(
        updates: PyTree, state: ScaleByAdafactorTorchState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByAdafactorTorchState]:
        if params is None:
            raise ValueError("scale_by_adafactor_torch needs params: call update(updates, state, params)")
        compiled = run_update(program, updates, state, params)
        if compiled is not None:
            return compiled
        scaled, state = moment_tx.update(updates, state, params)
        return step_tx.update(scaled, state, params)

    return with_program(moment.init, update, program)
