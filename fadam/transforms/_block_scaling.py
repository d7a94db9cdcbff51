"""Per-block (per-leaf) rescaling by norms: ``scale_by_trust_ratio`` (LAMB) and ``scale_by_param_block_rms``
(Adafactor). A block is one leaf: a weight matrix, a bias vector."""

from __future__ import annotations

from typing import Any

import torch

from fadam._base import EmptyState, GradientTransformation
from fadam._program import Elementwise, elementwise
from fadam.transforms._validation import check_non_negative


def _safe_norm(x: torch.Tensor, min_norm: float) -> torch.Tensor:
    return torch.clamp(torch.linalg.vector_norm(x), min=min_norm)


def block_rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square of all elements of ``x`` (complex by modulus), as a 0-d real tensor."""
    return torch.linalg.vector_norm(x) / (max(x.numel(), 1) ** 0.5)


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> GradientTransformation:
    r"""Scales each leaf's update by the ratio of its param's norm to the update's norm (LAMB's trust ratio).

    .. math::
        u = g \cdot \frac{c\, \max(\|p\|, n_{min})}{\max(\|g\|, n_{min}) + \epsilon},
        \quad\text{or } u = g \text{ where either norm is zero}

    Args:
        min_norm: lower bound on both norms.
        trust_coefficient: the factor :math:`c`.
        eps: added to the update's norm.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_trust_ratio()
        >>> tx.update([torch.tensor([3.0, 4.0])], tx.init(None), [torch.tensor([0.0, 10.0])])[0]
        [tensor([6., 8.])]

    References:
        You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", 2020.
    """
    check_non_negative("min_norm", min_norm)
    check_non_negative("trust_coefficient", trust_coefficient)
    check_non_negative("eps", eps)

    def reduce_leaf(g: torch.Tensor, p: torch.Tensor) -> dict[str, torch.Tensor]:
        param_norm = _safe_norm(p, min_norm)
        update_norm = _safe_norm(g, min_norm)
        ratio = trust_coefficient * param_norm / (update_norm + eps)
        ratio = torch.where((param_norm == 0) | (update_norm == 0), torch.ones_like(ratio), ratio)
        return {"ratio": ratio.to(g.real.dtype)}

    return elementwise(
        Elementwise(
            "scale_by_trust_ratio", EmptyState, (), False, _no_scalars, _scaled_by("ratio"), True, None, reduce_leaf
        )
    )


def _no_scalars(count: torch.Tensor | None) -> dict:
    return {}


def _scaled_by(name: str) -> Any:
    """The body ``u * s.<name>``."""

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (g * getattr(s, name),)

    return body


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    r"""Scales each leaf's update by the root mean square of its param, at least ``min_scale``.

    .. math::
        u = g \cdot \max\left(\operatorname{rms}(p), s_{min}\right)

    Args:
        min_scale: the lower bound :math:`s_{min}`.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_param_block_rms()
        >>> tx.update([torch.ones(2)], tx.init(None), [torch.tensor([3.0, -3.0])])[0]
        [tensor([3., 3.])]

    References:
        Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018 (relative step size).
    """
    check_non_negative("min_scale", min_scale)

    def reduce_leaf(g: torch.Tensor, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scale": torch.clamp(block_rms(p), min=min_scale).to(g.real.dtype)}

    return elementwise(
        Elementwise(
            "scale_by_param_block_rms", EmptyState, (), False, _no_scalars, _scaled_by("scale"), True, None, reduce_leaf
        )
    )
