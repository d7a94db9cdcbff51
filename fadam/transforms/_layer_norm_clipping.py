"""``per_example_layer_norm_clip``: DP-SGD's clipping of each example's gradient with a bound per layer (leaf),
``per_example_global_norm_clip`` applied to each leaf alone."""

from __future__ import annotations

import torch

from fadam._tree import PyTree, tree_flatten
from fadam.transforms._adaptive_clipping import per_example_global_norm_clip


def per_example_layer_norm_clip(
    grads: PyTree, global_l2_norm_clip: float | torch.Tensor, uniform: bool = True
) -> tuple[PyTree, PyTree]:
    r"""Clips each example's gradient leaf by leaf (layer by layer), then sums over the examples. Not a transform: a
    function of a batch of per-example gradients.

    Leaf :math:`i` of :math:`K` (:math:`D_i` elements per example of :math:`D` in all) is clipped as
    ``per_example_global_norm_clip`` clips a whole gradient, to the bound

    .. math::
        C_i = \frac{C}{\sqrt K}\ \ (\texttt{uniform}),\qquad C_i = C \sqrt{D_i / D}\ \ \text{otherwise}

    so that the clipped example's norm over all leaves is at most :math:`C`.

    Args:
        grads: per-example gradients, each leaf of shape ``(batch, ...)``.
        global_l2_norm_clip: the bound :math:`C`.
        uniform: the same bound for every leaf, else bounds by the leaves' sizes.

    Returns:
        The clipped gradients summed over the examples, and per leaf the number of examples clipped there (a 0-d
        int64 tensor), each a tree like ``grads``.

    Example:
        >>> import torch, fadam
        >>> grads = [torch.tensor([[0.0, 0.0, 0.0], [0.0, 3.0, 4.0], [4.0, 0.0, 3.0], [3.0, 4.0, 0.0]])]
        >>> fadam.per_example_layer_norm_clip(grads, 1.25)
        ([tensor([1.7500, 1.7500, 1.7500])], [tensor(3)])

    References:
        McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018. optax's
        ``optax.per_example_layer_norm_clip`` (0.2.8), whose semantics these are.
    """
    leaves, spec = tree_flatten(grads)
    if not leaves or any(not isinstance(x, torch.Tensor) or x.dim() == 0 for x in leaves):
        raise ValueError(
            "Unlike other transforms, `per_example_layer_norm_clip` expects `grads` to have a batch dimension in "
            "the 0th axis."
        )
    if uniform:
        bounds = [global_l2_norm_clip * (1.0 / len(leaves)) ** 0.5 for _ in leaves]
    else:
        total = sum(x[0].numel() for x in leaves)
        bounds = [global_l2_norm_clip * (x[0].numel() / total) ** 0.5 for x in leaves]
    results = [per_example_global_norm_clip(x, bound) for x, bound in zip(leaves, bounds)]
    return spec.unflatten([r[0] for r in results]), spec.unflatten([r[1] for r in results])
