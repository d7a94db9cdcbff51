"""Shampoo's per-dimension preconditioning (``scale_by_shampoo``), and what it shares with SOAP and PSGD Kron: the
dims of a leaf that carry a preconditioner, a leaf's Gram matrix along one dim, a matrix applied along one dim, the
choice between a step's two outcomes, and stepping each leaf whole (member by member under vmap, gathered from its
shards on DTensor params)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch._C._functorch import is_batchedtensor

from fadam._base import GradientTransformation
from fadam._dispatch import is_dtensor
from fadam._numerics import bias_correction, for_leaf, host_number, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, check_params, tree_flatten, tree_map, tree_paths
from fadam._tree_math import tree_update_moment
from fadam.transforms._validation import (
    UnsupportedParamsError,
    check_non_negative,
    check_state,
    check_unit_interval,
    known_value,
)

GRAFTINGS = (None, "adagrad", "adam")
NORM_EPS = 1e-16  # added to the Shampoo direction's norm before grafting, as Meta's and Google's implementations do
STATISTICS_DTYPES = (None, torch.float32, torch.float64)

T = TypeVar("T")


# ------------------------------------------------------------------------------------- algebra shared with SOAP


def factor_dims(shape: torch.Size | tuple[int, ...], max_dim: int, vectors: bool) -> tuple[int, ...]:
    """The dims of ``shape`` that carry a preconditioner: those of size at most ``max_dim`` (the others keep the
    identity); a vector's dim only if ``vectors``; none for a scalar or an empty tensor."""
    if len(shape) == 0 or (len(shape) == 1 and not vectors) or min(shape) == 0:
        return ()
    return tuple(d for d, n in enumerate(shape) if n <= max_dim)


def gram(x: torch.Tensor, dim: int) -> torch.Tensor:
    r""":math:`X_{(d)} X_{(d)}^\top`: the Gram matrix of ``x``'s slices along ``dim``, contracted over every other
    dim (:math:`GG^\top` for ``dim=0`` of a matrix, :math:`G^\top G` for ``dim=1``)."""
    rows = x.movedim(dim, 0).reshape(x.shape[dim], -1)
    return rows @ rows.mT


def along(x: torch.Tensor, matrix: torch.Tensor, dim: int) -> torch.Tensor:
    r""":math:`\sum_j x_{\dots j \dots} M_{jk}`: ``matrix`` applied to ``x`` along ``dim`` (the mode-``dim`` product
    with :math:`M^\top`)."""
    return (x.movedim(dim, -1) @ matrix).movedim(-1, dim)


def when(flag: bool | torch.Tensor, new: Callable[[], T], old: T) -> T:
    """``new()`` where ``flag`` holds, ``old`` where it does not (tensors, or tuples of them). A flag known on the
    host (a plain step count) computes only the branch it takes; a traced one (``torch.compile``) computes both and
    selects element by element, so one graph serves every step."""
    if isinstance(flag, bool):
        return new() if flag else old

    def select(a: Any, b: Any) -> Any:
        if isinstance(a, tuple):  # plain recursion: torch.compile traces it faster than optree's
            return tuple(select(x, y) for x, y in zip(a, b))
        return torch.where(flag if flag.device == a.device else flag.to(a.device), a, b)

    return select(new(), old)


def dtype_of_statistics(p: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a leaf's statistics and of the math on them: ``dtype``, else float32 for 16-bit params (an
    eigendecomposition in half precision is too coarse), else the param's."""
    if dtype is not None:
        return dtype
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def check_matrix_params(params: PyTree, transform: str) -> list[Any]:
    """The leaves of ``params``, refusing (naming the path) a complex one: the statistics are real matrices."""
    leaves = check_params(params)
    for leaf, path in zip(leaves, tree_paths(params)):
        if leaf is not None and leaf.is_complex():
            raise UnsupportedParamsError(f"{transform} takes real params only: param {path} is {leaf.dtype}")
    return leaves


