"""Adam's scaling: ``scale_by_adam`` (with torch.optim's AMSGrad and optax's Nesterov variants)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._dispatch import is_plain, is_plain_type
from fadam._numerics import (
    bias_correction,
    dtype_for,
    for_leaf,
    host_number,
    known_positive,
    mark_positive,
    no_zero_on_cpu,
    safe_increment,
    safe_sqrt,
    zero_count,
)
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._validation import check_non_negative, check_state, check_unit_interval


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # first moment, shaped like params
    nu: PyTree  # second moment, shaped like params


class ScaleByAmsgradState(NamedTuple):
    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    nu_max: PyTree  # running maximum of nu


def scale_by_adam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    *,
    amsgrad: bool = False,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    moment_requires_grad: bool = False,
) -> GradientTransformation:
    r"""Rescales updates by Adam's bias-corrected moment estimates.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
        u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}

    With ``amsgrad``, :math:`v_t` in the denominator is replaced by :math:`\max_{s\le t} v_s` taken on the raw (not
    bias-corrected) moments, as ``torch.optim.Adam(amsgrad=True)`` does. With ``nesterov``, the numerator is
    :math:`\beta_1 m_t/(1-\beta_1^{t+1}) + (1-\beta_1) g_t/(1-\beta_1^t)` (Dozat, 2016; optax's ``nesterov``).
    Complex leaves are treated as pairs of reals (``torch.view_as_real``), exactly like torch.optim, so the second
    moment is kept per real and imaginary component. A ``None`` update skips its leaf: moments untouched, update
    ``None``.

    The update is differentiable in everything: gradients, moments and the hyperparameters, which may be 0-d tensors
    requiring grad (hypergradients). When autograd records the step, the square root is ``safe_sqrt``, whose
    derivatives stay finite where the second moment is exactly zero (a gradient entry that is zero but depends on
    the params), so meta-gradients through many steps are finite even with ``eps_root = 0``; the values are the same.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (optax's ``eps_root``): smooths meta-gradients where the second
            moment is tiny.
        amsgrad: use the running maximum of the second moment (torch.optim's AMSGrad).
        nesterov: Nesterov momentum in the first moment.
        mu_dtype: dtype of the first moment (default: the param's).
        nu_dtype: dtype of the second moment (default: the param's).
        moment_requires_grad: ``init`` creates the moments as leaf tensors requiring grad, so meta-gradients flow
            into the initial state (torchopt's ``moment_requires_grad``).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_adam()
        >>> params = {"w": torch.zeros(3)}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -2.0, 0.0])}, tx.init(params))
        >>> updates["w"].round(decimals=4)
        tensor([ 1., -1.,  0.])

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.
        Reddi et al., "On the Convergence of Adam and Beyond", 2018.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)

    def init(params: PyTree) -> ScaleByAdamState | ScaleByAmsgradState:
        check_params(params)

        def zeros(p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
            return torch.zeros_like(p, dtype=dtype_for(p, dtype), requires_grad=moment_requires_grad)

        mu = tree_map(lambda p: zeros(p, mu_dtype), params)
        nu = tree_map(lambda p: zeros(p, nu_dtype), params)
        if amsgrad:
            return ScaleByAmsgradState(zero_count(), mu, nu, tree_map(lambda p: zeros(p, nu_dtype), params))
        return ScaleByAdamState(zero_count(), mu, nu)

    # Bias corrections of recent plain step counts, as tensors and floats: an inner loop of K steps meets the same
    # counts in every outer iteration, and computing them takes a dozen 0-d ops.
    recent: dict[int, tuple[tuple, tuple]] = {}

    def _corrections(count: torch.Tensor) -> tuple[tuple, tuple]:
        key = host_number(count) if not isinstance(b1, torch.Tensor) and not isinstance(b2, torch.Tensor) else None
        cacheable = isinstance(key, int)  # a plain count: not traced, batched or compiled
        if cacheable and key in recent:
            return recent[key]
        bc1 = bias_correction(b1, count)
        bc2_sqrt = torch.sqrt(bias_correction(b2, count))
        bc1_next = bias_correction(b1, safe_increment(count)) if nesterov else None
        corrections = (bc1, bc2_sqrt, bc1_next)
        result = corrections, tuple(host_number(x) for x in corrections)
        if cacheable:
            if len(recent) >= 64:
                recent.clear()
            recent[key] = result
        return result

    def update(
        updates: PyTree, state: ScaleByAdamState | ScaleByAmsgradState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByAdamState | ScaleByAmsgradState]:
        check_state(state, ScaleByAmsgradState if amsgrad else ScaleByAdamState, "scale_by_adam")
        grads, mus, spec = check_leaves(updates, state.mu, like_what="the Adam state (params)")
        nus = spec.flatten_up_to(state.nu)
        nu_maxes = spec.flatten_up_to(state.nu_max) if amsgrad else [None] * len(nus)
        count = safe_increment(state.count)
        corrections, numbers = _corrections(count)
        # ``numbers``: the corrections as Python floats where reading them is allowed (not traced, batched or
        # differentiable). Ops mixing a param-shaped tensor with a float round alike and skip a dtype conversion.
        # Not for 0-d leaves, which promote with 0-d float64 tensors (as they do under vmap) and must stay equal.
        use_numbers = not any(isinstance(n, torch.Tensor) for n in numbers)
        # zero-free second moments stay zero-free (see _graph_sqrt)
        positivity_inherited = (
            not amsgrad and not isinstance(b2, torch.Tensor) and b2 > 0.5 and not torch.compiler.is_compiling()
        )

        new_updates, new_mus, new_nus, new_nu_maxes = [], [], [], []
        for g, mu, nu, nu_max in zip(grads, mus, nus, nu_maxes):
            if g is None:  # torch.optim skips a param without a gradient and leaves its state alone
                new_updates.append(None)
                new_mus.append(mu)
                new_nus.append(nu)
                new_nu_maxes.append(nu_max)
                continue
            out_dtype = g.dtype
            if use_numbers and g.dim():
                bc1_g, bc2_sqrt_g, bc1_next_g = numbers
            else:
                bc1_g, bc2_sqrt_g, bc1_next_g = (for_leaf(x, g) for x in corrections)
            complex_leaf = g.is_complex()
            gr = torch.view_as_real(g) if complex_leaf else g
            mur = torch.view_as_real(mu) if complex_leaf else mu
            nur = torch.view_as_real(nu) if complex_leaf else nu
            mu_new = mur.lerp(_as(gr, mur.dtype), _cast(1 - b1, mur.dtype))
            g_nu = _as(gr, nur.dtype)
            # Fresh intermediates that no backward formula saves are rewritten in place: same arithmetic, fewer new
            # param-sized buffers (which cost page faults on large tensors). Plain tensors only (under vmap a fresh
            # tensor may lack its operand's batch dimension), not 0-d leaves (their out-of-place ops promote with the
            # float64 bias corrections, as under vmap, and must stay equal). With no graph to record (``reuse``), the
            # square root and the quotient are rewritten too.
            fresh_in_place = (
                is_plain_type(g_nu) and is_plain_type(nur) and g_nu.dim() > 0 and not isinstance(b2, torch.Tensor)
            )
            reuse = fresh_in_place and not (torch.is_grad_enabled() and (g_nu.requires_grad or nur.requires_grad))
            if isinstance(b2, torch.Tensor):  # addcmul's value must be a number; this rounds the same way
                nu_new = torch.addcmul(nur * b2.to(nur.dtype), g_nu * (1 - b2).to(nur.dtype), g_nu)
            elif fresh_in_place:
                nu_new = (nur * b2).addcmul_(g_nu, g_nu, value=1 - b2)
            else:
                nu_new = torch.addcmul(nur * b2, g_nu, g_nu, value=1 - b2)
            denom_source = nu_new
            if amsgrad:
                nu_max_new = torch.maximum(torch.view_as_real(nu_max) if complex_leaf else nu_max, nu_new)
                denom_source = nu_max_new
            if not isinstance(eps_root, torch.Tensor) and eps_root == 0.0:
                if reuse:
                    denom = denom_source.sqrt().div_(bc2_sqrt_g).add_(eps)  # torch.optim's order of operations
                else:
                    root = _graph_sqrt(nur, nu_new, denom_source, positivity_inherited and fresh_in_place)
                    root = root / bc2_sqrt_g
                    denom = root.add_(eps) if fresh_in_place else root + eps
            else:  # the argument is >= eps_root > 0: the plain sqrt is smooth
                denom = torch.sqrt(denom_source / (bc2_sqrt_g * bc2_sqrt_g) + eps_root) + eps
            if nesterov:
                numer = mu_new * (b1 / bc1_next_g) + _as(gr, mu_new.dtype) * ((1 - b1) / bc1_g)
            else:
                numer = mu_new / bc1_g
            u = _as(numer.div_(denom) if reuse else numer / denom, gr.dtype)
            if complex_leaf:
                u, mu_new, nu_new = (
                    torch.view_as_complex(u),
                    torch.view_as_complex(mu_new),
                    torch.view_as_complex(nu_new),
                )
                if amsgrad:
                    nu_max_new = torch.view_as_complex(nu_max_new)
            new_updates.append(_as(u, out_dtype))
            new_mus.append(mu_new)
            new_nus.append(nu_new)
            new_nu_maxes.append(nu_max_new if amsgrad else None)

        mu_tree, nu_tree = spec.unflatten(new_mus), spec.unflatten(new_nus)
        if amsgrad:
            return spec.unflatten(new_updates), ScaleByAmsgradState(
                count, mu_tree, nu_tree, spec.unflatten(new_nu_maxes)
            )
        return spec.unflatten(new_updates), ScaleByAdamState(count, mu_tree, nu_tree)

    return GradientTransformation(init, update)


def _graph_sqrt(nu: torch.Tensor, nu_new: torch.Tensor, source: torch.Tensor, inherits: bool) -> torch.Tensor:
    """``sqrt(source)``, by ``safe_sqrt`` when autograd records it, skipping the zero check where it is implied.

    ``nu_new = b2 * nu + (1 - b2) * g * g`` is at least the rounded ``b2 * nu``, which is > 0 wherever ``nu`` is > 0
    when ``b2 > 1/2`` (the product of the smallest subnormal and such a ``b2`` rounds up to it). So once a second
    moment was seen without a zero, every later one is zero-free too and takes the plain sqrt (same values, same
    derivatives) with no reduction over it: in an inner loop of K steps, only the first step checks. ``inherits``
    says that this argument holds (float ``b2 > 1/2``, ``source`` is ``nu_new``, plain tensors, not compiling).
    """
    if is_plain(source):  # no graph: only autograd needs the safe sqrt
        return torch.sqrt(source)
    if inherits and (known_positive(nu) or no_zero_on_cpu(nu_new)):
        mark_positive(nu_new)
        return torch.sqrt(nu_new)
    return safe_sqrt(source)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the call when it would be a no-op (it costs as much as a small op on the meta path)."""
    return x if x.dtype == dtype else x.to(dtype)


def _cast(weight: float | torch.Tensor, dtype: torch.dtype) -> float | torch.Tensor:
    """A tensor hyperparameter in the leaf's dtype (``lerp`` needs matching dtypes); a float as it is."""
    return weight.to(dtype) if isinstance(weight, torch.Tensor) else weight
