"""Microbatching: ``microbatch`` evaluates a function on slices of a batch one after another and combines the outputs
(``AccumulationType``: sum, mean, running mean, concatenation, or an ``Accumulator`` of one's own), as optax's
``optax.microbatching``."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

__all__ = ["AccumulationType", "Accumulator", "microbatch", "reshape_batch_axis"]

# jax's pytrees: None is an empty subtree (an output such as ``(loss, None)`` has one leaf), as in optax


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """How the outputs of the microbatches are combined, leaf by leaf:

    .. code-block:: python

        carry = init(x_0)
        for i in range(n):
            carry = update(carry, x_i, i)
        return finalize(carry)

    Attributes:
        init: ``f(x_0) -> carry`` from the first microbatch's output (its shape and dtype; optax passes a
            ``ShapeDtypeStruct``).
        update: ``f(carry, x_i, i) -> carry``.
        finalize: ``f(carry) -> result``.
    """

    init: Callable[[torch.Tensor], Any]
    update: Callable[[Any, torch.Tensor, int], Any]
    finalize: Callable[[Any], Any]


class AccumulationType(enum.Enum):
    """The built-in ways to combine the microbatches' outputs."""

    MEAN = enum.auto()  # the sum divided by the number of microbatches
    SUM = enum.auto()
    RUNNING_MEAN = enum.auto()  # the mean of the microbatches evaluated (``num_real_microbatches`` of them)
    CONCAT = enum.auto()  # the outputs concatenated along axis 0, in the batch's order


def _floating_zeros(value: torch.Tensor) -> torch.Tensor:
    if not value.is_floating_point():
        raise ValueError(f"MEAN and RUNNING_MEAN accumulate floating-point values, got a {value.dtype} output")
    return torch.zeros_like(value)


def _running_update(carry: torch.Tensor, value: torch.Tensor, index: int) -> torch.Tensor:
    keep = index / (index + 1)  # the mean of i + 1 values from that of i
    return carry * keep + value * (1 - keep)


def _concat(num_microbatches: int) -> Accumulator:
    def init(value: torch.Tensor) -> torch.Tensor:
        return value.new_zeros((num_microbatches, *value.shape))

    def update(carry: torch.Tensor, value: torch.Tensor, index: int) -> torch.Tensor:
        # out of place, so that a vmapped or differentiated value can be written
        return carry.index_copy(0, torch.tensor([index], device=carry.device), value.unsqueeze(0))

    def finalize(carry: torch.Tensor) -> torch.Tensor:
        # row k of microbatch i was row i + n k of the batch (reshape_batch_axis)
        return carry.transpose(0, 1).reshape(-1, *carry.shape[2:])

    return Accumulator(init, update, finalize)


def _builtin(kind: AccumulationType, num_microbatches: int) -> Accumulator:
    if kind is AccumulationType.SUM:
        return Accumulator(torch.zeros_like, lambda carry, value, _: carry + value, lambda carry: carry)
    if kind is AccumulationType.MEAN:
        return Accumulator(_floating_zeros, lambda carry, value, _: carry + value, lambda c: c / num_microbatches)
    if kind is AccumulationType.RUNNING_MEAN:
        return Accumulator(_floating_zeros, _running_update, lambda carry: carry)
    return _concat(num_microbatches)


def _accumulators(accumulator: Any, num_microbatches: int) -> Any:
    """The tree of ``Accumulator`` s, each a built-in one where an ``AccumulationType`` is given."""

    def canonical(acc: Any) -> Accumulator:
        if isinstance(acc, Accumulator):
            return acc
        if isinstance(acc, AccumulationType):
            return _builtin(acc, num_microbatches)
        raise ValueError(f"Unknown accumulator: {acc!r} (expected an AccumulationType or an Accumulator)")

    return optree.tree_map(canonical, accumulator)


