r"""PSGD with Kronecker-factored preconditioners (``scale_by_psgd_kron``): one triangular or diagonal factor
:math:`Q_i` per dim, fitted by Xi-Lin Li's Lie-group step so that :math:`P = Q^\top Q` whitens the momentum."""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch._C._functorch import is_batchedtensor

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, for_leaf, safe_increment, zero_count
from fadam._tree import PyTree, tree_map
from fadam._tree_math import tree_update_moment
from fadam.transforms._shampoo import (
    STATISTICS_DTYPES,
    along,
    check_matrix_params,
    check_positive_int,
    dtype_of_statistics,
    flatten_state,
    gram,
    replicated_like,
    step_together,
)
from fadam.transforms._validation import check_state, check_unit_interval, known_value

MEMORY_SAVE_MODES = (None, "smart_one_diag", "one_diag", "all_diag")
BALANCE_PROBABILITY = 0.01  # the references rebalance the factors' norms on about one update in a hundred
DAMPING = math.sqrt(torch.finfo(torch.float32).eps)  # the references' relative damping of the fitted input
RMS_LIMIT = 1.1  # the update's RMS is clipped to this (the references' trust region)
RMS_EPS = 1e-12  # added to the RMS before dividing by it (kron_torch's)
SHARED_STREAM = -1  # the stream of a step's draws that every leaf reads (whether to rebalance)


class ScaleByPsgdKronState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    update_counter: torch.Tensor  # 0-d int32: steps since the factors last moved (the references' counter)
    mu: PyTree  # momentum of the gradients, in the working shape (dims merged with merge_dims)
    preconditioners: PyTree  # per leaf a flat tuple: each block's factors Q_i, block after block
    key: torch.Tensor  # 0-d int64: the seed every random draw derives from, with the count


def default_update_probability(count: torch.Tensor) -> torch.Tensor:
    r"""kron_torch's annealing of the update probability: :math:`\mathrm{clip}(e^{-0.001 (n - 500)}, 0.03, 1)` at
    step count :math:`n` (1 for the first 500 steps, 0.03 from about step 4000), in float32 as kron_torch computes
    it."""
    return torch.exp(-0.001 * (count.to(torch.float32) - 500.0)).clamp(0.03, 1.0)


