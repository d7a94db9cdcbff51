"""The signs of the updates: ``scale_by_sign`` (signSGD's and Signum's step direction)."""

from __future__ import annotations

from typing import Any

from fadam._base import EmptyState, GradientTransformation
from fadam._program import Elementwise, elementwise


def scale_by_sign() -> GradientTransformation:
    r"""Replaces every update element by its sign (optax's ``scale_by_sign``).

    .. math::
        u_t = \operatorname{sign}(g_t)

    As ``torch.sign``, a zero and a NaN give 0. Complex leaves take the sign of the real and imaginary parts
    separately (as ``scale_by_lion``; ``jnp.sign`` would give :math:`g/|g|`).

    Args:
        None: the transform has no hyperparameters; ``sign_sgd`` and ``signum`` scale its signs by a learning rate.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_sign()
        >>> tx.update([torch.tensor([0.3, -2.0, 0.0])], tx.init([torch.zeros(3)]))[0]
        [tensor([ 1., -1.,  0.])]

    References:
        Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", 2018.
    """

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (o.sign(g),)

    return elementwise(Elementwise("scale_by_sign", EmptyState, (), False, lambda count: {}, body))