def _init(accumulators: Any, output: Any) -> Any:
    """Each accumulator's carry for every leaf of its subtree of ``output`` (the tree is a prefix of the output)."""
    return optree.tree_map(lambda acc, sub: optree.tree_map(acc.init, sub), accumulators, output)


def _update(accumulators: Any, carry: Any, output: Any, index: int) -> Any:
    def per_subtree(acc: Accumulator, sub: Any, sub_carry: Any) -> Any:
        # mapped over the output's leaves: a carry of one's own may be any object per leaf (a tuple, say)
        return optree.tree_map(lambda value, c: acc.update(c, value, index), sub, sub_carry)

    return optree.tree_map(per_subtree, accumulators, output, carry)


def _finalize(accumulators: Any, carry: Any, output: Any) -> Any:
    def per_subtree(acc: Accumulator, sub: Any, sub_carry: Any) -> Any:
        return optree.tree_map(lambda _, c: acc.finalize(c), sub, sub_carry)

    return optree.tree_map(per_subtree, accumulators, output, carry)


def reshape_batch_axis(tree: Any, microbatch_size: int, axis: int = 0) -> Any:
    """Splits the batch axis of every leaf into ``(num_microbatches, microbatch_size)`` at the same place, in
    column-major order: microbatch ``i`` holds the batch's rows ``i, i + n, i + 2n, ...`` (``n`` microbatches), as
    optax's, whose column-major split keeps a sharding of the batch axis on the new ``microbatch_size`` axis.

    Args:
        tree: a tree of tensors, each with a batch axis.
        microbatch_size: the rows of each microbatch.
        axis: the batch axis.

    Example:
        >>> import torch, fadam
        >>> fadam.reshape_batch_axis(torch.arange(6), 2)
        tensor([[0, 3],
                [1, 4],
                [2, 5]])
    """

    def split(x: torch.Tensor) -> torch.Tensor:
        dim = axis % x.dim()
        return x.unflatten(dim, (microbatch_size, -1)).transpose(dim, dim + 1)

    return optree.tree_map(split, tree)


def _batch_size(batch_args: list[Any], in_axes: Sequence[int]) -> int:
    sizes = set()
    for tree, axis in zip(batch_args, in_axes, strict=True):
        for leaf in optree.tree_leaves(tree):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"microbatch: a batch argument has a {type(leaf).__name__} leaf, expected tensors")
            sizes.add(leaf.shape[axis])
    if len(sizes) != 1:
        raise ValueError(f"Batch arguments must have equal-size batch axes, found {sorted(sizes)}")
    return sizes.pop()