def draw_generator(key: int, count: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of the draws of one step (``count`` steps taken before it) and one stream (a leaf's index, or
    ``SHARED_STREAM``): seeded by a 64-bit BLAKE2b digest of the three numbers, so that a step is a pure function of
    its state and no two steps or leaves share draws."""
    digest = hashlib.blake2b(struct.pack("<qqq", key, count, stream), digest_size=8).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest, "little"))


def shared_draw(key: int, count: int) -> float:
    """The uniform draw of a step that every leaf reads: below ``BALANCE_PROBABILITY``, the factors are rebalanced."""
    return float(torch.rand((), generator=draw_generator(key, count, SHARED_STREAM), dtype=torch.float64))


def normal_draws(
    key: int, count: int, stream: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Standard normal tensors of ``shapes``, one after another from the generator of ``(key, count, stream)`` (on
    the meta device, which holds no values and has no generator, tensors of those shapes)."""
    if torch.device(device).type == "meta":
        return [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    generator = draw_generator(key, count, stream, device)
    return [torch.randn(shape, generator=generator, dtype=dtype, device=device) for shape in shapes]


class _Draws(NamedTuple):
    """What a step reads on the host: whether the factors are rebalanced first (those of leaves of two dims or
    more), and each leaf's normal draws for its fit, one per block (none where the factors stay)."""

    rebalance: bool
    vectors: list[list[torch.Tensor]]


def step_draws(step: torch.Tensor, streams: list[int], shapes: list[list[tuple[int, ...]]], likes: list) -> _Draws:
    """The ``_Draws`` of a step from ``step`` (the count, whether to update, the key), for leaves whose draws come
    from ``streams``, with blocks of ``shapes``, in the dtype and on the device of ``likes``: read at once for every
    leaf, so that torch.compile breaks its graph once per step."""
    count, update, key = step.tolist()
    if not update:
        return _Draws(False, [[] for _ in streams])
    vectors = [
        normal_draws(key, count, stream, blocks, like.dtype, like.device)
        for stream, blocks, like in zip(streams, shapes, likes)
    ]
    return _Draws(shared_draw(key, count) < BALANCE_PROBABILITY, vectors)


# ----------------------------------------------------------------------------------------- a leaf's factor layout


def working_shape(shape: torch.Size | tuple[int, ...], merge_dims: bool) -> tuple[int, ...]:
    """The shape a leaf is preconditioned in: a scalar as a vector of one; with ``merge_dims`` a leaf of three dims
    or more as a matrix, ``(prod(shape[:-1]), shape[-1])`` or ``(shape[0], prod(shape[1:]))``, whichever has the
    smaller signed difference of its sides, as kron_torch compares them."""
    if len(shape) == 0:
        return (1,)
    if not merge_dims or len(shape) <= 2:
        return tuple(shape)
    rows, cols = (math.prod(shape[:-1]), shape[-1]), (shape[0], math.prod(shape[1:]))
    return rows if rows[1] - rows[0] <= cols[1] - cols[0] else cols


class _Rule(NamedTuple):
    """Which dims get a triangular factor: kron_torch's rule (and psgd_jax 0.1's skew limit)."""

    max_size: int
    max_skew: float | torch.Tensor
    min_ndim: int
    memory_save_mode: str | None

    def triangular(self, shape: tuple[int, ...]) -> tuple[bool, ...]:
        """Per dim: triangular, unless the leaf has fewer than ``min_ndim`` dims, the dim has size 1 or above
        ``max_size`` or above ``max_skew`` times the second largest dim (1 for a vector), or ``memory_save_mode``
        makes it diagonal: ``"all_diag"`` every dim, ``"one_diag"`` the largest (the last of equal ones),
        ``"smart_one_diag"`` the largest only where it is larger than every other."""
        n = len(shape)
        if n < self.min_ndim:
            return (False,) * n
        ordered = sorted(shape)
        second = ordered[-2] if n > 1 else 1
        largest = max(range(n), key=lambda d: (shape[d], d))
        smart = self.memory_save_mode == "smart_one_diag" and n > 1 and ordered[-1] > ordered[-2]
        one = self.memory_save_mode == "one_diag" or smart
        return tuple(
            not (
                self.memory_save_mode == "all_diag"
                or (one and d == largest)
                or size == 1
                or size > self.max_size
                or bool(size > self.max_skew * second)
            )
            for d, size in enumerate(shape)
        )


class _Plan(NamedTuple):
    """How a leaf is preconditioned: its working shape, the dims split into blocks (``partition_grads``), and each
    block's shape and triangular dims, in kron_torch's block order (the first split dim outermost)."""

    working: tuple[int, ...]
    block_size: int
    split_dims: tuple[int, ...]
    blocks: tuple[tuple[tuple[int, ...], tuple[bool, ...]], ...]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [x]
        for d in self.split_dims:
            parts = [block for part in parts for block in part.split(self.block_size, d)]
        return parts

    def merge(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        for d in reversed(self.split_dims):
            n = math.ceil(self.working[d] / self.block_size)
            blocks = [torch.cat(blocks[i : i + n], d) for i in range(0, len(blocks), n)]
        return blocks[0]

    def grouped(self, factors: tuple) -> list[tuple]:
        """The flat tuple of factors kept in the state, as one tuple per block."""
        sizes = [len(shape) for shape, _ in self.blocks]
        starts = list(itertools.accumulate(sizes, initial=0))
        return [tuple(factors[a:b]) for a, b in itertools.pairwise(starts)]


def _plan(shape: torch.Size, rule: _Rule, merge_dims: bool, block_size: int | None) -> _Plan:
    working = working_shape(shape, merge_dims)
    triangular = rule.triangular(working)
    split = () if block_size is None else tuple(d for d, n in enumerate(working) if triangular[d] and n > block_size)
    sides = [
        [min(block_size, working[d] - start) for start in range(0, working[d], block_size)] if d in split else [n]
        for d, n in enumerate(working)
    ]
    shapes = [tuple(block) for block in itertools.product(*sides)]
    return _Plan(working, block_size or 0, split, tuple((block, rule.triangular(block)) for block in shapes))


# ------------------------------------------------------------------------------------------ the math of one block


def _scaled(x: torch.Tensor, q: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` times the diagonal factor ``q`` along ``dim``."""
    return x * q.reshape([-1 if d == dim else 1 for d in range(x.dim())])


def _solved(x: torch.Tensor, q: torch.Tensor, dim: int) -> torch.Tensor:
    r""":math:`x \times_d Q^{-\top}`: ``x`` along ``dim`` times the inverse of the upper triangular ``q``, by a
    triangular solve."""
    rows = x.movedim(dim, -1)
    solved = torch.linalg.solve_triangular(q, rows.reshape(-1, q.shape[0]), upper=True, left=False)
    return solved.reshape(rows.shape).movedim(-1, dim)


def _squares(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The diagonal of ``gram(x, dim)``: the sum of squares of each slice along ``dim``."""
    return x.movedim(dim, 0).reshape(x.shape[dim], -1).square().sum(1)


def spectral_norm_lower_bound(s: torch.Tensor) -> torch.Tensor:
    r"""A cheap lower bound of the spectral norm of the symmetric ``s``: :math:`\|S S c / \|S c\|\|` for the column
    :math:`c` of largest norm, computed on :math:`S / \max|S|` (kron_torch's ``_lb``; 0 for a zero matrix)."""
    scale = s.abs().amax()
    a = s / scale
    # the column picked by index_select, not by a tensor subscript, which torch.compile reads on the host
    x = a.index_select(1, a.square().sum(0).argmax().reshape(1)).squeeze(1) @ a
    bound = torch.linalg.vector_norm(a @ (x / torch.linalg.vector_norm(x))) * scale
    return torch.where(scale > 0, bound, scale)


def fitted(
    factors: tuple, triangular: tuple[bool, ...], h: torch.Tensor, v: torch.Tensor, lr: float | torch.Tensor
) -> tuple:
    r"""One Lie-group step of every factor from the pair :math:`(v, h)`: with :math:`A = h \times_1 Q_1 \cdots` and
    :math:`B = v \times_1 Q_1^{-\top} \cdots`, a triangular :math:`Q_i \leftarrow Q_i - \eta\,\mathrm{triu}(A_{(i)}
    A_{(i)}^\top - B_{(i)} B_{(i)}^\top) Q_i / \|A_{(i)} A_{(i)}^\top + B_{(i)} B_{(i)}^\top\|` (the norm's lower
    bound ``spectral_norm_lower_bound``), a diagonal one the same on the diagonals with their largest magnitude."""
    tiny = torch.finfo(h.dtype).tiny
    a, b = h, v
    for d, (q, tri) in enumerate(zip(factors, triangular)):
        a = along(a, q.mT, d) if tri else _scaled(a, q, d)
        b = _solved(b, q, d) if tri else b / q.reshape([-1 if k == d else 1 for k in range(b.dim())])
    new = []
    for d, (q, tri) in enumerate(zip(factors, triangular)):
        if tri:
            aa, bb = gram(a, d), gram(b, d)
            bound = spectral_norm_lower_bound(aa + bb).clamp(min=tiny)
            new.append(q - (lr * torch.triu(aa - bb) / bound) @ q)
        else:
            aa, bb = _squares(a, d), _squares(b, d)
            new.append(q - lr * (aa - bb) * q / (aa + bb).abs().amax().clamp(min=tiny))
    return tuple(new)


def balanced(factors: tuple) -> tuple:
    """The factors rescaled to a common largest magnitude, the geometric mean of theirs (their product unchanged)."""
    norms = torch.stack([q.abs().amax() for q in factors])
    target = norms.log().mean().exp()
    return tuple(q * (target / n) for q, n in zip(factors, norms))


def preconditioned(factors: tuple, triangular: tuple[bool, ...], x: torch.Tensor) -> torch.Tensor:
    r""":math:`x \times_1 Q_1^\top Q_1 \cdots \times_k Q_k^\top Q_k`: :math:`P x` for :math:`P = Q^\top Q`."""
    for d, (q, tri) in enumerate(zip(factors, triangular)):
        x = along(along(x, q.mT, d), q, d) if tri else _scaled(x, q * q, d)
    return x


# ----------------------------------------------------------------------------------------------------- the transform


def check_psgd_kron_args(
    b1: float | torch.Tensor,
    probability: float | torch.Tensor | Callable | None,
    memory_save_mode: str | None,
    precond_lr: float | torch.Tensor,
    precond_init_scale: float | torch.Tensor,
    max_skew_triangular: float | torch.Tensor,
    key: int,
    dtype: torch.dtype | None,
) -> None:
    check_unit_interval("b1", b1)
    fixed = probability is not None and not callable(probability)
    if fixed and not 0.0 < known_value(probability, 1.0, "preconditioner_update_probability") <= 1.0:
        raise ValueError(f"Invalid preconditioner_update_probability: {probability} (expected 0 < p <= 1)")
    if memory_save_mode not in MEMORY_SAVE_MODES:
        raise ValueError(f"Invalid memory_save_mode: {memory_save_mode!r} (expected one of {MEMORY_SAVE_MODES})")
    for name, value in (("precond_lr", precond_lr), ("precond_init_scale", precond_init_scale)):
        if not known_value(value, 1.0, name) > 0.0:
            raise ValueError(f"Invalid {name}: {value} (expected > 0)")
    if not known_value(max_skew_triangular, math.inf, "max_skew_triangular") > 0.0:
        raise ValueError(f"Invalid max_skew_triangular: {max_skew_triangular} (expected > 0)")
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**63:
        raise ValueError(f"Invalid key: {key!r} (expected an int, 0 <= key < 2**63)")
    if dtype not in STATISTICS_DTYPES:
        raise ValueError(f"Invalid precond_dtype: {dtype} (expected one of {STATISTICS_DTYPES})")


def scale_by_psgd_kron(
    b1: float | torch.Tensor = 0.9,
    preconditioner_update_probability: float | torch.Tensor | Callable[[torch.Tensor], Any] | None = None,
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    precond_lr: float | torch.Tensor = 0.1,
    precond_init_scale: float | torch.Tensor = 1.0,
    merge_dims: bool = True,
    partition_grads: bool = False,
    block_size: int = 1024,
    clip_update_rms: bool = True,
    max_skew_triangular: float | torch.Tensor = math.inf,
    *,
    key: int = 0,
    precond_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Preconditions the momentum by a Kronecker product of per-dim factors fitted by PSGD (PSGD Kron).

    Each leaf (in its working shape: ``merge_dims`` views leaves of three dims or more as matrices) keeps the
    momentum :math:`m` and one factor :math:`Q_i` per dim, initialised to :math:`s^{1/k} I` (``precond_init_scale``
    :math:`s`, :math:`k` dims), upper triangular, or diagonal where ``_Rule.triangular`` says (vectors, dims above
    ``max_size_triangular``, ``memory_save_mode``, ``max_skew_triangular``). At step :math:`t`:

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad \hat m_t = \frac{m_t}{1-\beta_1^t},\quad
        u_t = \hat m_t \times_1 Q_1^\top Q_1 \cdots \times_k Q_k^\top Q_k,\quad
        u_t \leftarrow u_t \min\!\Big(1, \frac{1.1}{\mathrm{RMS}(u_t) + 10^{-12}}\Big)

    Before :math:`u_t`, on the steps where the counter of steps since the last update reaches :math:`1/p`
    (:math:`p` the update probability at this count, the references' deterministic counter), the factors take one
    Lie-group step (``fitted``, step size ``precond_lr``) on the pair :math:`(v, h)`, :math:`v \sim N(0, I)` and
    :math:`h = \hat m_t + \sqrt{\epsilon_{32}}\,\mathrm{mean}|\hat m_t|\,v` (the raw gradient instead of
    :math:`\hat m_t` without ``momentum_into_precond_update``); on one such step in a hundred (a shared draw) the
    factors of a leaf of two dims or more are first rescaled to a common norm (``balanced``, which leaves :math:`P`
    as it is). ``preconditioner_update_probability`` is a float, or a schedule of the count; ``None`` is kron_torch's
    ``default_update_probability`` (1 for 500 steps, annealed to 0.03). ``partition_grads`` splits each triangular
    dim above ``block_size`` into blocks of ``block_size``, each block with its own factors (the momentum and the
    clipping stay whole). ``clip_update_rms=False`` drops the clipping.

    This is the ``Kron`` of Evan Walters' kron_torch 0.3.3 (its arguments and defaults; ``partition_grads``,
    ``block_size`` and ``clip_update_rms`` of its ``dist_kron``, ``max_skew_triangular`` of psgd_jax 0.1), whose
    preconditioner update is Xi-Lin Li's. Where this differs: the damping noise is added to the input of the fit
    only (as psgd_jax and psgd_torch; kron_torch adds it in place to the momentum it then preconditions), the
    decision to rebalance is one draw per step from this transform's generator (kron_torch's ``random.Random(42)``),
    and the state and math are in ``precond_dtype`` (default float32 for float16/bfloat16 params, the param's dtype
    otherwise; kron_torch's default is float32, its triangular solves always float32). The draws come from
    ``torch.Generator`` s seeded from ``key``, the step count and the leaf's index (``draw_generator``; on the
    leaf's device), so that a step is a pure function of its inputs. Under ``torch.func.vmap`` each member is
    stepped alone; under ``torch.compile`` the step's decisions and draws are read outside the graph, first (one
    graph break per step). Real params only.

    **FSDP2 / DTensor.** The factors act on whole dims, which a shard does not hold: each leaf's gradient is gathered
    (``full_tensor()``, one all-gather per leaf and step, so every rank must step), the whole step runs on every rank
    with the same draws, and each rank keeps its own shard of the update (the gradient's placements). All of the
    state is replicated on the param's mesh (DTensors with ``Replicate`` placements, which distributed checkpoints
    save once): the factors, and also the momentum, whose whole is preconditioned and fitted to each step (sharded,
    it would need a second gather). Each rank so holds a leaf's whole state: one copy of the leaf and
    :math:`\sum_i n_i^2` (:math:`n_i` for a diagonal factor), in ``precond_dtype``, where elementwise momentum would
    hold a shard. The numbers are those of one process, bit for bit.

    Args:
        b1: :math:`\beta_1`, the momentum's decay.
        preconditioner_update_probability: :math:`p`, a float in (0, 1], a schedule, or ``None`` (annealed).
        max_size_triangular: dims larger than this get a diagonal factor.
        min_ndim_triangular: leaves with fewer dims get diagonal factors only.
        memory_save_mode: ``None``, ``"smart_one_diag"``, ``"one_diag"`` or ``"all_diag"``.
        momentum_into_precond_update: fit the factors to the momentum (else to the gradient).
        precond_lr: :math:`\eta`, the factors' step size.
        precond_init_scale: :math:`s`, the initial scale of :math:`Q`.
        merge_dims: view leaves of three dims or more as matrices.
        partition_grads: give blocks of large triangular dims their own factors.
        block_size: the blocks' size along a split dim.
        clip_update_rms: clip the update's RMS at 1.1.
        max_skew_triangular: dims above this many times the second largest get a diagonal factor.
        key: the seed of the random draws (an int, ``0 <= key < 2**63``).
        precond_dtype: dtype of the state and its math (float32 or float64).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_psgd_kron()
        >>> params = [torch.zeros(3, 4), torch.zeros(4)]
        >>> state = tx.init(params)
        >>> [[tuple(q.shape) for q in factors] for factors in state.preconditioners]  # a matrix, a diagonal
        [[(3, 3), (4, 4)], [(4,)]]
        >>> u, state = tx.update([torch.full((3, 4), 5.0), torch.full((4,), 0.1)], state)
        >>> [round(float(x.square().mean().sqrt()), 4) for x in u]  # the matrix's RMS clipped at 1.1
        [1.1, 0.1061]

    References:
        Li, "Preconditioned Stochastic Gradient Descent", IEEE TNNLS 2018 (arXiv:1512.04202).
        Li, "Black Box Lie Group Preconditioners for SGD", 2022 (arXiv:2211.04422); psgd_torch.
        Evan Walters' kron_torch (``Kron``) and psgd_jax (``kron``).
    """
    check_psgd_kron_args(
        b1,
        preconditioner_update_probability,
        memory_save_mode,
        precond_lr,
        precond_init_scale,
        max_skew_triangular,
        key,
        precond_dtype,
    )
    rule = _Rule(
        check_positive_int("max_size_triangular", max_size_triangular),
        max_skew_triangular,
        check_positive_int("min_ndim_triangular", min_ndim_triangular),
        memory_save_mode,
    )
    block = check_positive_int("block_size", block_size)
    size = block if partition_grads else None
    probability = preconditioner_update_probability
    schedule = default_update_probability if probability is None else probability

    def plan_of(shape: torch.Size) -> _Plan:
        return _plan(shape, rule, merge_dims, size)

    def init(params: PyTree) -> ScaleByPsgdKronState:
        check_matrix_params(params, "scale_by_psgd_kron")

        def moment(p: torch.Tensor | None) -> torch.Tensor | None:
            if p is None:
                return None
            dtype = dtype_of_statistics(p, precond_dtype)
            return replicated_like(p, torch.zeros(working_shape(p.shape, merge_dims), dtype=dtype, device=p.device))

        def factors(p: torch.Tensor | None) -> tuple | None:
            if p is None:
                return None
            kw = {"dtype": dtype_of_statistics(p, precond_dtype), "device": p.device}
            return tuple(
                replicated_like(
                    p, precond_init_scale ** (1 / len(shape)) * (torch.eye(n, **kw) if tri else torch.ones(n, **kw))
                )
                for shape, triangular in plan_of(p.shape).blocks
                for n, tri in zip(shape, triangular)
            )

        return ScaleByPsgdKronState(
            count=zero_count(),
            update_counter=zero_count(),
            mu=tree_map(moment, params),
            preconditioners=tree_map(factors, params),
            key=torch.tensor(key, dtype=torch.int64),
        )

    def leaf(
        step: torch.Tensor, vectors: list, rebalance: bool, g: torch.Tensor, mu: torch.Tensor, factors: tuple
    ) -> tuple:
        plan = plan_of(g.shape)
        w = g.reshape(plan.working).to(mu.dtype)
        mu = tree_update_moment(w, mu, b1, 1)
        m_hat = mu / for_leaf(bias_correction(b1, step[0] + 1), mu)
        groups = plan.grouped(factors)
        if vectors and w.numel():
            rebalance = rebalance and w.dim() > 1  # a vector's one factor has nothing to balance against
            fit_input = plan.split(m_hat if momentum_into_precond_update else w)
            groups = [
                fitted(balanced(qs) if rebalance else qs, triangular, x + DAMPING * x.abs().mean() * v, v, precond_lr)
                for qs, (_, triangular), x, v in zip(groups, plan.blocks, fit_input, vectors)
            ]
        blocks = plan.split(m_hat)
        u = plan.merge([preconditioned(qs, tri, x) for qs, (_, tri), x in zip(groups, plan.blocks, blocks)])
        if clip_update_rms:
            u = u * torch.clamp(RMS_LIMIT / (u.square().mean().sqrt() + RMS_EPS), max=1.0)
        return u.reshape(g.shape).to(g.dtype), mu, tuple(q for qs in groups for q in qs)

    def draws_for(step: torch.Tensor, indices: list[int], grads: list, mus: list) -> _Draws:
        """The step's draws for the leaves at ``indices`` of the tree (each drawing from its index's stream)."""
        shapes = [[shape for shape, _ in plan_of(g.shape).blocks] for g in grads]
        return step_draws(step, indices, shapes, mus)

    def tree_draws(step: torch.Tensor, updates: PyTree, params: PyTree | None, mu: PyTree) -> _Draws:
        """``draws_for`` every leaf with a gradient."""
        grads, (mus,), _ = flatten_state(updates, params, mu)
        present = [i for i, g in enumerate(grads) if g is not None]
        return draws_for(step, present, [grads[i] for i in present], [mus[i] for i in present])

    # the host reads and draws run outside torch.compile's graphs (dynamo does not trace torch.Generator); disabled
    # here, not where they are defined, so that importing fadam does not import dynamo
    tree_draws_outside_graphs = torch.compiler.disable(tree_draws)

    def leaves(step: torch.Tensor, indices: list[int], rows: list[tuple], draws: _Draws | None) -> list[tuple]:
        """Every leaf's step from the step's draws (``None``: this member's own, drawn here)."""
        if draws is None:
            draws = draws_for(step, indices, [g for g, _, _ in rows], [mu for _, mu, _ in rows])
        return [leaf(step, vectors, draws.rebalance, *row) for vectors, row in zip(draws.vectors, rows)]

    def update(
        updates: PyTree, state: ScaleByPsgdKronState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByPsgdKronState]:
        check_state(state, ScaleByPsgdKronState, "scale_by_psgd_kron")
        p = schedule(state.count) if callable(schedule) else schedule
        counter = state.update_counter + 1
        do_update = counter >= 1 / p
        # what every leaf reads of this step, as one tensor: under vmap each member gets its own
        step = torch.stack([state.count.to(torch.int64), do_update.to(torch.int64), state.key])
        # the draws of every leaf at once, first: under torch.compile the graph breaks there once, before the rest of
        # the step is traced; under vmap each member reads its own step and draws in ``leaves``
        draws = None
        if torch.compiler.is_compiling() or not is_batchedtensor(step):
            draws = tree_draws_outside_graphs(step, updates, params, state.mu)
        grads, (mus, factors), spec = flatten_state(updates, params, state.mu, state.preconditioners)
        new = step_together(partial(leaves, draws=draws), step, grads, [mus, factors])
        columns = [spec.unflatten(list(column)) for column in zip(*new)] if new else [spec.unflatten([])] * 3
        counter = torch.where(do_update, torch.zeros_like(counter), counter)
        return columns[0], ScaleByPsgdKronState(safe_increment(state.count), counter, *columns[1:], state.key)

    return GradientTransformation(init, update)
