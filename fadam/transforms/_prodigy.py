"""Prodigy: ``prodigy``, Adam whose step size ``d`` is estimated from the distance travelled (D-Adaptation), as
``prodigyopt.Prodigy`` with one param group."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._dispatch import functorch_wrapped, is_dtensor, real_view
from fadam._numerics import safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._validation import check_state, check_unit_interval, known_value


class ProdigyState(NamedTuple):
    # the scalars live on the params' device (the first leaf's): they follow from sums over the params, and whether a
    # step moved (which advances k) is decided there, with no host read
    count: torch.Tensor  # 0-d int32: steps taken, moved or not (what a schedule of the lr reads)
    k: torch.Tensor  # 0-d int32: steps that moved the params (prodigyopt's ``k``, the bias correction's)
    d: torch.Tensor  # 0-d float64: the step size estimate
    d_max: torch.Tensor  # 0-d float64: the largest estimate so far
    d_numerator: torch.Tensor  # 0-d float64: the running sum of weighted <g, p0 - p>
    s: PyTree  # running sum of weighted gradients, shaped like params
    p0: PyTree  # the params at init
    exp_avg: PyTree  # first moment (scaled by d); () with betas[0] == 0, which keeps none
    exp_avg_sq: PyTree  # second moment (scaled by d^2)


def _float64(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64, device=device)


def _home(leaves: list[torch.Tensor | None]) -> torch.device:
    """Where the scalars live: the first leaf's device (the CPU for a tree without tensors)."""
    return next((x.device for x in leaves if x is not None), torch.device("cpu"))


def _to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` in a form that mixes with tensors on ``device``. A plain 0-d CPU tensor mixes with tensors on any device
    and is kept; one with a hidden batch dimension (a per-member scalar under ``torch.func.vmap``) does not, nor does a
    scalar on another accelerator (leaves on several devices): those are copied (a few bytes; a copy to the CPU is
    blocking, as its value may be read right away)."""
    if x.device == device or (x.device.type == "cpu" and x.dim() == 0 and not functorch_wrapped(x)):
        return x
    return x.to(device, non_blocking=device.type != "cpu")


def _sum(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The float64 sum of the elements of ``x`` as a plain 0-d tensor on ``device``.

    ``x`` is made contiguous first, so that the elements are added in one order whatever the layout: under
    ``torch.func.vmap`` a member's elements may be strided (a batch dimension that is not the outer one, or a batched
    gradient's other layout), and a reduction over them would add in another order than the same member alone (like
    ``torch.dot``, which runs as a batched matrix product there). Only a strided input is copied. A DTensor (FSDP2)
    gives each rank's partial sum, reduced across its mesh here with ``full_tensor()``, a collective: every rank must
    take the step."""
    total = x.contiguous().sum(dtype=torch.float64)
    return _to(total.full_tensor() if is_dtensor(total) else total, device)


def _complex_like(x: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``x``, computed on ``real_view(leaf)``, in ``leaf``'s layout (complex again for a complex leaf)."""
    return torch.view_as_complex(x) if leaf.is_complex() else x


def _kept(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` (a real view) where ``active`` else ``old``, in ``old``'s dtype and layout."""
    return _complex_like(torch.where(active, new, real_view(old)).to(real_view(old).dtype), old)


