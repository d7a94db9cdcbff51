"""ADOPT's scaling: ``scale_by_adopt`` (Adam with the second moment of the previous step, applied before the
momentum)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import host_number
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByAdoptState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # momentum of the normalized gradients
    nu: PyTree  # second moment of the gradients, up to the current step


def _fourth_root(step: torch.Tensor) -> torch.Tensor:
    return step**0.25


def scale_by_adopt(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.9999,
    eps: float | torch.Tensor = 1e-6,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[torch.Tensor], float | torch.Tensor] = _fourth_root,
) -> GradientTransformation:
    r"""Rescales updates by ADOPT: gradients normalized by the previous second moment, then averaged (momentum).

    .. math::
        \tilde g_t = \operatorname{clip}_{c_t}\!\left(\frac{g_t}{\max(\sqrt{v_{t-1}}, \epsilon)}\right),\quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1)\tilde g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
        u_t = m_t

    The first step only initialises the second moment, :math:`v_1 = g_1^2`, and gives a zero update
    (:math:`m_1 = m_0 = 0`). :math:`\operatorname{clip}_c` clamps to :math:`[-c, c]`, with
    :math:`c_t` = ``clip_value_fn`` of the steps taken before this one (:math:`(t-1)^{1/4}` by default). With
    ``nesterov``, :math:`u_t = \beta_1 m_t + (1-\beta_1)\tilde g_t` (0 on the first step too). Complex leaves are
    treated as pairs of reals.

    Args:
        b1: decay of the momentum.
        b2: decay of the second moment.
        eps: lower bound of the square root of the second moment.
        mu_dtype: dtype of the momentum (default: the param's).
        nesterov: Nesterov momentum in the update.
        use_clipping: clip the normalized gradient (the paper's stabilisation of the first steps).
        clip_value_fn: the clipping bound, called with the steps taken so far as a 0-d float64 tensor.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_adopt()
        >>> u, state = tx.update([torch.tensor([2.0, -1.0])], tx.init([torch.zeros(2)]))
        >>> u, state.nu  # the first step initialises the second moment only
        ([tensor([0., 0.])], [tensor([4., 1.])])
        >>> tx.update([torch.tensor([1.0, 4.0])], state)[0]  # 0.1 * clip(g / sqrt(nu), -1, 1)
        [tensor([0.0500, 0.1000])]

    References:
        Taniguchi et al., "ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal Rate", NeurIPS 2024.
        optax's ``optax.contrib.scale_by_adopt`` (0.2.8), whose semantics these are.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        steps = host_number(count)
        # the first step (no steps taken) sets v to g^2 and keeps m: decays of 0 and 1 there (optax's)
        if isinstance(steps, torch.Tensor):  # traced, batched or compiled: a select on the count

            def pick(first: float, later: float | torch.Tensor) -> float | torch.Tensor:
                return torch.where(steps == 0, first, torch.as_tensor(later, dtype=torch.float64))

        else:

            def pick(first: float, later: float | torch.Tensor) -> float | torch.Tensor:
                return first if steps == 0 else later

        scalars = {
            "one_minus_b1": pick(0.0, 1 - b1),
            "b2": pick(0.0, b2),
            "one_minus_b2": pick(1.0, 1 - b2),
            "eps": eps,
        }
        if use_clipping:
            bound = torch.as_tensor(clip_value_fn(count.to(torch.float64)), dtype=torch.float64)
            scalars |= {"clip": bound, "neg_clip": -bound}
        return {name: host_number(value) for name, value in scalars.items()}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g_nu = o.cast(g, nu)
        normalized = g_nu / o.clamp(o.sqrt(nu), s.eps, math.inf)  # by the second moment before this step
        if use_clipping:
            normalized = o.clamp(normalized, s.neg_clip, s.clip)
        normalized = o.cast(normalized, mu)
        mu = o.lerp(mu, normalized, s.one_minus_b1)
        nu = o.addcmul(nu * s.b2, g_nu, g_nu, s.one_minus_b2)
        update = o.lerp(mu, normalized, s.one_minus_b1) if nesterov else mu
        return update, mu, nu

    slots = (Slot("mu", mu_dtype), Slot("nu", nonnegative=True))
    return elementwise(Elementwise("scale_by_adopt", ScaleByAdoptState, slots, True, prologue, body))
