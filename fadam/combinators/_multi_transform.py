"""optax's name for ``partition``: ``multi_transform``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

from fadam._base import GradientTransformation
from fadam._tree import PyTree
from fadam.combinators._masking import partition


def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: PyTree | Callable[[PyTree], PyTree],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformation:
    """Applies a different transform to each group of leaves: ``partition`` under optax's name and signature.

    Args:
        transforms: label -> transform.
        param_labels: a tree of labels shaped like the params, a prefix of one, or a callable ``params -> labels``.
        mask_compatible_extra_args: give each group's transform the leaves of its group of the extra arguments of
            ``update`` that have the updates' tree structure; the others reach it whole.

    Example:
        >>> import torch, fadam
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx = fadam.multi_transform({"sgd": fadam.sgd(0.1), "zero": fadam.set_to_zero()}, {"w": "sgd", "b": "zero"})
        >>> updates, _ = tx.update(params, tx.init(params), params)
        >>> updates["w"], updates["b"]
        (tensor([-0.1000, -0.1000]), tensor([0.]))

    References:
        optax's ``optax.multi_transform`` (0.2.8).
    """
    return partition(transforms, param_labels, mask_compatible_extra_args=mask_compatible_extra_args)
