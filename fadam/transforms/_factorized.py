"""Adafactor's factored second moment: ``scale_by_factored_rms``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._dispatch import is_dtensor
from fadam._numerics import for_leaf
from fadam._program import Elementwise, Spread, Statistic, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative


class FactoredState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    v_row: PyTree  # row statistics of factored leaves (a 1-element placeholder for the others)
    v_col: PyTree  # column statistics of factored leaves (placeholder for the others)
    v: PyTree  # full second moment of leaves that are not factored (placeholder for factored ones)


def _factored_dims(shape: torch.Size, factored: bool, min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """The two largest dims ``(second, largest)`` to factor over, or ``None`` (optax's rule; ties keep dim order)."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda d: shape[d])
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


def _dtensor_zeros(
    p: torch.Tensor, shape: tuple[int, ...], dims: tuple[int, int] | None, part: str, dtype: torch.dtype
) -> torch.Tensor:
    """Zeros of ``shape`` on a DTensor param's mesh, placed by DTensor's own sharding propagation: a factored
    statistic is the reduction of ``zeros_like(p)`` over the dropped dim (sharded like the remaining dims, replicated
    where a sharded dim was reduced); a placeholder is replicated."""
    from torch.distributed.tensor import DTensor, Replicate

    zeros = torch.zeros_like(p, dtype=dtype)
    if tuple(shape) == tuple(p.shape):
        return zeros
    if dims is None or part == "v":
        local = torch.zeros(shape, dtype=dtype, device=p.to_local().device)
        return DTensor.from_local(local, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    second, largest = dims
    stat = zeros.sum(dim=largest if part == "v_row" else second)
    return stat.redistribute(p.device_mesh, [Replicate() if q.is_partial() else q for q in stat.placements])


def _real_dtype(p: torch.Tensor) -> torch.dtype:
    return p.real.dtype if p.is_complex() else p.dtype


def _mean(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(dim)``; on a DTensor the sum over ``dim`` divided by its global size, which DTensor reduces across
    ranks exactly (its mean of an unevenly sharded dim would average the ranks' local means)."""
    if is_dtensor(x):
        return x.sum(dim=dim, keepdim=keepdim) / x.shape[dim]
    return x.mean(dim=dim, keepdim=keepdim)


def _placed_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor statistic with ``like``'s placements (a reduction over a sharded dim leaves it partial)."""
    if is_dtensor(x) and x.placements != like.placements:
        return x.redistribute(like.device_mesh, like.placements)
    return x


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
) -> GradientTransformation:
    r"""Divides updates by a factored estimate of their root mean square (Adafactor).

    With :math:`\hat\beta_{2,t} = 1 - t^{-c}` (``decay_rate`` :math:`c`, :math:`t` counted from 1) and
    :math:`G_t = g_t^2 + \epsilon_1`, a leaf with two dims of at least ``min_dim_size_to_factor`` keeps row and column
    statistics over its two largest dims :math:`(i, j)`:

    .. math::
        R_t = \hat\beta_{2,t} R_{t-1} + (1-\hat\beta_{2,t}) \operatorname{mean}_j G_t,\quad
        C_t = \hat\beta_{2,t} C_{t-1} + (1-\hat\beta_{2,t}) \operatorname{mean}_i G_t,\quad
        u_t = g_t \Big/ \sqrt{\frac{R_t C_t}{\operatorname{mean}_i R_t}}

    and any other leaf the full :math:`V_t = \hat\beta_{2,t} V_{t-1} + (1-\hat\beta_{2,t}) G_t`,
    :math:`u_t = g_t/\sqrt{V_t}`. Complex leaves use :math:`|g|^2` and keep real statistics. On DTensor params the
    statistics are DTensors on the param's mesh: sharded like the dims they keep, replicated where a sharded dim was
    reduced (its mean is a sum across ranks, divided by the global size).

    Args:
        factored: factor the second moment of matrices (else keep it in full).
        decay_rate: the exponent :math:`c` of the decay schedule.
        step_offset: subtracted from the step count in the schedule (fine-tuning restarts).
        min_dim_size_to_factor: factor only if the second-largest dim has at least this size.
        epsilon: :math:`\epsilon_1`, added to the squared gradient.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_factored_rms(min_dim_size_to_factor=2)
        >>> params = {"w": torch.zeros(2, 3)}
        >>> state = tx.init(params)
        >>> tuple(state.v_row["w"].shape), tuple(state.v_col["w"].shape)
        ((2,), (3,))
        >>> u, state = tx.update({"w": torch.full((2, 3), 5.0)}, state, params)
        >>> u["w"]
        tensor([[1., 1., 1.],
                [1., 1., 1.]])

    References:
        Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018 (Algorithm 4).
    """
    check_non_negative("decay_rate", decay_rate)
    check_non_negative("epsilon", epsilon)

    def statistic(part: str) -> Statistic:
        def init(p: torch.Tensor) -> torch.Tensor:
            dims = _factored_dims(p.shape, factored, min_dim_size_to_factor)
            dtype = _real_dtype(p)
            if dims is None:
                shape = p.shape if part == "v" else (1,)
            else:
                second, largest = dims
                drop = {"v_row": largest, "v_col": second}.get(part)
                shape = (1,) if drop is None else tuple(n for d, n in enumerate(p.shape) if d != drop)
            if is_dtensor(p):
                return _dtensor_zeros(p, shape, dims, part, dtype)
            return torch.zeros(shape, dtype=dtype, device=p.device)

        return Statistic(part, init)

    def prologue(count: torch.Tensor) -> dict[str, torch.Tensor]:
        t = (count - step_offset).to(torch.float64) + 1.0
        return {"decay": 1.0 - torch.pow(t, -decay_rate)}  # a 0-d CPU tensor: mixes with leaves on any device

    def reduce_statistics(
        scalars: dict[str, torch.Tensor], g: torch.Tensor, p: torch.Tensor | None, v_row: Any, v_col: Any, v: Any
    ) -> tuple[dict[str, Spread], tuple[torch.Tensor, ...]]:
        # a new tensor, so the epsilon goes in in place (autograd saved g, not the square)
        grad_sqr = (g.abs() ** 2 if g.is_complex() else g * g).to(v.dtype).add_(epsilon)
        decay = for_leaf(scalars["decay"], g).to(v.dtype)  # same dtype: a 0-d leaf must not be promoted to float64
        dims = _factored_dims(g.shape, factored, min_dim_size_to_factor)
        if dims is None:
            v = decay * v + (1 - decay) * grad_sqr
            one = torch.ones((), dtype=v.dtype, device=v.device)
            return {"row": Spread(torch.rsqrt(v)), "col": Spread(one)}, (v_row, v_col, v)
        second, largest = dims
        v_row = _placed_like(decay * v_row + (1 - decay) * _mean(grad_sqr, largest), v_row)
        v_col = _placed_like(decay * v_col + (1 - decay) * _mean(grad_sqr, second), v_col)
        row_dim = second - 1 if second > largest else second  # ``second`` in v_row, whose ``largest`` is gone
        row_factor = torch.rsqrt(v_row / _mean(v_row, row_dim, keepdim=True))
        return {"row": Spread(row_factor, largest), "col": Spread(torch.rsqrt(v_col), second)}, (v_row, v_col, v)

    def body(o: Any, s: Any, u: Any, p: Any) -> tuple:
        return (u * o.cast(s.row * s.col, u),)

    decl = Elementwise(
        "scale_by_factored_rms",
        FactoredState,
        (),
        True,
        prologue,
        body,
        statistics=tuple(statistic(part) for part in ("v_row", "v_col", "v")),
        reduce_statistics=reduce_statistics,
        sparse="scale_by_factored_rms takes dense updates only",
    )
    return elementwise(decl)