def prodigy(
    lr: ScalarOrSchedule = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    beta3: float | None = None,
    weight_decay: float = 0.0,
    decouple: bool = True,
    use_bias_correction: bool = False,
    safeguard_warmup: bool = False,
    d0: float = 1e-6,
    d_coef: float = 1.0,
    growth_rate: float = math.inf,
    eps: float = 1e-8,
) -> GradientTransformation:
    r"""Prodigy: Adam with a learned step size :math:`d`, exactly as ``prodigyopt.Prodigy`` (one param group).

    With :math:`\gamma` the ``lr``, :math:`\eta_t = d_t \gamma\, c_t` (:math:`c_t = \sqrt{1-\beta_2^{t}}/(1-\beta_1^t)`
    with ``use_bias_correction``, else 1) and :math:`\beta_3 = \sqrt{\beta_2}` unless given, each step computes, over
    all leaves at once,

    .. math::
        r_t = \beta_3 r_{t-1} + \frac{d_t}{d_0} \eta_t \langle g_t, x_0 - x_t \rangle,\quad
        s_t = \beta_3 s_{t-1} + \frac{d_t}{d_0} \eta_t\, g_t,\quad
        \hat d_{t} = \kappa \frac{r_t}{\|s_t\|_1},\\
        d_{t+1} = \min\left(\max(d^{\max}_{t}, \hat d_t),\ \rho\, d'_t\right),\quad
        d'_t = \max(d_t, \hat d_t) \text{ while } d_t = d_0 \text{ (else } d_t),\\
        m_t = \beta_1 m_{t-1} + (1-\beta_1) d_t g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) d_t^2 g_t^2,\quad
        u_t = -\eta_t \left(\frac{m_t}{\sqrt{v_t} + d_{t+1}\epsilon} + \lambda x_t\right)

    where :math:`\kappa` is ``d_coef``, :math:`\rho` ``growth_rate``, :math:`d^{\max}` the running maximum of
    :math:`\hat d` (from :math:`d_0`) and :math:`\lambda` the decoupled ``weight_decay`` (with ``decouple=False`` it is
    added to the gradient instead, before everything above). With ``safeguard_warmup`` the :math:`s` increment is
    :math:`(d_t/d_0)\, d_t\, g_t` (no lr). With :math:`\beta_1 = 0` there is no first moment and the numerator is
    :math:`d_{t+1} g_t`. Sums run over every element of every leaf (complex leaves as pairs of reals), in float64
    (the products of :math:`\langle g_t, x_0 - x_t \rangle` rounded to the params' dtype, as prodigyopt's ``dot``).
    A step where :math:`\|s_t\|_1 = 0` (no nonzero gradient yet) moves nothing and leaves :math:`d` and :math:`k`
    alone, as does a step with a learning rate of 0; a ``None`` gradient leaves its leaf out of the step and the sums.
    The :math:`t` of :math:`c_t` is one more than the steps that moved before (prodigyopt's ``k``,
    ``ProdigyState.k``), while a schedule of the lr reads ``ProdigyState.count``, every step taken, as a torch.optim
    scheduler stepped after each step does: a warmup from 0 takes its first steps without moving, then moves as
    prodigyopt does under ``LambdaLR``.

    The update needs ``params`` and is written with torch ops on the whole tree (the sums make it one step over all
    leaves, not an elementwise body), with no host reads: it runs under ``torch.func.vmap``, ``grad`` and
    ``torch.compile``. The state's scalars (the counts included) live on the first param's device, where the sums
    decide whether a step moved. Params sharded as DTensors (FSDP2) take each leaf's sums across the mesh, a
    collective per sum: every rank must take the step.

    Args:
        lr: :math:`\gamma`, which multiplies the estimate (leave it at 1): a number or a schedule of the count of
            steps taken.
        betas: decays of the first and second moments.
        beta3: decay of the running sums :math:`r` and :math:`s` (default :math:`\sqrt{\beta_2}`).
        weight_decay: :math:`\lambda`.
        decouple: AdamW-style decoupled decay (scaled by :math:`\eta_t`) rather than an L2 term in the gradient.
        use_bias_correction: Adam's bias correction in :math:`\eta_t`.
        safeguard_warmup: leave the lr out of the :math:`s` increment (for warmup schedules).
        d0: the initial estimate :math:`d_0`.
        d_coef: :math:`\kappa`, the multiplier of the estimate.
        growth_rate: :math:`\rho`, the largest factor by which :math:`d` may grow in one step.
        eps: added to the denominator, times :math:`d_{t+1}`.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.prodigy()
        >>> params = [torch.tensor([1.0, -2.0])]
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     updates, state = tx.update([2 * params[0]], state, params)
        ...     params = fadam.apply_updates(params, updates)
        >>> [f"{float(d):.3g}" for d in (state.d, state.d_max)]  # d grows from d0 = 1e-6 once the params move
        ['4.9e-06', '4.9e-06']

    References:
        Mishchenko & Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner", ICML 2024.
        The ``prodigyopt`` package's ``Prodigy`` (1.1.2), whose semantics these are.
    """
    if not callable(lr) and not known_value(lr, 1.0, "lr") > 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    if beta3 is not None:
        check_unit_interval("beta3", beta3)
    if not d0 > 0.0:
        raise ValueError(f"Invalid d0 value: {d0}")
    if not eps > 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not growth_rate >= 1.0:
        raise ValueError(f"Invalid growth_rate: {growth_rate} (expected >= 1)")
    b1, b2 = betas
    b3 = math.sqrt(b2) if beta3 is None else beta3

    def init(params: PyTree) -> ProdigyState:
        def zeros(p: torch.Tensor | None) -> torch.Tensor | None:
            return None if p is None else torch.zeros_like(p)

        home = _home(check_params(params))
        clone = tree_map(lambda p: None if p is None else p.detach().clone(), params)
        exp_avg = tree_map(zeros, params) if b1 > 0 else ()
        counts = (zero_count().to(home), zero_count().to(home))
        scalars = (_float64(d0, home), _float64(d0, home), _float64(0.0, home))
        return ProdigyState(*counts, *scalars, tree_map(zeros, params), clone, exp_avg, tree_map(zeros, params))

    def update(
        updates: PyTree, state: ProdigyState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ProdigyState]:
        check_state(state, ProdigyState, "prodigy")
        if params is None:
            raise ValueError("prodigy needs params: call update(updates, state, params)")
        grads, param_leaves, spec = check_leaves(updates, params)
        s_leaves, p0_leaves, v_leaves = (spec.flatten_up_to(tree) for tree in (state.s, state.p0, state.exp_avg_sq))
        m_leaves = spec.flatten_up_to(state.exp_avg) if b1 > 0 else [None] * len(grads)
        home = _home(param_leaves)
        count, k, d, d_max, d_numerator = (_to(x, home) for x in state[:5])
        rate = lr(count) if callable(lr) else lr
        rate = _to(torch.as_tensor(rate, dtype=torch.float64), home)
        steps = k.to(torch.float64) + 1
        correction = (1 - b2**steps) ** 0.5 / (1 - b1**steps) if use_bias_correction else 1.0
        dlr = d * rate * correction
        scale = d / d0 * dlr  # prodigyopt weighs by d / d0 to keep the sums away from tiny values
        s_scale = d / d0 * d if safeguard_warmup else scale
        m_coef, v_coef = d * (1 - b1), d * d * (1 - b2)
        # the scalars each leaf's arithmetic takes, copied once per device where the leaves live elsewhere
        first: dict[torch.device, tuple[torch.Tensor, ...]] = {}

        delta_numerator = _float64(0.0, home)
        d_denom = _float64(0.0, home)
        rows = []  # per leaf: the real views of g, p and the new s, m, v
        for g, p, s, p0, m, v in zip(grads, param_leaves, s_leaves, p0_leaves, m_leaves, v_leaves):
            if g is None:
                rows.append(None)
                continue
            if g.device not in first:
                first[g.device] = tuple(_to(x, g.device) for x in (m_coef, v_coef, s_scale))
            m_scale, v_scale, s_inc = first[g.device]
            g_r, p_r = real_view(g), real_view(p)
            if weight_decay != 0 and not decouple:
                g_r = g_r + weight_decay * p_r
            # <g, p0 - p> as prodigyopt's dot: products in the params' dtype, summed (here in float64)
            delta_numerator = delta_numerator + scale * _sum(g_r * (real_view(p0) - p_r), home)
            new_m = None if m is None else real_view(m) * b1 + g_r * m_scale
            new_v = real_view(v) * b2 + g_r * g_r * v_scale
            new_s = real_view(s) * b3 + g_r * s_inc
            d_denom = d_denom + _sum(new_s.abs(), home)
            rows.append((g_r, p_r, new_s, new_m, new_v))

        # prodigyopt returns before changing d and k when no sum has grown (no gradient, or lr 0), and takes
        # no moment or sum of a step with lr 0
        moved = d_denom > 0
        numerator = d_numerator * b3 + delta_numerator
        d_hat = d_coef * numerator / torch.where(moved, d_denom, 1.0)
        d_new = torch.where(d == d0, torch.maximum(d, d_hat), d)
        new_d_max = torch.maximum(d_max, d_hat)
        d_new = torch.minimum(new_d_max, d_new * growth_rate)
        active = rate > 0
        moved = moved & active
        decay = -weight_decay * dlr
        second: dict[torch.device, tuple[torch.Tensor, ...]] = {}

        new_updates, new_s, new_m, new_v = [], [], [], []
        for row, g, s, m, v in zip(rows, grads, s_leaves, m_leaves, v_leaves):
            if row is None:
                new_updates.append(None)
                new_s.append(s)
                new_m.append(m)
                new_v.append(v)
                continue
            if g.device not in second:
                second[g.device] = tuple(
                    _to(x, g.device) for x in (d_new * eps, dlr, dlr * d_new, decay, moved, active)
                )
            d_eps, leaf_dlr, plain_dlr, leaf_decay, leaf_moved, leaf_active = second[g.device]
            g_r, p_r, s_r, m_r, v_r = row
            denom = torch.sqrt(v_r) + d_eps
            step = m_r / denom * leaf_dlr if m_r is not None else g_r / denom * plain_dlr
            if weight_decay != 0 and decouple:
                # the params prodigyopt writes (decayed, then stepped), less the params: the subtraction is exact
                # where the step is small against the params, so they are its params to the bit there
                u = p_r + p_r * leaf_decay - step - p_r
            else:
                u = -step
            # cast back: a 0-d leaf would be promoted to float64 by the 0-d float64 scalars
            u = torch.where(leaf_moved, u, 0.0).to(g_r.dtype)
            new_updates.append(_complex_like(u, g))
            new_s.append(_kept(leaf_active, s_r, s))
            new_m.append(None if m is None else _kept(leaf_active, m_r, m))
            new_v.append(_kept(leaf_active, v_r, v))

        new_state = ProdigyState(
            safe_increment(count),
            torch.where(moved, safe_increment(k), k),
            torch.where(moved, d_new, d),
            torch.where(moved, new_d_max, d_max),
            torch.where(moved, numerator, d_numerator),
            spec.unflatten(new_s),
            state.p0,
            spec.unflatten(new_m) if b1 > 0 else (),
            spec.unflatten(new_v),
        )
        return spec.unflatten(new_updates), new_state

    return GradientTransformation(init, update)
