"""Muon's direction: momentum, then an approximate orthogonalisation of each matrix by a Newton-Schulz iteration
(``scale_by_muon``)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch._C._functorch import is_batchedtensor

from fadam._base import EmptyState, GradientTransformation
from fadam._dispatch import is_dtensor
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree, check_params, tree_flatten, tree_paths
from fadam.combinators._chain import chain
from fadam.transforms._validation import UnsupportedParamsError, check_non_negative

# the quintic's coefficients of Jordan et al. (and torch.optim.Muon's defaults)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


class ScaleByMuonState(NamedTuple):
    mu: PyTree  # momentum (torch.optim.Muon's momentum_buffer)


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    r"""The approximate orthogonal factor of the matrix ``g``, in bfloat16, as torch.optim.Muon computes it.

    From :math:`X_0 = G / \max(\|G\|_F, \epsilon)` (spectral norm at most 1), ``steps`` times
    :math:`X \leftarrow aX + (bA + cA^2)X` with :math:`A = XX^\top`. A tall matrix is iterated as its transpose, so
    that :math:`A` is the smaller Gram matrix; the transposes stay views, which keeps torch's matmul layouts (and
    hence its rounding)."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(torch.bfloat16)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2, one rounding
        x = torch.addmm(x, polynomial, x, beta=a)  # a X + (b A + c A^2) X
    return x.mT if tall else x


