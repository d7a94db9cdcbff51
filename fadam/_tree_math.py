"""optax's ``tree_utils`` math under optax's names and argument names, on pytrees of torch tensors.

``None`` leaves (a missing gradient) pass through as ``None`` in the leaf-wise functions and are skipped by the
reductions (``tree_sum``, ``tree_vdot``, ``tree_norm``, ...), as optax's ``jax.tree.map`` skips them. Reductions
return 0-d tensors on the first leaf's device. Complex leaves are treated as optax treats them: ``tree_vdot``
conjugates its first argument, norms take the modulus.

``tree_add`` and ``tree_scale`` keep fadam's own signatures (``fadam._tree``); ``tree_add_scale`` is optax's
``tree_x + scalar * tree_y``. ``incremental_update`` and ``periodic_update`` are optax's updates of a slow copy of
the params (a Polyak average, a target network).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fadam._numerics import bias_correction, dtype_for, host_number
from fadam._tree import PyTree, tree_leaves, tree_map

__all__ = [
    "incremental_update",
    "periodic_update",
    "tree_add_scalar_mul",
    "tree_add_scale",
    "tree_batch_shape",
    "tree_bias_correction",
    "tree_clip",
    "tree_conj",
    "tree_div",
    "tree_full_like",
    "tree_l1_norm",
    "tree_l2_norm",
    "tree_linf_norm",
    "tree_max",
    "tree_min",
    "tree_mul",
    "tree_norm",
    "tree_ones_like",
    "tree_real",
    "tree_size",
    "tree_sum",
    "tree_update_infinity_moment",
    "tree_update_moment",
    "tree_update_moment_per_elem_norm",
    "tree_vdot",
    "tree_where",
]


def _leafwise(fn: Callable[..., Any]) -> Callable[..., Any]:
    def apply(x: Any, *rest: Any) -> Any:
        return None if x is None else fn(x, *rest)

    return apply


def _present(tree: PyTree) -> list[Any]:
    return [x for x in tree_leaves(tree) if x is not None]


def _reduce(values: list[torch.Tensor], op: Callable[[Any, Any], Any], initial: float) -> torch.Tensor:
    """Folds 0-d per-leaf results with ``op`` on the first one's device; ``initial`` (a 0-d tensor) if none."""
    if not values:
        return torch.tensor(initial)
    device = values[0].device
    total = values[0]
    for value in values[1:]:
        total = op(total, value.to(device))
    return total


