"""Gradient centralization: ``centralize`` (each output unit's gradient minus its mean)."""

from __future__ import annotations

import torch

from fadam._base import GradientTransformation, stateless_with_tree_map


def _subtract_mean(g: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    if g.dim() > 1:
        return g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True)
    return g


def centralize() -> GradientTransformation:
    r"""Centralizes the gradient of every leaf of rank 2 or more: its mean over all axes but the first removed.

    .. math::
        u_{i\cdots} = g_{i\cdots} - \operatorname{mean}_{j\cdots}\, g_{ij\cdots}

    Vectors and 0-d leaves pass unchanged (optax's ``centralize``).

    Example:
        >>> import torch, fadam
        >>> fadam.centralize().update([torch.tensor([[1.0, 3.0], [0.0, 4.0]])], fadam.EmptyState())[0]
        [tensor([[-1.,  1.],
                [-2.,  2.]])]

    References:
        Yong et al., "Gradient Centralization: A New Optimization Technique for Deep Neural Networks", ECCV 2020.
        optax's ``optax.centralize`` (0.2.8), whose semantics these are.
    """
    return stateless_with_tree_map(_subtract_mean)
