"""Adam's scaling: ``scale_by_adam`` (with torch.optim's AMSGrad and optax's Nesterov variants)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, for_leaf, safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, tree_map
from fadam.transforms._validation import check_non_negative, check_unit_interval


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
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    amsgrad: bool = False,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
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

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root; keeps meta-gradients finite where the second moment is zero.
        amsgrad: use the running maximum of the second moment (torch.optim's AMSGrad).
        nesterov: Nesterov momentum in the first moment.
        mu_dtype: dtype of the first moment (default: the param's).
        nu_dtype: dtype of the second moment (default: the param's).

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
        mu = tree_map(lambda p: torch.zeros_like(p, dtype=mu_dtype), params)
        nu = tree_map(lambda p: torch.zeros_like(p, dtype=nu_dtype), params)
        if amsgrad:
            return ScaleByAmsgradState(
                zero_count(), mu, nu, tree_map(lambda p: torch.zeros_like(p, dtype=nu_dtype), params)
            )
        return ScaleByAdamState(zero_count(), mu, nu)

    def update(
        updates: PyTree, state: ScaleByAdamState | ScaleByAmsgradState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByAdamState | ScaleByAmsgradState]:
        grads, mus, spec = check_leaves(updates, state.mu, like_what="the Adam state (params)")
        nus = spec.flatten_up_to(state.nu)
        nu_maxes = spec.flatten_up_to(state.nu_max) if amsgrad else [None] * len(nus)
        count = safe_increment(state.count)
        bc1 = bias_correction(b1, count)
        bc2_sqrt = torch.sqrt(bias_correction(b2, count))
        bc1_next = bias_correction(b1, safe_increment(count)) if nesterov else None

        new_updates, new_mus, new_nus, new_nu_maxes = [], [], [], []
        for g, mu, nu, nu_max in zip(grads, mus, nus, nu_maxes):
            if g is None:  # torch.optim skips a param without a gradient and leaves its state alone
                new_updates.append(None)
                new_mus.append(mu)
                new_nus.append(nu)
                new_nu_maxes.append(nu_max)
                continue
            out_dtype = g.dtype
            bc1_g, bc2_sqrt_g, bc1_next_g = (for_leaf(x, g) for x in (bc1, bc2_sqrt, bc1_next))
            complex_leaf = g.is_complex()
            gr = torch.view_as_real(g) if complex_leaf else g
            mur = torch.view_as_real(mu) if complex_leaf else mu
            nur = torch.view_as_real(nu) if complex_leaf else nu
            mu_new = mur.lerp(gr.to(mur.dtype), 1 - b1)
            g_nu = gr.to(nur.dtype)
            nu_new = torch.addcmul(nur * b2, g_nu, g_nu, value=1 - b2)
            denom_source = nu_new
            if amsgrad:
                nu_max_new = torch.maximum(torch.view_as_real(nu_max) if complex_leaf else nu_max, nu_new)
                denom_source = nu_max_new
            if eps_root == 0.0:
                denom = denom_source.sqrt() / bc2_sqrt_g + eps  # torch.optim's order of operations
            else:
                denom = torch.sqrt(denom_source / (bc2_sqrt_g * bc2_sqrt_g) + eps_root) + eps
            if nesterov:
                numer = mu_new * (b1 / bc1_next_g) + gr.to(mu_new.dtype) * ((1 - b1) / bc1_g)
            else:
                numer = mu_new / bc1_g
            u = (numer / denom).to(gr.dtype)
            if complex_leaf:
                u, mu_new, nu_new = (
                    torch.view_as_complex(u),
                    torch.view_as_complex(mu_new),
                    torch.view_as_complex(nu_new),
                )
                if amsgrad:
                    nu_max_new = torch.view_as_complex(nu_max_new)
            new_updates.append(u.to(out_dtype))
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
