"""SOAP: Adam in the eigenbasis of Shampoo's preconditioners (``scale_by_soap``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, for_leaf, host_number, safe_increment, zero_count
from fadam._tree import PyTree, tree_map
from fadam._tree_math import tree_update_moment
from fadam.transforms._shampoo import (
    STATISTICS_DTYPES,
    along,
    check_matrix_params,
    check_positive_int,
    dtype_of_statistics,
    factor_dims,
    flatten_state,
    gram,
    replicated_like,
    step_leaves,
    when,
)
from fadam.transforms._validation import check_non_negative, check_state, check_unit_interval, known_value

DATA_FORMATS = ("channels_first", "channels_last")
EIGH_JITTER = 1e-30  # added to the diagonal before the first eigendecomposition, as the official implementation does
NORMALIZE_EPS = 1e-30  # added to the RMS the update is divided by with normalize_grads (the official value)


class ScaleBySoapState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (the first only gathers statistics)
    mu: PyTree  # Adam's first moment, in the eigenbasis (in the merged shape with merge_dims)
    nu: PyTree  # Adam's second moment, in the eigenbasis
    statistics: PyTree  # per leaf a tuple: the EMA of G_(i) G_(i)^T of each preconditioned dim (the paper's L, R)
    eigenbases: PyTree  # per leaf a tuple: the eigenbasis Q_i of each statistic


def merged_shape(shape: torch.Size, max_dim: int) -> tuple[int, ...]:
    """The official implementation's ``merge_dims``: consecutive dims multiplied together while the product stays
    at most ``max_dim``."""
    merged, current = [], 1
    for n in shape:
        if current * n > max_dim:
            if current > 1:
                merged.append(current)
                current = n
            else:
                merged.append(n)
        else:
            current *= n
    if current > 1 or not merged:
        merged.append(current)
    return tuple(merged)


class _Layout(NamedTuple):
    """How a leaf is viewed for its statistics: channels-last 4-d leaves permuted to channels first, then dims
    merged (both only with ``merge_dims``, for leaves of two dims or more, as the official implementation)."""

    shape: tuple[int, ...]  # the param's
    permute: bool
    working: tuple[int, ...]

    def to_working(self, x: torch.Tensor) -> torch.Tensor:
        return (x.permute(0, 3, 1, 2) if self.permute else x).reshape(self.working)

    def to_param(self, x: torch.Tensor) -> torch.Tensor:
        if self.permute:
            n, h, w, c = self.shape
            return x.reshape(n, c, h, w).permute(0, 2, 3, 1)
        return x.reshape(self.shape)


def _layout(shape: torch.Size, merge_dims: bool, channels_last: bool, max_dim: int) -> _Layout:
    if not merge_dims or len(shape) < 2:
        return _Layout(tuple(shape), False, tuple(shape))
    permute = channels_last and len(shape) == 4
    permuted = (shape[0], shape[3], shape[1], shape[2]) if permute else tuple(shape)
    return _Layout(tuple(shape), permute, merged_shape(torch.Size(permuted), max_dim))


def rotate(x: torch.Tensor, bases: tuple, dims: tuple[int, ...], back: bool = False) -> torch.Tensor:
    r""":math:`x \times_i Q_i^\top` over the preconditioned dims (into the eigenbasis), or :math:`x \times_i Q_i`
    (``back``)."""
    for d, q in zip(dims, bases):
        x = along(x, q.mT if back else q, d)
    return x


def eigenbasis(statistic: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of ``statistic``, by decreasing eigenvalue (``torch.linalg.eigh``'s order reversed)."""
    eye = torch.eye(statistic.shape[-1], dtype=statistic.dtype, device=statistic.device)
    return torch.linalg.eigh(statistic + EIGH_JITTER * eye).eigenvectors.flip(-1)


