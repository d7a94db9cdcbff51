"""Constraints on the params enforced through the updates: ``keep_params_nonnegative``."""

from __future__ import annotations

from typing import Any

from fadam._base import EmptyState, GradientTransformation
from fadam._program import Elementwise, elementwise


def keep_params_nonnegative() -> GradientTransformation:
    r"""Modifies the updates so that the params they are added to stay non-negative.

    .. math::
        u = \begin{cases} -p & \text{where } p + g < 0 \\ g & \text{otherwise} \end{cases}

    The params must be non-negative to begin with (optax's ``keep_params_nonnegative``): a negative param is not
    moved back. Needs params; complex leaves are treated as pairs of reals.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.keep_params_nonnegative()
        >>> tx.update([torch.tensor([-3.0, -1.0])], tx.init(None), [torch.tensor([2.0, 2.0])])[0]
        [tensor([-2., -1.])]

    References:
        optax's ``optax.keep_params_nonnegative`` (0.2.8), whose semantics these are.
    """

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        p = o.cast(p, g)
        return (o.where(p + g < 0.0, -p, g),)

    return elementwise(
        Elementwise("keep_params_nonnegative", EmptyState, (), False, lambda count: {}, body, uses_params=True)
    )