class _PerMember(torch.autograd.Function):
    """``newton_schulz`` under ``torch.func.vmap``, member by member. vmap's rule for ``addmm`` rounds ``beta * C``
    and the product separately, where ``addmm`` rounds once: batched members would leave torch's numbers (by ~1e-3
    in bfloat16) and each other's."""

    @staticmethod
    def forward(g: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
        return newton_schulz(g, coefficients, steps, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (g,) = ctx.saved_tensors
        _, pullback = torch.func.vjp(lambda x: newton_schulz(x, *ctx.args), g)
        return pullback(grad.to(torch.bfloat16))[0], None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, g: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> tuple:
        members = g.movedim(in_dims[0], 0).unbind(0)  # a nested vmap's members are batched again: apply recurses
        return torch.stack([_PerMember.apply(m, coefficients, steps, eps) for m in members]), 0


def _orthogonal_factor(g: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
    if not torch.compiler.is_compiling() and is_batchedtensor(g):
        return _PerMember.apply(g, coefficients, steps, eps)
    return newton_schulz(g, coefficients, steps, eps)


def shape_factor(shape: torch.Size, adjust_lr_fn: str | None) -> float:
    r"""torch.optim.Muon's factor on the lr for a matrix of ``shape``: Jordan's :math:`\sqrt{\max(1, A/B)}` or, for
    ``"match_rms_adamw"``, Moonlight's :math:`0.2\sqrt{\max(A, B)}` (an update RMS like AdamW's)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def check_matrix(leaf: torch.Tensor, path: str, what: str) -> None:
    """Refuses a leaf Muon cannot orthogonalise, naming its path."""
    if leaf.dim() != 2:
        raise ValueError(
            f"Muon only supports 2D parameters whereas we found a parameter with size: {leaf.size()} (it takes 2-D "
            f"matrices only: {what} {path} has shape {tuple(leaf.shape)}); give it to another transform "
            "(fadam.muon_with_adamw, fadam.partition)"
        )
    if leaf.is_complex():
        raise UnsupportedParamsError(
            f"Muon does not support complex parameters (it takes real matrices only: {what} {path} is {leaf.dtype})"
        )


def _orthogonalised(u: torch.Tensor, coefficients: tuple, steps: int, eps: float, adjust: str | None) -> torch.Tensor:
    """``u``'s orthogonal factor in ``u``'s dtype, times the shape factor. A DTensor is gathered whole first (the
    factor of a shard is not a shard of the factor), and each rank keeps its own part of the result."""
    if is_dtensor(u):
        from torch.distributed.tensor import DTensor, Replicate

        mesh = u.device_mesh
        whole = _orthogonalised(u.full_tensor(), coefficients, steps, eps, adjust)
        replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return replicated.redistribute(mesh, u.placements)  # Replicate -> Shard slices locally: no communication
    o = _orthogonal_factor(u, coefficients, steps, eps).to(u.dtype)
    factor = shape_factor(u.shape, adjust)
    return o if factor == 1.0 else o * factor


def _orthogonalise(coefficients: tuple, steps: int, eps: float, adjust_lr_fn: str | None) -> GradientTransformation:
    """The Newton-Schulz stage: an ordinary (opaque) transform of whole matrices."""

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, Any]:
        leaves, spec = tree_flatten(updates)
        if any(u is not None and (u.dim() != 2 or u.is_complex()) for u in leaves):
            for u, path in zip(leaves, tree_paths(updates)):  # every leaf is checked before any is computed
                if u is not None:
                    check_matrix(u, path, "the update at")
        new = [None if u is None else _orthogonalised(u, coefficients, steps, eps, adjust_lr_fn) for u in leaves]
        return spec.unflatten(new), state

    return GradientTransformation(init, update)


def _momentum(momentum: float | torch.Tensor, nesterov: bool, mu_dtype: torch.dtype | None) -> GradientTransformation:
    """Muon's momentum, per element: torch.optim.Muon's ``buf.lerp_(g, 1 - momentum)`` and, with Nesterov,
    ``g.lerp(buf, momentum)``."""

    def prologue(count: torch.Tensor | None) -> dict[str, float | torch.Tensor]:
        return {"one_minus_momentum": 1 - momentum, "momentum": momentum}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any) -> tuple:
        g = o.cast(g, mu)
        mu = o.lerp(mu, g, s.one_minus_momentum)
        return (o.lerp(g, mu, s.momentum) if nesterov else mu), mu

    slot = Slot("mu", mu_dtype)
    return elementwise(Elementwise("scale_by_muon", ScaleByMuonState, (slot,), False, prologue, body))


def check_muon_args(
    momentum: float | torch.Tensor, ns_coefficients: tuple, eps: float, ns_steps: int, adjust_lr_fn: str | None
) -> None:
    check_non_negative("momentum", momentum)
    check_non_negative("eps", eps)
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients!r}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"Invalid ns_steps: {ns_steps} (expected 0 <= ns_steps < 100)")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(
            f"Invalid adjust_lr_fn: Adjust learning rate function {adjust_lr_fn} is not supported (expected one of "
            f"{ADJUST_LR_FNS})"
        )


def scale_by_muon(
    momentum: float | torch.Tensor = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
    *,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Replaces each matrix's update by the orthogonalised momentum, scaled for its shape (Muon's direction).

    .. math::
        m_t = \mu\, m_{t-1} + (1-\mu)\, g_t,\qquad
        \tilde m_t = \begin{cases} (1-\mu)\, g_t + \mu\, m_t & \text{nesterov} \ m_t & \text{otherwise}\end{cases}
        ,\qquad u_t = s(A, B)\ \mathrm{NS}_k^{(a,b,c)}\!\left(\tilde m_t\right)

    where :math:`\mathrm{NS}_k` is ``ns_steps`` Newton-Schulz iterations :math:`X \leftarrow aX + (bA + cA^2)X`,
    :math:`A = XX^\top`, from :math:`X_0 = \tilde m_t / \max(\|\tilde m_t\|_F, \epsilon)`, computed in bfloat16 (the
    result has singular values near 1, not exactly 1), and :math:`s(A, B)` is torch.optim.Muon's lr factor for an
    :math:`A \times B` matrix: :math:`\sqrt{\max(1, A/B)}`, or :math:`0.2\sqrt{\max(A, B)}` for
    ``adjust_lr_fn="match_rms_adamw"``. The update has the param's dtype.

    ``chain(momentum, orthogonalise)``: the momentum is declared per element (it joins the generated kernel of the
    transforms before it), the orthogonalisation is an ordinary transform of whole matrices (torch matmuls), which
    ends that kernel's segment; the transforms after it fuse again.

    **FSDP2 / DTensor.** The orthogonal factor of a shard is not a shard of the orthogonal factor, so a DTensor update
    is gathered whole (``full_tensor()``, an all-gather: every rank must step), orthogonalised on every rank, and each
    rank keeps its own shard of the result (a redistribution from ``Replicate`` to the update's placements, which
    slices locally). The momentum stays sharded. The results equal a single process's bit for bit.

    Every leaf must be a real 2-D matrix: ``init`` raises naming the first other leaf's path (biases, norms and
    embeddings go to another transform: ``fadam.muon_with_adamw``).

    Args:
        momentum: the momentum :math:`\mu`.
        nesterov: Nesterov momentum (torch.optim.Muon's default).
        ns_coefficients: the quintic's coefficients :math:`(a, b, c)`.
        eps: lower bound :math:`\epsilon` on the norm the matrix is divided by.
        ns_steps: the number :math:`k` of Newton-Schulz iterations (below 100, as torch.optim.Muon requires).
        adjust_lr_fn: the shape factor: ``None`` or ``"original"`` (Jordan's), ``"match_rms_adamw"`` (Moonlight's).
        mu_dtype: dtype of the momentum (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_muon(momentum=0.0)
        >>> u, _ = tx.update([torch.diag(torch.tensor([3.0, 0.5]))], tx.init([torch.zeros(2, 2)]))
        >>> u[0].diagonal()  # both singular values moved near 1
        tensor([0.7305, 1.0469])

    References:
        Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024 (blog post).
        Liu et al., "Muon is Scalable for LLM Training", 2025.
    """
    check_muon_args(momentum, ns_coefficients, eps, ns_steps, adjust_lr_fn)
    inner = chain(
        _momentum(momentum, nesterov, mu_dtype), _orthogonalise(tuple(ns_coefficients), ns_steps, eps, adjust_lr_fn)
    )

    def init(params: PyTree) -> tuple[PyTree, ...]:
        leaves = check_params(params)
        for leaf, path in zip(leaves, tree_paths(params)):
            if leaf is not None:
                check_matrix(leaf, path, "param")
        return inner.init(params)

    return GradientTransformation(init, inner.update)