def tree_mul(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """``tree_x * tree_y`` leaf by leaf.

    >>> tree_mul({"a": torch.tensor([2.0, 3.0])}, {"a": torch.tensor([4.0, 5.0])})
    {'a': tensor([ 8., 15.])}
    """
    return tree_map(_leafwise(lambda x, y: x * y), tree_x, tree_y)


def tree_div(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """``tree_x / tree_y`` leaf by leaf.

    >>> tree_div({"a": torch.tensor([2.0, 3.0])}, {"a": torch.tensor([4.0, 6.0])})
    {'a': tensor([0.5000, 0.5000])}
    """
    return tree_map(_leafwise(lambda x, y: x / y), tree_x, tree_y)


def tree_add_scale(tree_x: PyTree, scalar: float | torch.Tensor, tree_y: PyTree) -> PyTree:
    """``tree_x + scalar * tree_y`` leaf by leaf (``None`` where ``tree_x`` has ``None``).

    >>> tree_add_scale([torch.tensor([1.0, 1.0])], 0.5, [torch.tensor([2.0, 4.0])])
    [tensor([2., 3.])]
    """
    return tree_map(_leafwise(lambda x, y: x + scalar * y), tree_x, tree_y)


tree_add_scalar_mul = tree_add_scale  # optax's older name, kept (deprecated) in optax 0.2.8


def tree_vdot(tree_x: PyTree, tree_y: PyTree) -> torch.Tensor:
    """Inner product ``sum(conj(x) * y)`` over all leaves, as a 0-d tensor (``tree_x`` is conjugated).

    >>> tree_vdot({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0, 2.0])},
    ...           {"a": torch.tensor([-1.0, -1.0]), "b": torch.tensor([1.0, 1.0])})
    tensor(0.)
    """

    def vdot(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        if x is None or y is None:
            return None
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        dtype = torch.promote_types(x.dtype, y.dtype)
        return torch.vdot(x.to(dtype).reshape(-1), y.to(dtype).reshape(-1))

    return _reduce(_present(tree_map(vdot, tree_x, tree_y)), torch.add, 0.0)


def tree_sum(tree: PyTree, associative_reduction: bool = False) -> torch.Tensor:
    """Sum of all elements of all leaves, as a 0-d tensor (``associative_reduction``, a JAX compile-time option, is
    accepted and has no effect: leaves are summed in order).

    >>> tree_sum({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)})
    tensor(6.)
    """
    del associative_reduction
    return _reduce([torch.sum(torch.as_tensor(x)) for x in _present(tree)], torch.add, 0.0)


def tree_max(tree: PyTree) -> torch.Tensor:
    """Largest element over all leaves, as a 0-d tensor (empty leaves are skipped; ``-inf`` if there is none).

    >>> tree_max({"a": torch.tensor([1.0, 5.0]), "b": torch.tensor([-2.0])})
    tensor(5.)
    """
    leaves = [torch.as_tensor(x) for x in _present(tree)]
    return _reduce([torch.amax(x) for x in leaves if x.numel()], torch.maximum, -math.inf)


def tree_min(tree: PyTree) -> torch.Tensor:
    """Smallest element over all leaves, as a 0-d tensor (empty leaves are skipped; ``inf`` if there is none).

    >>> tree_min({"a": torch.tensor([1.0, 5.0]), "b": torch.tensor([-2.0])})
    tensor(-2.)
    """
    leaves = [torch.as_tensor(x) for x in _present(tree)]
    return _reduce([torch.amin(x) for x in leaves if x.numel()], torch.minimum, math.inf)


def tree_size(tree: PyTree) -> int:
    """Total number of elements over all leaves, a Python int.

    >>> tree_size({"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": None})
    10
    """
    return sum(torch.as_tensor(x).numel() for x in _present(tree))


def tree_conj(tree: PyTree) -> PyTree:
    """Complex conjugate of each leaf (a new tensor for a complex leaf; a real leaf is returned as it is).

    >>> tree_conj([torch.tensor([1 + 2j])])
    [tensor([1.-2.j])]
    """
    return tree_map(_leafwise(lambda x: torch.conj_physical(x) if x.is_complex() else x), tree)


def tree_real(tree: PyTree) -> PyTree:
    """Real part of each leaf (``torch.real``: a view of a complex leaf; a real leaf is returned as it is).

    >>> tree_real([torch.tensor([1 + 2j]), torch.tensor([3.0])])
    [tensor([1.]), tensor([3.])]
    """
    return tree_map(_leafwise(torch.real), tree)


def _abs_sq(x: torch.Tensor) -> torch.Tensor:
    return x.real * x.real + x.imag * x.imag if x.is_complex() else x * x


def tree_norm(tree: PyTree, ord: int | float | str | None = None, squared: bool = False) -> torch.Tensor:
    """Vector norm of order ``ord`` (``None`` or 2, 1, ``inf``/``'inf'``/``'infinity'``) over all leaves, complex
    leaves by modulus, as a 0-d tensor; ``squared`` returns its square.

    >>> tree_norm({"a": torch.tensor([3.0]), "b": torch.tensor([-4.0])})
    tensor(5.)
    >>> tree_norm({"a": torch.tensor([3.0]), "b": torch.tensor([-4.0])}, ord=1)
    tensor(7.)
    """
    if ord is None or ord == 2:
        sqnorm = tree_sum([torch.sum(_abs_sq(torch.as_tensor(x))) for x in _present(tree)])
        return sqnorm if squared else torch.sqrt(sqnorm)
    if ord == 1:
        norm = tree_sum([torch.abs(torch.as_tensor(x)) for x in _present(tree)])
    elif ord == math.inf or ord in ("inf", "infinity"):
        norm = tree_max([torch.abs(torch.as_tensor(x)) for x in _present(tree)])
    else:
        raise ValueError(f"Unsupported ord: {ord}")
    return norm * norm if squared else norm


def tree_l1_norm(tree: PyTree) -> torch.Tensor:
    """L1 norm over all leaves (``tree_norm(tree, ord=1)``; deprecated in optax 0.2.8).

    >>> tree_l1_norm([torch.tensor([1.0, -2.0])])
    tensor(3.)
    """
    return tree_norm(tree, ord=1)


def tree_l2_norm(tree: PyTree, squared: bool = False) -> torch.Tensor:
    """L2 norm over all leaves (``tree_norm(tree, squared=squared)``; deprecated in optax 0.2.8).

    >>> tree_l2_norm([torch.tensor([3.0, -4.0])], squared=True)
    tensor(25.)
    """
    return tree_norm(tree, squared=squared)


def tree_linf_norm(tree: PyTree) -> torch.Tensor:
    """Infinity norm over all leaves (``tree_norm(tree, ord='inf')``; deprecated in optax 0.2.8).

    >>> tree_linf_norm([torch.tensor([1.0, -2.0])])
    tensor(2.)
    """
    return tree_norm(tree, ord="inf")


def tree_batch_shape(tree: PyTree, shape: tuple[int, ...] = ()) -> PyTree:
    """Each leaf broadcast to leading batch dimensions ``shape`` (``torch.broadcast_to``: an expanded view).

    >>> tree_batch_shape({"a": torch.tensor([1.0, 2.0])}, (3,))["a"].shape
    torch.Size([3, 2])
    """
    return tree_map(_leafwise(lambda x: torch.broadcast_to(x, (*shape, *x.shape))), tree)


def tree_ones_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """An all-ones tree of the same structure (``dtype``'s precision; a complex leaf stays complex).

    >>> tree_ones_like({"a": torch.zeros(2), "b": None})
    {'a': tensor([1., 1.]), 'b': None}
    """
    return tree_map(_leafwise(lambda x: torch.ones_like(x, dtype=dtype_for(x, dtype))), tree)


def tree_full_like(
    tree: PyTree, fill_value: float | complex | torch.Tensor, dtype: torch.dtype | None = None
) -> PyTree:
    """A tree of the same structure with every element ``fill_value`` (``dtype`` as in ``tree_ones_like``).

    >>> tree_full_like([torch.zeros(2)], 7.0)
    [tensor([7., 7.])]
    """
    return tree_map(_leafwise(lambda x: torch.full_like(x, fill_value, dtype=dtype_for(x, dtype))), tree)


def tree_clip(
    tree: PyTree,
    min_value: float | torch.Tensor | None = None,
    max_value: float | torch.Tensor | None = None,
) -> PyTree:
    """Each leaf clipped to ``[min_value, max_value]`` (a bound that is ``None`` is not applied).

    >>> tree_clip([torch.tensor([-2.0, 0.5, 3.0])], -1.0, 1.0)
    [tensor([-1.0000,  0.5000,  1.0000])]
    """
    if min_value is None and max_value is None:
        return tree_map(_leafwise(lambda x: x), tree)
    return tree_map(_leafwise(lambda x: torch.clamp(x, min_value, max_value)), tree)


def tree_where(condition: bool | torch.Tensor, tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """``torch.where(condition, x, y)`` leaf by leaf: ``tree_x`` where ``condition`` holds, else ``tree_y``.

    >>> tree_where(torch.tensor(False), [torch.tensor([1.0])], [torch.tensor([2.0])])
    [tensor([2.])]
    """

    def where(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cond = condition if isinstance(condition, torch.Tensor) else torch.tensor(bool(condition), device=x.device)
        return torch.where(cond, x, y)

    return tree_map(_leafwise(where), tree_x, tree_y)


def tree_update_moment(updates: PyTree, moments: PyTree, decay: float | torch.Tensor, order: int | float) -> PyTree:
    """Exponential moving average of the ``order``-th moment: ``(1 - decay) * g**order + decay * t``.

    >>> tree_update_moment([torch.tensor([2.0])], [torch.tensor([1.0])], 0.5, 2)
    [tensor([2.5000])]
    """
    return tree_map(_leafwise(lambda g, t: (1 - decay) * (g**order) + decay * t), updates, moments)


def tree_update_infinity_moment(
    updates: PyTree, moments: PyTree, decay: float | torch.Tensor, eps: float | torch.Tensor
) -> PyTree:
    """Exponential moving average of the infinity norm: ``maximum(|g| + eps, decay * t)``.

    >>> tree_update_infinity_moment([torch.tensor([-1.0, 0.1])], [torch.tensor([0.5, 2.0])], 0.5, 0.0)
    [tensor([1., 1.])]
    """
    return tree_map(_leafwise(lambda g, t: torch.maximum(torch.abs(g) + eps, decay * t)), updates, moments)


def tree_update_moment_per_elem_norm(
    updates: PyTree, moments: PyTree, decay: float | torch.Tensor, order: int | float
) -> PyTree:
    """EMA of the ``order``-th moment of each element's modulus: ``g**order`` for a real ``g``,
    ``|g|**order`` (as ``(re**2 + im**2)**(order / 2)``) for a complex one.

    >>> tree_update_moment_per_elem_norm([torch.tensor([3 + 4j])], [torch.tensor([1.0])], 0.5, 2)
    [tensor([13.])]
    """

    def orderth_norm(g: torch.Tensor) -> torch.Tensor:
        if not g.is_complex():
            return g**order
        half_order = order / 2
        if float(half_order).is_integer():
            half_order = int(half_order)
        return _abs_sq(g) ** half_order

    return tree_map(_leafwise(lambda g, t: (1 - decay) * orderth_norm(g) + decay * t), updates, moments)


def tree_bias_correction(moment: PyTree, decay: float | torch.Tensor, count: int | torch.Tensor) -> PyTree:
    """Each leaf divided by ``1 - decay**count`` (computed in float64, then divided in the leaf's precision).

    >>> tree_bias_correction([torch.tensor([1.0])], 0.5, torch.tensor(1))
    [tensor([2.])]
    """
    correction = bias_correction(decay, torch.as_tensor(count))

    def correct(t: torch.Tensor) -> torch.Tensor:
        real = t.dtype.to_real() if t.is_complex() else t.dtype
        return t / correction.to(device=t.device, dtype=real)

    return tree_map(_leafwise(correct), moment)


def incremental_update(new_tensors: PyTree, old_tensors: PyTree, step_size: float | torch.Tensor) -> PyTree:
    r"""A moving average of the params (Polyak averaging), leaf by leaf:
    :math:`\bar p \leftarrow \tau p + (1-\tau)\bar p` (``None`` where ``new_tensors`` has ``None``).

    Args:
        new_tensors: the latest params :math:`p`.
        old_tensors: the average :math:`\bar p`.
        step_size: the weight :math:`\tau` of the latest params.

    Example:
        >>> import torch, fadam
        >>> fadam.incremental_update([torch.tensor([1.0])], [torch.tensor([3.0])], 0.25)
        [tensor([2.5000])]

    References:
        Polyak & Juditsky, "Acceleration of Stochastic Approximation by Averaging", SIAM J. Control Optim., 1992.
        optax's ``optax.incremental_update`` (0.2.8).
    """
    return tree_map(_leafwise(lambda new, old: step_size * new + (1.0 - step_size) * old), new_tensors, old_tensors)


def periodic_update(
    new_tensors: PyTree, old_tensors: PyTree, steps: int | torch.Tensor, update_period: int | torch.Tensor
) -> PyTree:
    r"""A slow copy of the params, replaced by the latest ones every ``update_period`` steps: ``new_tensors`` where
    :math:`\text{steps} \bmod \text{update\_period} = 0`, else ``old_tensors`` (the trees themselves, not copies).

    Args:
        new_tensors: the latest params.
        old_tensors: the slow copy.
        steps: the steps taken by the latest params.
        update_period: how many steps apart the copy is refreshed.

    Example:
        >>> import torch, fadam
        >>> fadam.periodic_update([torch.ones(1)], [torch.zeros(1)], steps=6, update_period=3)
        [tensor([1.])]

    References:
        Mnih et al., "Human-level control through deep reinforcement learning", Nature 2015 (target networks).
        optax's ``optax.periodic_update`` (0.2.8).
    """
    due = torch.remainder(torch.as_tensor(steps), torch.as_tensor(update_period)) == 0
    known = host_number(due)
    if not isinstance(known, torch.Tensor):  # a plain count: pick a tree, as optax's lax.cond does
        return new_tensors if known else old_tensors
    return tree_where(due, new_tensors, old_tensors)  # batched, traced or on a device: selected without a sync