def microbatch(
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    microbatch_size: int | None,
    accumulator: Accumulator | AccumulationType | Any = AccumulationType.SUM,
    *,
    argnames: str | Sequence[str] = (),
    in_axes: int | Sequence[int] = 0,
    num_real_microbatches: int | torch.Tensor | None = None,
) -> Callable[..., Any]:
    r"""``fun`` evaluated on microbatches of its batch arguments one after another, the outputs combined: the memory
    of one microbatch's evaluation instead of the whole batch's.

    .. math::
        c \leftarrow \text{init}(f(B_0));\quad c \leftarrow \text{update}(c, f(B_i), i),\ i = 0 \ldots n'-1;\quad
        \text{result} = \text{finalize}(c)

    where :math:`B_i` takes the rows :math:`i, i + n, i + 2n, \ldots` of every batch argument (``reshape_batch_axis``)
    and :math:`n = \text{batch size} / \text{microbatch\_size}` (:math:`n' = n` unless ``num_real_microbatches``).
    For SUM the result is :math:`\sum_i f(B_i)`, MEAN divides it by :math:`n`, RUNNING_MEAN is the mean of the
    :math:`n'` evaluated, CONCAT puts the rows back in the batch's order (zeros for the microbatches not evaluated).

    For PyTorch: the loop runs in Python and the outputs keep their autograd graphs (return detached values, such
    as gradients from ``torch.func.grad``, to free each microbatch's graph); ``num_real_microbatches`` is read on the
    host and at most the number of microbatches (optax's out-of-range rows read as NaN).

    Args:
        fun: the function.
        argnums: the positions of the arguments with a batch axis.
        microbatch_size: the rows of each microbatch, dividing the batch size; ``None`` returns ``fun`` itself.
        accumulator: an ``AccumulationType``, an ``Accumulator``, or a tree of them that is a prefix of ``fun``'s
            output (one per output, say).
        argnames: the names of the keyword arguments with a batch axis.
        in_axes: the batch axis of each of ``argnums`` then ``argnames`` (one int for all).
        num_real_microbatches: evaluate only the first so many microbatches.

    Example:
        >>> import torch, fadam
        >>> fun = lambda x: (x + 1, (3 * x).sum())
        >>> strategy = (fadam.AccumulationType.CONCAT, fadam.AccumulationType.SUM)
        >>> fadam.microbatch(fun, argnums=0, microbatch_size=2, accumulator=strategy)(torch.tensor([1, 2, 3, 4]))
        (tensor([2, 3, 4, 5]), tensor(30))

    References:
        optax's ``optax.microbatch`` and ``optax.microbatching.AccumulationType`` (0.2.8), whose semantics these are.
    """
    if microbatch_size is None:
        return fun
    if not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"Invalid microbatch_size: {microbatch_size} (expected an int >= 1 or None)")
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    if not argnums and not argnames:
        raise ValueError("microbatch needs at least one batch argument (argnums or argnames)")
    in_axes = (in_axes,) * (len(argnums) + len(argnames)) if isinstance(in_axes, int) else tuple(in_axes)
    if len(in_axes) != len(argnums) + len(argnames):
        raise ValueError(f"in_axes has {len(in_axes)} entries for {len(argnums) + len(argnames)} batch arguments")
    if any(not isinstance(axis, int) or axis < 0 for axis in in_axes):
        raise ValueError(f"Invalid in_axes: {in_axes} (expected non-negative ints, one per batch argument)")

    def microbatched(*args: Any, **kwargs: Any) -> Any:
        missing = [i for i in argnums if i >= len(args)] + [name for name in argnames if name not in kwargs]
        if missing:
            raise ValueError(f"microbatch: the batch arguments {missing} were not given")
        batch_size = _batch_size([args[i] for i in argnums] + [kwargs[n] for n in argnames], in_axes)
        if batch_size % microbatch_size != 0:
            raise ValueError(f"batch_size={batch_size} must be divisible by microbatch_size={microbatch_size}.")
        count = batch_size // microbatch_size
        evaluated = count if num_real_microbatches is None else int(num_real_microbatches)
        if not 0 <= evaluated <= count:
            raise ValueError(f"num_real_microbatches={evaluated} must be between 0 and the {count} microbatches")
        split_args, split_kwargs = list(args), dict(kwargs)
        for key, axis in zip((*argnums, *argnames), in_axes):
            source = split_args if isinstance(key, int) else split_kwargs
            source[key] = reshape_batch_axis(source[key], microbatch_size, axis)

        def evaluate(index: int) -> Any:
            one_args, one_kwargs = list(split_args), dict(split_kwargs)
            for key, axis in zip((*argnums, *argnames), in_axes):
                source = one_args if isinstance(key, int) else one_kwargs
                source[key] = optree.tree_map(lambda x, axis=axis: x.select(axis, index), source[key])
            return fun(*one_args, **one_kwargs)

        accumulators = _accumulators(accumulator, count)
        first = evaluate(0)  # its shapes start the carry; it is not accumulated if no microbatch is evaluated
        carry = _init(accumulators, first)
        for index in range(evaluated):
            carry = _update(accumulators, carry, first if index == 0 else evaluate(index), index)
        return _finalize(accumulators, carry, first)

    return microbatched
