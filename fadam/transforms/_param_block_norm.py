"""``scale_by_param_block_norm``: each leaf's update scaled by its param's norm (``scale_by_param_block_rms``'s
sibling, in fadam/transforms/_block_scaling.py)."""

from __future__ import annotations

import torch

from fadam._base import EmptyState, GradientTransformation
from fadam._optax_numerics import safe_norm
from fadam._program import Elementwise, elementwise
from fadam.transforms._block_scaling import _no_scalars, _scaled_by
from fadam.transforms._validation import check_non_negative


def scale_by_param_block_norm(min_scale: float = 1e-3) -> GradientTransformation:
    r"""Scales each leaf's update by the L2 norm of its param, at least ``min_scale``.

    .. math::
        u = g \cdot \max\left(\|p\|, s_{min}\right)

    (``safe_norm``: the gradient of the scale is 0, not NaN, at a zero param).

    Args:
        min_scale: the lower bound :math:`s_{min}`.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_param_block_norm()
        >>> tx.update([torch.ones(2)], tx.init(None), [torch.tensor([3.0, -4.0])])[0]
        [tensor([5., 5.])]

    References:
        optax's ``optax.scale_by_param_block_norm`` (0.2.8).
    """
    check_non_negative("min_scale", min_scale)

    def reduce_leaf(g: torch.Tensor, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scale": safe_norm(p, min_scale).to(g.real.dtype)}

    return elementwise(
        Elementwise(
            "scale_by_param_block_norm",
            EmptyState,
            (),
            False,
            _no_scalars,
            _scaled_by("scale"),
            True,
            None,
            reduce_leaf,
        )
    )
