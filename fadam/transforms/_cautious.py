"""Cautious updates: ``cautious(inner)`` keeps the inner transform's update only where it agrees in sign with the
gradient."""

from __future__ import annotations

from typing import Any

import torch

from fadam._base import GradientTransformation
from fadam._dispatch import is_dtensor
from fadam._tree import PyTree, tree_flatten
from fadam.transforms._validation import check_non_negative


def _reduced(count: torch.Tensor) -> torch.Tensor:
    """A sum over a leaf, summed across the ranks first on a sharded (DTensor) leaf: the one-process value. DTensor
    would otherwise divide each rank's partial sum and add the quotients, which rounds differently."""
    if not is_dtensor(count):
        return count
    from torch.distributed.tensor import Replicate

    return count.redistribute(count.device_mesh, [Replicate() if q.is_partial() else q for q in count.placements])


def _masked(u: torch.Tensor | None, g: torch.Tensor | None, min_fraction: float) -> torch.Tensor | None:
    if u is None or g is None:
        return u
    real_u = torch.view_as_real(u) if u.is_complex() else u  # per real and imaginary component
    real_g = torch.view_as_real(g) if g.is_complex() else g
    agrees = real_u * real_g > 0
    count = agrees.sum(dtype=torch.promote_types(real_u.dtype, torch.float32))  # exact: a count of elements
    fraction = _reduced(count) / agrees.numel()
    # rescaled by that fraction, so that the masked update keeps the leaf's magnitude on average
    scale = agrees.to(real_u.dtype) / fraction.clamp(min=min_fraction).to(real_u.dtype)
    masked = real_u * scale
    return torch.view_as_complex(masked) if u.is_complex() else masked


def cautious(inner: GradientTransformation, min_fraction: float = 1e-3) -> GradientTransformation:
    r"""Masks ``inner``'s update where its sign disagrees with the gradient's, rescaled by the fraction kept.

    .. math::
        \phi_t = \mathbb{1}[u_t \odot g_t > 0],\qquad
        u'_t = u_t \odot \frac{\phi_t}{\max(\operatorname{mean}(\phi_t), f_{min})}

    where :math:`u_t` is ``inner``'s update of the gradient :math:`g_t` and the mean is over the leaf's elements (the
    real and imaginary components of a complex leaf separately): the Cautious optimizers, C-AdamW and C-Lion. This
    is the normalisation of the authors' C-AdamW (``mask / mask.mean().clamp(min=1e-3)``); their C-Lion divides by
    ``(sum + 1) / numel`` instead, and the paper leaves the scaling open. ``inner`` must give updates in the
    gradient's direction (``scale_by_adam``, ``scale_by_lion``...), so wrap it before the learning rate: the state is
    ``inner``'s, the wrapper adds none. Decoupled weight decay chained after it is not masked, as in the authors'
    code. The mask needs the whole update, so ``inner`` runs as it would alone (its kernels included), then the
    mask, as torch ops.

    Args:
        inner: the transform whose updates are masked.
        min_fraction: the lower bound :math:`f_{min}` of the kept fraction in the rescaling (the reference's 1e-3).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.cautious(fadam.scale_by_sign())
        >>> tx.update([torch.tensor([1.0, -2.0, 0.0, 3.0])], tx.init(None))[0]  # 3 of 4 kept: scaled by 4/3
        [tensor([ 1.3333, -1.3333,  0.0000,  1.3333])]

    References:
        Liang et al., "Cautious Optimizers: Improving Training with One Line of Code", 2024.
        The authors' code, github.com/kyleliang919/C-Optim (``c_adamw.py``), whose normalisation this is.
    """
    check_non_negative("min_fraction", min_fraction)

    def update(updates: PyTree, state: Any, params: PyTree | None = None, **extra_args: Any) -> tuple[PyTree, Any]:
        new_updates, state = inner.update(updates, state, params, **extra_args)
        leaves, spec = tree_flatten(new_updates)
        masked = [_masked(u, g, min_fraction) for u, g in zip(leaves, spec.flatten_up_to(updates))]
        return spec.unflatten(masked), state

    return GradientTransformation(inner.init, update)
