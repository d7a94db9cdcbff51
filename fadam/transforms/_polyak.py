"""The Polyak step size: ``scale_by_polyak`` (the step that would reach the minimum value on a linear model of the
loss, from the loss's value passed to ``update``)."""

from __future__ import annotations

import torch

from fadam._base import EmptyState, GradientTransformation
from fadam._dispatch import real_view
from fadam._tree import PyTree, tree_leaves, tree_map
from fadam.transforms._validation import check_non_negative

_VARIANTS = ("sps", "sps+")


def scale_by_polyak(
    f_min: float | torch.Tensor = 0.0,
    max_learning_rate: float | torch.Tensor = 1.0,
    eps: float | torch.Tensor = 0.0,
    variant: str = "sps",
) -> GradientTransformation:
    r"""Scales updates by the Polyak step size, from the loss's ``value`` given to ``update`` (optax's
    ``scale_by_polyak``).

    .. math::
        u = g \cdot \min\left\{\frac{f(x) - f^\star}{\|g\|^2 + \epsilon},\ \gamma_{max}\right\},
        \quad\text{or } u = 0 \text{ where } \|g\|^2 + \epsilon \le \epsilon_{float64}

    :math:`\|g\|` is the global norm over all leaves. ``variant="sps+"`` takes the positive part of the gap,
    :math:`(f(x) - f^\star)_+`. ``update(updates, state, params, value=loss)``: ``value`` is required.

    Args:
        f_min: a lower bound :math:`f^\star` of the loss (0 for models that interpolate the data).
        max_learning_rate: the largest step :math:`\gamma_{max}`.
        eps: added to the squared norm.
        variant: ``"sps"`` or ``"sps+"``.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_polyak()
        >>> g = [torch.tensor([0.5, 0.5])]  # at loss 0.25: the step 0.25 / 0.5
        >>> tx.update(g, tx.init(None), value=torch.tensor(0.25))[0]
        [tensor([0.2500, 0.2500])]

    References:
        Loizou et al., "Stochastic Polyak Step-size for SGD: An Adaptive Learning Rate for Fast Convergence",
        AISTATS 2021. Garrigos et al., "Function Value Learning: Adaptive Learning Rates Based on the Polyak
        Stepsize and Function Splitting in ERM", 2023 (``sps+``). optax's ``optax.scale_by_polyak`` (0.2.8), whose
        semantics these are.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"Invalid variant: {variant!r} (expected one of {_VARIANTS})")
    check_non_negative("max_learning_rate", max_learning_rate)
    check_non_negative("eps", eps)

    def update(
        updates: PyTree,
        state: EmptyState,
        params: PyTree | None = None,
        *,
        value: float | torch.Tensor | None = None,
        **_: object,
    ) -> tuple[PyTree, EmptyState]:
        if value is None:
            raise ValueError("scale_by_polyak needs the loss: call update(updates, state, params, value=loss)")
        leaves = [u for u in tree_leaves(updates) if u is not None]
        if not leaves:
            return updates, state
        device = leaves[0].device
        squared = sum((real_view(u).square().sum().to(device) for u in leaves[1:]), real_view(leaves[0]).square().sum())
        loss = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
        gap = (loss.to(device) - f_min).to(squared.dtype)  # in the loss's precision, then the updates' (optax's)
        if variant == "sps+":
            gap = torch.clamp(gap, min=0.0)
        denominator = squared + eps
        step = torch.where(
            denominator <= torch.finfo(torch.float64).eps,  # optax's guard against dividing by zero
            torch.zeros((), dtype=squared.dtype, device=device),
            torch.clamp(gap / denominator, max=max_learning_rate),
        )
        return tree_map(lambda u: None if u is None else u * step.to(u.device, u.real.dtype), updates), state

    return GradientTransformation(lambda params: EmptyState(), update)