def power_step(statistic: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    r"""The next eigenbasis: one power iteration from ``basis`` and a QR decomposition, :math:`Q' = \mathrm{QR}(M
    Q_\sigma)`, with :math:`Q`'s columns ordered by decreasing estimated eigenvalue :math:`\mathrm{diag}(Q^\top M Q)`
    (the paper's Algorithm 4). Each new column is put back in the place of the column it came from, so the second
    moment, indexed like the columns, needs no reordering: the official implementation's sort of both, equivalently."""
    estimates = (basis * (statistic @ basis)).sum(-2)
    order = torch.argsort(estimates, descending=True)
    q = torch.linalg.qr(statistic @ basis.index_select(-1, order)).Q
    return q.index_select(-1, torch.argsort(order))


def check_soap_args(
    b1: float | torch.Tensor,
    b2: float | torch.Tensor,
    shampoo_beta: float | torch.Tensor,
    eps: float | torch.Tensor,
    data_format: str,
    dtype: torch.dtype | None,
) -> None:
    check_unit_interval("beta1", b1)
    check_unit_interval("beta2", b2)
    if known_value(shampoo_beta, 0.0, "shampoo_beta") >= 0:
        check_unit_interval("shampoo_beta", shampoo_beta)
    check_non_negative("eps", eps)
    if data_format not in DATA_FORMATS:
        raise ValueError(f"Invalid data_format: {data_format!r} (expected one of {DATA_FORMATS})")
    if dtype not in STATISTICS_DTYPES:
        raise ValueError(f"Invalid statistics_dtype: {dtype} (expected one of {STATISTICS_DTYPES})")


def scale_by_soap(
    betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.95, 0.95),
    shampoo_beta: float | torch.Tensor = -1.0,
    eps: float | torch.Tensor = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    data_format: str = "channels_first",
    correct_bias: bool = True,
    *,
    statistics_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Adam run in the eigenbasis of Shampoo's preconditioners, that basis refreshed every few steps (SOAP).

    Each dim :math:`i` of a leaf of size at most ``max_precond_dim`` keeps an EMA of its Gram matrix and its
    eigenbasis :math:`Q_i` (vectors only with ``precondition_1d``, scalars never: plain Adam); with
    :math:`\tilde x = x \times_1 Q_1^\top \cdots` the rotation into the basis and :math:`\beta_s` ``shampoo_beta``
    (``-1``: :math:`\beta_2`), step :math:`t \geq 1` (the first call only gathers the statistics; its update is 0):

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1)\tilde g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2)\tilde g_t^2,\quad
        u_t = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\ \mathrm{back}\!\left(\frac{m_t}{\sqrt{v_t} + \epsilon}\right)

    then :math:`L_{i} \leftarrow \beta_s L_{i} + (1-\beta_s) G_{(i)} G_{(i)}^\top`. At the first call :math:`Q_i`
    is the eigendecomposition's (by decreasing eigenvalue); when :math:`t` is a multiple of
    ``precondition_frequency`` it moves by one power iteration and a QR step (``power_step``), and :math:`m` is
    rotated from the old basis into the new one. ``normalize_grads`` divides the direction by its RMS (plus
    :math:`10^{-30}`) before the bias correction; ``correct_bias=False`` drops the factor. ``merge_dims`` first
    merges consecutive dims while their product stays at most ``max_precond_dim`` (``data_format="channels_last"``
    views a 4-d leaf as channels first for that); the moments then have the merged shape.

    This is the algorithm of the official implementation (nikhilvyas/SOAP), whose signature and defaults these are.
    A refresh keeps :math:`v` in place and puts each new eigenvector where its source column was, where the official
    code sorts both (the same numbers). The step count is shared by all leaves (the official one is per param, which
    differs only for a param first given a gradient after the first step). State and math in ``statistics_dtype``
    (default float32 for float16/bfloat16 params, the param's dtype otherwise); the update has the param's dtype.
    Eigendecompositions and refreshes run only on the steps that need them; under ``torch.compile`` (where the count
    is traced) both outcomes are computed and selected; under ``torch.func.vmap`` each member is stepped alone, with
    the numbers it has outside vmap (batched matrix routines round differently, and low-rank statistics leave their
    eigenbasis to rounding). Real params only.

    **FSDP2 / DTensor.** The statistics and rotations span whole dims, which a shard does not hold: each leaf's
    gradient is gathered (``full_tensor()``, one all-gather per leaf and step, so every rank must step), the whole
    step runs on every rank, and each rank keeps its own shard of the update (the gradient's placements). All of the
    state is replicated on the param's mesh (DTensors with ``Replicate`` placements, which distributed checkpoints
    save once): the statistics and eigenbases, and also the moments, which live in the eigenbasis, not in the
    param's (a shard of them is no shard of the param). Each rank so holds a leaf's whole state: two copies of the
    leaf and :math:`2\sum_i n_i^2` for the matrices, in ``statistics_dtype``, where Adam would hold two shards. The
    numbers are those of one process, bit for bit.

    Args:
        betas: :math:`(\beta_1, \beta_2)`, Adam's decays.
        shampoo_beta: :math:`\beta_s`, the statistics' decay (-1: :math:`\beta_2`).
        eps: :math:`\epsilon`, added to :math:`\sqrt{v_t}`.
        precondition_frequency: the eigenbases move every this many steps.
        max_precond_dim: dims larger than this keep the identity.
        merge_dims: merge small consecutive dims before preconditioning.
        precondition_1d: precondition vectors too.
        normalize_grads: divide the direction by its RMS.
        data_format: ``"channels_first"`` or ``"channels_last"`` (4-d leaves, with ``merge_dims``).
        correct_bias: Adam's bias correction, as a factor on the update.
        statistics_dtype: dtype of the state and its math (float32 or float64).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_soap()
        >>> params = [torch.zeros(2, 2)]
        >>> state = tx.init(params)
        >>> g = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
        >>> u, state = tx.update([g], state, params)  # the first step builds the eigenbases, and takes no step
        >>> u[0].abs().max().item(), [tuple(q.shape) for q in state.eigenbases[0]]
        (0.0, [(2, 2), (2, 2)])
        >>> u, state = tx.update([g], state, params)
        >>> u[0].round(decimals=6)  # Adam's first step, a sign, in the eigenbasis (here the axes), rotated back
        tensor([[1., 0.],
                [0., 1.]])

    References:
        Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam", ICLR 2025 (arXiv:2409.11321), and the
        authors' implementation (nikhilvyas/SOAP).
    """
    b1, b2 = betas
    check_soap_args(b1, b2, shampoo_beta, eps, data_format, statistics_dtype)
    frequency = check_positive_int("precondition_frequency", precondition_frequency)
    max_dim = check_positive_int("max_precond_dim", max_precond_dim)
    beta_s = b2 if known_value(shampoo_beta, 0.0, "shampoo_beta") < 0 else shampoo_beta
    channels_last = data_format == "channels_last"

    def layout_of(p: torch.Tensor) -> tuple[_Layout, tuple[int, ...]]:
        layout = _layout(p.shape, merge_dims, channels_last, max_dim)
        return layout, factor_dims(layout.working, max_dim, precondition_1d or p.dim() > 1)

    def init(params: PyTree) -> ScaleBySoapState:
        check_matrix_params(params, "scale_by_soap")

        def moment(p: torch.Tensor | None) -> torch.Tensor | None:
            if p is None:
                return None
            dtype = dtype_of_statistics(p, statistics_dtype)
            return replicated_like(p, torch.zeros(layout_of(p)[0].working, dtype=dtype, device=p.device))

        def matrices(p: torch.Tensor | None, fill: Any) -> tuple | None:
            if p is None:
                return None
            layout, dims = layout_of(p)
            dtype = dtype_of_statistics(p, statistics_dtype)
            return tuple(replicated_like(p, fill(layout.working[d], dtype=dtype, device=p.device)) for d in dims)

        return ScaleBySoapState(
            count=zero_count(),
            mu=tree_map(moment, params),
            nu=tree_map(moment, params),
            statistics=tree_map(lambda p: matrices(p, lambda n, **kw: torch.zeros(n, n, **kw)), params),
            eigenbases=tree_map(lambda p: matrices(p, torch.eye), params),
        )

    def adam(w: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor, bases: tuple, dims: tuple, t: torch.Tensor) -> tuple:
        """Adam's step in the current eigenbasis, rotated back; its new moments."""
        projected = rotate(w, bases, dims)
        mu = tree_update_moment(projected, mu, b1, 1)
        nu = tree_update_moment(projected, nu, b2, 2)
        direction = rotate(mu / (nu.sqrt() + eps), bases, dims, back=True)
        if normalize_grads:
            direction = direction / (NORMALIZE_EPS + direction.square().mean().sqrt())
        if correct_bias:
            factor = bias_correction(b2, t).sqrt() / bias_correction(b1, t)
            direction = direction * for_leaf(factor, direction)
        return direction, mu, nu

    def refreshed(statistics: tuple, bases: tuple, mu: torch.Tensor, dims: tuple) -> tuple:
        """The eigenbases after a power step, and the first moment rotated from the old basis into the new one."""
        new = tuple(power_step(s, q) for s, q in zip(statistics, bases))
        return new, rotate(rotate(mu, bases, dims, back=True), new, dims)

    def leaf(
        count: torch.Tensor, g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor, statistics: tuple, bases: tuple
    ) -> tuple:
        c = host_number(count)
        first, refresh = c == 0, (c > 0) & (c % frequency == 0)  # bools, or 0-d tensors where the count is traced
        t = count.clamp(min=1)  # Adam's step number; the first call (count 0) takes no Adam step
        layout, dims = layout_of(g)
        w = layout.to_working(g).to(mu.dtype)
        # the first call builds the bases from this gradient only: it takes no step (the official implementation's)
        stepping = not first if isinstance(first, bool) else ~first
        u, mu, nu = when(stepping, lambda: adam(w, mu, nu, bases, dims, t), (torch.zeros_like(w), mu, nu))
        statistics = tuple(torch.lerp(s, gram(w, d), 1 - beta_s) for s, d in zip(statistics, dims))
        if dims:
            bases = when(first, lambda: tuple(eigenbasis(s) for s in statistics), bases)
            bases, mu = when(refresh, lambda: refreshed(statistics, bases, mu, dims), (bases, mu))
        return layout.to_param(u).to(g.dtype), mu, nu, statistics, bases

    def update(
        updates: PyTree, state: ScaleBySoapState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleBySoapState]:
        check_state(state, ScaleBySoapState, "scale_by_soap")
        grads, parts, spec = flatten_state(updates, params, state.mu, state.nu, state.statistics, state.eigenbases)
        new = step_leaves(leaf, state.count, grads, parts)
        columns = [spec.unflatten(list(column)) for column in zip(*new)] if new else [spec.unflatten([])] * 5
        return columns[0], ScaleBySoapState(safe_increment(state.count), *columns[1:])

    return GradientTransformation(init, update)
