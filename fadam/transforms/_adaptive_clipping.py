"""Clipping relative to the params or per example: ``adaptive_grad_clip`` (unit-wise, NFNets') and
``per_example_global_norm_clip`` (DP-SGD's)."""

from __future__ import annotations

import torch

from fadam._base import EmptyState, GradientTransformation
from fadam._tree import PyTree, check_leaves, tree_flatten
from fadam.transforms._validation import check_non_negative


def unitwise_norm(x: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """The L2 norm of each unit of ``x``, broadcast to ``x``'s shape: over ``axis`` if given, else over everything
    for vectors and scalars, over the input axes (all but the last) for linear (IO), multi-head (3-d) and convolution
    (HWIO, DHWIO) kernels, as optax's ``unitwise_norm``."""
    if axis is not None:
        dims: tuple[int, ...] | None = (axis,) if isinstance(axis, int) else tuple(axis)
    elif x.squeeze().dim() <= 1:
        dims = None
    elif x.dim() in (2, 3):
        dims = (0,)
    elif x.dim() in (4, 5):
        dims = tuple(range(x.dim() - 1))
    else:
        raise ValueError(
            f"Expected parameter with shape in {{1, 2, 3, 4, 5}}, got {tuple(x.shape)}. "
            "Use axis parameter to specify reduction axes for other shapes."
        )
    magnitude = x.abs() if x.is_complex() else x
    squared = (magnitude * magnitude).sum(dim=dims, keepdim=True) if dims else (magnitude * magnitude).sum()
    return torch.broadcast_to(torch.sqrt(squared), x.shape)


def adaptive_grad_clip(
    clipping: float | torch.Tensor, eps: float | torch.Tensor = 1e-3, axis: int | tuple[int, ...] | None = None
) -> GradientTransformation:
    r"""Clips each unit's gradient where it is large relative to its param's norm (adaptive gradient clipping).

    Per unit (see ``unitwise_norm``):

    .. math::
        u = \begin{cases} g & \text{where } \|g\| < \lambda \max(\|p\|, \epsilon) \\
        g\, \dfrac{\lambda \max(\|p\|, \epsilon)}{\max(\|g\|, 10^{-6})} & \text{otherwise} \end{cases}

    Needs params.

    Args:
        clipping: the largest ratio :math:`\lambda` of a unit's gradient norm to its param norm.
        eps: the smallest param norm (zero-initialised params can still move).
        axis: the axes a unit's norm runs over (default: by rank, as optax).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adaptive_grad_clip(0.1)
        >>> tx.update([torch.tensor([3.0, 4.0])], tx.init(None), [torch.tensor([0.0, 10.0])])[0]
        [tensor([0.6000, 0.8000])]

    References:
        Brock et al., "High-Performance Large-Scale Image Recognition Without Normalization", ICML 2021. optax's
        ``optax.adaptive_grad_clip`` (0.2.8), whose semantics these are.
    """
    check_non_negative("clipping", clipping)
    check_non_negative("eps", eps)

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None, **_: object) -> tuple:
        if params is None:
            raise ValueError("adaptive_grad_clip needs params: call update(updates, state, params)")
        grads, param_leaves, spec = check_leaves(updates, params)
        clipped = []
        for g, p in zip(grads, param_leaves):
            if g is None:
                clipped.append(None)
                continue
            g_norm = unitwise_norm(g, axis)
            max_norm = clipping * torch.clamp(unitwise_norm(p, axis), min=eps).to(g_norm.dtype)
            scaled = g * (max_norm / torch.clamp(g_norm, min=1e-6))
            clipped.append(torch.where(g_norm < max_norm, g, scaled))
        return spec.unflatten(clipped), state

    return GradientTransformation(lambda params: EmptyState(), update)


def per_example_global_norm_clip(grads: PyTree, l2_norm_clip: float | torch.Tensor) -> tuple[PyTree, torch.Tensor]:
    r"""Clips each example's gradient to a global L2 norm of at most ``l2_norm_clip``, then sums over the examples
    (DP-SGD's clipping). Not a transform: a function of a batch of per-example gradients.

    Every leaf's first axis is the example :math:`i`; :math:`\|g_i\|` is the norm over all leaves of example
    :math:`i`.

    .. math::
        \sum_i g_i \min\left(1, \frac{C}{\|g_i\|}\right)

    (a zero gradient keeps the factor 1).

    Args:
        grads: per-example gradients, each leaf of shape ``(batch, ...)``.
        l2_norm_clip: the largest norm :math:`C` of one example's gradient.

    Returns:
        The clipped gradients summed over the examples (each leaf without its first axis), and the number of
        examples that were clipped (a 0-d int64 tensor).

    Example:
        >>> import torch, fadam
        >>> grads = [torch.tensor([[3.0, 4.0], [0.3, 0.4]])]  # two examples, of norms 5 and 0.5
        >>> summed, clipped = fadam.per_example_global_norm_clip(grads, 1.0)
        >>> summed, clipped
        ([tensor([0.9000, 1.2000])], tensor(1))

    References:
        Abadi et al., "Deep Learning with Differential Privacy", CCS 2016. optax's
        ``optax.per_example_global_norm_clip`` (0.2.8), whose semantics these are.
    """
    leaves, spec = tree_flatten(grads)
    if not leaves or any(not isinstance(x, torch.Tensor) or x.dim() == 0 for x in leaves):
        raise ValueError(
            "Unlike other transforms, `per_example_global_norm_clip` expects `grads` to have a batch dimension in "
            "the 0th axis."
        )
    batch = leaves[0].shape[0]
    if any(x.shape[0] != batch for x in leaves):
        raise ValueError("per_example_global_norm_clip: every leaf needs the same batch size in its first axis")
    device = leaves[0].device
    squares = [torch.linalg.vector_norm(x.reshape(batch, -1), dim=1).to(device) ** 2 for x in leaves]
    norms = torch.sqrt(sum(squares[1:], squares[0]))
    multipliers = torch.nan_to_num(torch.clamp(l2_norm_clip / norms, max=1.0), nan=1.0)
    clipped_sum = [torch.tensordot(multipliers.to(x.device, x.real.dtype), x, dims=1) for x in leaves]
    return spec.unflatten(clipped_sum), torch.sum(multipliers < 1.0)