def replicated_like(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x``, a whole statistic of the leaf ``p``, as the state keeps it: on a DTensor param's mesh with ``Replicate``
    placements (every rank holds all of it, and distributed checkpoints save it once), else as it is."""
    if not is_dtensor(p):
        return x
    from torch.distributed.tensor import DTensor, Replicate

    mesh = p.device_mesh
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _placed_like(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The whole update ``u`` with the DTensor gradient ``g``'s placements: each rank keeps its own part
    (``Replicate`` to ``Shard`` slices locally, no communication)."""
    return replicated_like(g, u).redistribute(g.device_mesh, g.placements)


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on this rank: a sharded gradient gathered (``full_tensor()``, an all-gather), a
    replicated statistic its local copy (no communication)."""
    return x.full_tensor() if is_dtensor(x) else x


def check_positive_int(name: str, value: int) -> int:
    """A structural count (a frequency, a size): a Python int >= 1 (a 0-d integer tensor outside torch.func is read)."""
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.numel() == 1:
        value = int(known_value(value, 0.0, name))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Invalid {name}: {value!r} (expected an int >= 1; name it in inject_hyperparams' static_args)"
        )
    return value


class _PerMember(torch.autograd.Function):
    """``fn(*tensors)`` under ``torch.func.vmap``, member by member. vmap's batched matmuls, eigendecompositions and
    QR decompositions of small matrices round differently from the single ones, and an eigenbasis chosen inside a
    degenerate eigenspace (low-rank statistics, as in the first steps) follows that rounding: batched members would
    leave the numbers of the same members stepped alone. Each member also reads its own step count as a number, so
    it computes only the refreshes it needs."""

    @staticmethod
    def forward(fn: Callable[..., tuple], *tensors: torch.Tensor) -> tuple:
        return fn(*tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass  # the statistics' math is not differentiated through a vmapped step

    @staticmethod
    def vmap(info: Any, in_dims: tuple, fn: Callable[..., tuple], *tensors: torch.Tensor) -> tuple:
        members = [  # a nested vmap's members are batched again: apply recurses
            _PerMember.apply(fn, *(t if d is None else t.select(d, i) for t, d in zip(tensors, in_dims[1:])))
            for i in range(info.batch_size)
        ]
        return tuple(torch.stack(column) for column in zip(*members)), (0,) * len(members[0])


def step_leaves(leaf: Callable[..., tuple], count: torch.Tensor, grads: list, parts: list[list]) -> list[tuple]:
    """``leaf(count, g, *state)`` (which returns the update and the new state, shaped as ``(g, *state)``) for every
    leaf with a gradient, as ``step_together`` runs them."""
    return step_together(lambda c, _, leaves: [leaf(c, *row) for row in leaves], count, grads, parts)


def step_together(fn: Callable[..., list], count: torch.Tensor, grads: list, parts: list[list]) -> list[tuple]:
    """``fn(count, indices, leaves)`` once over the leaves with a gradient: ``leaves[k]`` is ``(g, *state)`` (each a
    tensor or a tuple of them) of the leaf at ``indices[k]``, and ``fn`` returns the update and new state of each,
    shaped alike; the state stays where there is no gradient. Under ``torch.func.vmap`` each member runs alone
    (``_PerMember``). A DTensor gradient (FSDP2) is gathered whole (one all-gather per leaf: every rank must step)
    and stepped on every rank with the state's replicated copy, the numbers of one process; the new state is
    replicated again and the update takes the gradient's placements."""
    out = [(None, *state) for g, *state in zip(grads, *parts)]
    indices = [i for i, g in enumerate(grads) if g is not None]
    rows = [(grads[i], *(part[i] for part in parts)) for i in indices]
    sizes = [[len(x) if isinstance(x, tuple) else None for x in row] for row in rows]  # a tensor, or a tuple of them
    widths = [sum(1 if n is None else n for n in row) for row in sizes]

    def run(count: torch.Tensor, *tensors: torch.Tensor) -> tuple:
        bounds = list(itertools.accumulate(widths, initial=0))
        leaves = [_grouped(tensors[a:b], row) for a, b, row in zip(bounds, bounds[1:], sizes)]
        # contiguous: LAPACK's eigenvectors are column-major and a rotation leaves a permuted view, and a matmul
        # rounds by its operands' layout; a member of a batch (a slice of a stack) is contiguous
        return tuple(t.contiguous() for row in fn(count, indices, leaves) for t in _flat(row))

    if not rows:
        return out
    tensors = [_whole(t) if is_dtensor(row[0]) else t for row in rows for t in _flat(row)]
    batched = not torch.compiler.is_compiling() and any(is_batchedtensor(t) for t in (count, *tensors))
    new = _PerMember.apply(run, count, *tensors) if batched else run(count, *tensors)
    start = 0
    for i, row, width in zip(indices, sizes, widths):
        leaf, g = new[start : start + width], grads[i]
        if is_dtensor(g):
            leaf = (_placed_like(g, leaf[0]), *(replicated_like(g, t) for t in leaf[1:]))
        out[i] = _grouped(leaf, row)
        start += width
    return out


def _flat(row: tuple) -> list[torch.Tensor]:
    """The tensors of ``row`` (tensors and tuples of them), in order."""
    return [t for x in row for t in (x if isinstance(x, tuple) else (x,))]


def _grouped(tensors: Sequence[torch.Tensor], sizes: list[int | None]) -> tuple:
    """``tensors`` regrouped as ``_flat`` flattened them: a tensor where ``sizes`` says ``None``, else a tuple."""
    out, start = [], 0
    for size in sizes:
        out.append(tensors[start] if size is None else tuple(tensors[start : start + size]))
        start += 1 if size is None else size
    return tuple(out)


def flatten_state(updates: PyTree, params: PyTree | None, *parts: PyTree) -> tuple[list, list[list], Any]:
    """The gradients' leaves (checked against ``params`` when given), each state part's leaves, and the spec."""
    if params is None:
        grads, spec = tree_flatten(updates)
    else:
        grads, _, spec = check_leaves(updates, params)
    return grads, [spec.flatten_up_to(part) for part in parts], spec


# ------------------------------------------------------------------------------------------------------- Shampoo


class ScaleByShampooState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # EMA of the gradients (Meta's filtered gradient), in the statistics' dtype
    statistics: PyTree  # per leaf a tuple: the statistics L_i of each preconditioned dim
    preconditioners: PyTree  # per leaf a tuple: (L_i / c_2 + eps I)^(-1/p) of each preconditioned dim
    nu: PyTree  # the grafted method's second moment (an empty tuple per leaf without grafting)


def inverse_root(matrix: torch.Tensor, root: int, eps: float | torch.Tensor) -> torch.Tensor:
    r""":math:`(A + \epsilon I)^{-1/r}` of a symmetric positive semi-definite :math:`A`, by its eigendecomposition
    :math:`A = V \Lambda V^\top`. Eigenvalues that rounding left negative first lift the spectrum by the most
    negative one, as Meta's DistributedShampoo does."""
    values, vectors = torch.linalg.eigh(matrix)
    values = values - values.min().clamp(max=0) + eps
    return (vectors * values.pow(-1.0 / root).unsqueeze(-2)) @ vectors.mT


def _ema_or_sum(beta2: float | torch.Tensor) -> float | torch.Tensor:
    """The weight of a new outer product in the statistics: ``1 - beta2``, or 1 for ``beta2 = 1`` (a sum)."""
    if isinstance(beta2, torch.Tensor):
        return torch.where(beta2 == 1, torch.ones_like(beta2), 1 - beta2)
    return 1.0 if beta2 == 1 else 1 - beta2


def _statistics_correction(beta2: float | torch.Tensor, count: torch.Tensor) -> float | torch.Tensor:
    """``1 - beta2 ** t``, or 1 for a sum (``beta2 = 1``), whose statistics need no correction."""
    if isinstance(beta2, torch.Tensor):
        return torch.where(beta2 == 1, torch.ones((), dtype=torch.float64), bias_correction(beta2, count))
    return 1.0 if beta2 == 1 else bias_correction(beta2, count)


def check_shampoo_args(
    b1: float | torch.Tensor,
    b2: float | torch.Tensor,
    eps: float | torch.Tensor,
    grafting: str | None,
    grafting_beta2: float | torch.Tensor,
    grafting_eps: float | torch.Tensor,
    inv_root_override: int,
    dtype: torch.dtype | None,
) -> None:
    check_unit_interval("b1", b1)
    if not 0.0 < known_value(b2, 1.0, "b2") <= 1.0:
        raise ValueError(f"Invalid b2: {b2} (expected 0 < b2 <= 1; 1 sums the statistics)")
    check_non_negative("eps", eps)
    if grafting not in GRAFTINGS:
        raise ValueError(f"Invalid grafting: {grafting!r} (expected one of {GRAFTINGS})")
    check_unit_interval("grafting_beta2", grafting_beta2)
    check_non_negative("grafting_eps", grafting_eps)
    if isinstance(inv_root_override, bool) or not isinstance(inv_root_override, int) or inv_root_override < 0:
        raise ValueError(f"Invalid inv_root_override: {inv_root_override!r} (expected an int >= 0; 0: twice the order)")
    if dtype not in STATISTICS_DTYPES:
        raise ValueError(f"Invalid statistics_dtype: {dtype} (expected one of {STATISTICS_DTYPES})")


def scale_by_shampoo(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 1.0,
    eps: float | torch.Tensor = 1e-12,
    max_preconditioner_dim: int = 1024,
    precondition_frequency: int = 1,
    start_preconditioning_step: int = -1,
    inv_root_override: int = 0,
    use_bias_correction: bool = True,
    grafting: str | None = None,
    grafting_beta2: float | torch.Tensor = 0.999,
    grafting_eps: float | torch.Tensor = 1e-10,
    precondition_1d: bool = False,
    *,
    statistics_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Preconditions each leaf by one matrix per dim, the inverse root of that dim's gradient statistics (Shampoo).

    For a leaf :math:`G_t` of order :math:`k`, each dim :math:`i` of size at most ``max_preconditioner_dim`` keeps
    the statistics of the gradients' slices along it, a sum (``b2 = 1``, the paper's) or an EMA:

    .. math::
        L_{i,t} = \beta_2 L_{i,t-1} + (1 - \beta_2)\, G_{(i)} G_{(i)}^\top \ \ (\text{or } L_{i,t-1} +
        G_{(i)} G_{(i)}^\top),\qquad
        P_i = \big(L_{i,t} / c_{2,t} + \epsilon I\big)^{-1/p},\quad p = 2k

    with :math:`c_{2,t} = 1 - \beta_2^t` (1 for a sum), refreshed when :math:`t` is a multiple of
    ``precondition_frequency`` by an eigendecomposition in the statistics' dtype (eigenvalues lifted to be
    non-negative, then :math:`\epsilon` added: the diagonal's epsilon). Every other dim keeps the identity. The
    direction is the bias-corrected EMA of the gradients :math:`\hat m_t = m_t / (1 - \beta_1^t)` (Meta's filtered
    gradient) preconditioned along every dim, :math:`S_t = \hat m_t \times_1 P_1 \cdots \times_k P_k`. With
    ``grafting`` its norm is that of the grafted method's step :math:`D_t = \hat m_t / (\sqrt{\hat\nu_t} +
    \epsilon_g)` (AdaGrad's :math:`\nu_t = \sum g^2`, or Adam's bias-corrected EMA with ``grafting_beta2``), per
    leaf:

    .. math::
        u_t = S_t \, \frac{\|D_t\|_F}{\|S_t\|_F + 10^{-16}}

    Before ``start_preconditioning_step``, and always for a leaf with no preconditioned dim (vectors unless
    ``precondition_1d``, scalars, leaves whose every dim is too large), the update is :math:`D_t`, or
    :math:`\hat m_t` without grafting.

    Defaults follow Meta's DistributedShampoo (``betas=(0.9, 1.0)``, ``epsilon=1e-12``,
    ``max_preconditioner_dim=1024``, ``precondition_frequency=1``, ``start_preconditioning_step=-1`` meaning the
    frequency, the root :math:`2k`, bias correction, no grafting; its grafting configs' ``epsilon=1e-10`` and Adam's
    ``beta2=0.999``). Where this differs from it: a dim larger than ``max_preconditioner_dim`` keeps the identity
    (Meta's blocks the tensor), dims are not merged, grafting is per leaf (Meta's per block), vectors take no
    preconditioner unless ``precondition_1d`` (Google's reference's choice), and the root is always computed by
    eigendecomposition (no retries, no Newton iteration).

    Statistics, preconditioners and moments are kept in ``statistics_dtype`` (default float32 for float16 and
    bfloat16 params, the param's dtype otherwise); the update has the param's dtype. Refreshes and the switch to
    preconditioning are decided on the host from a plain step count, computing only what the step needs; under
    ``torch.compile`` (where the count is traced) both outcomes are computed and selected; under ``torch.func.vmap``
    each member is stepped alone, with the numbers it has outside vmap. Real params only.

    **FSDP2 / DTensor.** A preconditioner multiplies whole dims, which a shard does not hold: each leaf's gradient is
    gathered (``full_tensor()``, one all-gather per leaf and step, so every rank must step), the whole step runs on
    every rank, and each rank keeps its own shard of the update (the gradient's placements). All of the state is
    replicated on the param's mesh (DTensors with ``Replicate`` placements, which distributed checkpoints save once):
    the statistics and preconditioners, and also the moments, whose whole is preconditioned each step (sharded, they
    would need a second gather). Each rank so holds a leaf's whole state: :math:`2\sum_i n_i^2` for the matrices plus
    one (two with grafting) copies of the leaf, in ``statistics_dtype``, where elementwise state would hold a shard.
    The numbers are those of one process, bit for bit.

    Args:
        b1: decay :math:`\beta_1` of the gradients' EMA (0: the gradient itself).
        b2: decay :math:`\beta_2` of the statistics; 1 sums them (AdaGrad's accumulation).
        eps: :math:`\epsilon`, added to the statistics' eigenvalues before the root.
        max_preconditioner_dim: dims larger than this keep the identity.
        precondition_frequency: the preconditioners are recomputed every this many steps (from step 1).
        start_preconditioning_step: the first step preconditioned by Shampoo (-1: ``precondition_frequency``);
            at least ``precondition_frequency``, so that the preconditioners have been computed.
        inv_root_override: the root :math:`p` (0: twice the leaf's order).
        use_bias_correction: divide the EMAs by :math:`1 - \beta^t` (and the statistics by :math:`c_{2,t}`).
        grafting: ``None``, ``"adagrad"`` or ``"adam"``: the method whose step norm the Shampoo direction takes.
        grafting_beta2: the decay of Adam grafting's second moment.
        grafting_eps: :math:`\epsilon_g` of the grafted method.
        precondition_1d: give vectors a preconditioner (their one dim) too.
        statistics_dtype: dtype of the state and its math (float32 or float64).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_shampoo(b1=0.0)
        >>> g = torch.tensor([[4.0, 0.0], [0.0, 1.0]])
        >>> u, state = tx.update([g], tx.init([torch.zeros(2, 2)]))
        >>> u[0]  # L = R = g^2: each dim scales by its (g^2)^(-1/4), together g / |g|
        tensor([[1., 0.],
                [0., 1.]])

    References:
        Gupta, Koren & Singer, "Shampoo: Preconditioned Stochastic Tensor Optimization", ICML 2018.
        Shi et al., "A Distributed Data-Parallel PyTorch Implementation of the Distributed Shampoo Optimizer for
        Training Neural Networks At-Scale", 2023 (facebookresearch/optimizers, whose defaults these are).
    """
    check_shampoo_args(b1, b2, eps, grafting, grafting_beta2, grafting_eps, inv_root_override, statistics_dtype)
    frequency = check_positive_int("precondition_frequency", precondition_frequency)
    max_dim = check_positive_int("max_preconditioner_dim", max_preconditioner_dim)
    start = frequency if start_preconditioning_step == -1 else start_preconditioning_step
    if isinstance(start, bool) or not isinstance(start, int) or start < frequency:
        raise ValueError(
            f"Invalid start_preconditioning_step: {start_preconditioning_step!r} (expected -1 or an int >= "
            f"precondition_frequency = {frequency}: the preconditioners are first computed at that step)"
        )

    def init(params: PyTree) -> ScaleByShampooState:
        check_matrix_params(params, "scale_by_shampoo")

        def moment(p: torch.Tensor | None) -> torch.Tensor | None:
            if p is None:
                return None
            return replicated_like(
                p, torch.zeros(p.shape, dtype=dtype_of_statistics(p, statistics_dtype), device=p.device)
            )

        def matrices(p: torch.Tensor | None, fill: Callable[..., torch.Tensor]) -> tuple | None:
            if p is None:
                return None
            dtype = dtype_of_statistics(p, statistics_dtype)
            dims = factor_dims(p.shape, max_dim, precondition_1d)
            return tuple(replicated_like(p, fill(p.shape[d], dtype=dtype, device=p.device)) for d in dims)

        return ScaleByShampooState(
            count=zero_count(),
            mu=tree_map(moment, params),
            statistics=tree_map(lambda p: matrices(p, lambda n, **kw: torch.zeros(n, n, **kw)), params),
            preconditioners=tree_map(lambda p: matrices(p, torch.eye), params),
            nu=tree_map(lambda p: None if p is None else (() if grafting is None else moment(p)), params),
        )

    def leaf(count: torch.Tensor, g: torch.Tensor, mu: torch.Tensor, stats: tuple, preconds: tuple, nu: Any) -> tuple:
        t = host_number(count)
        refresh, use = t % frequency == 0, t >= start  # bools, or 0-d tensors where the count is traced
        w = g.to(mu.dtype)
        dims = factor_dims(w.shape, max_dim, precondition_1d)
        weight = _ema_or_sum(b2)
        stats = tuple(b2 * s + weight * gram(w, d) for s, d in zip(stats, dims))
        mu = tree_update_moment(w, mu, b1, 1)
        m_hat = mu / for_leaf(bias_correction(b1, count), mu) if use_bias_correction else mu
        if grafting is not None:
            nu = w * w + nu if grafting == "adagrad" else tree_update_moment(w, nu, grafting_beta2, 2)
            nu_hat = nu / for_leaf(bias_correction(grafting_beta2, count), nu) if grafting == "adam" else nu
            fallback = m_hat / (nu_hat.sqrt() + grafting_eps)
        else:
            fallback = m_hat
        if dims:
            correction = for_leaf(_statistics_correction(b2, count), w) if use_bias_correction else 1.0
            root = inv_root_override or 2 * w.dim()
            preconds = when(refresh, lambda: tuple(inverse_root(s / correction, root, eps) for s in stats), preconds)

            def shampoo_direction() -> torch.Tensor:
                s = m_hat
                for d, p in zip(dims, preconds):
                    s = along(s, p, d)
                if grafting is None:
                    return s
                return s * (torch.linalg.vector_norm(fallback) / (torch.linalg.vector_norm(s) + NORM_EPS))

            u = when(use, shampoo_direction, fallback)
        else:
            u = fallback
        return u.to(g.dtype), mu, stats, preconds, nu

    def update(
        updates: PyTree, state: ScaleByShampooState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByShampooState]:
        check_state(state, ScaleByShampooState, "scale_by_shampoo")
        grads, parts, spec = flatten_state(updates, params, state.mu, state.statistics, state.preconditioners, state.nu)
        count = safe_increment(state.count)  # t, from 1
        new = step_leaves(leaf, count, grads, parts)
        # without grafting ``nu`` holds an empty tuple per leaf, which never changes: kept as it is (dynamo's pytree
        # cannot unflatten a tree of empty tuples)
        kept = 4 if grafting is None else 5
        columns = (
            [spec.unflatten(list(column)) for column in list(zip(*new))[:kept]] if new else [spec.unflatten([])] * 5
        )
        return columns[0], ScaleByShampooState(count, *columns[1:4], state.nu if grafting is None else columns[4])

    return GradientTransformation(init, update)
