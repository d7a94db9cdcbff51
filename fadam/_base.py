"""The transform protocol: ``GradientTransformation(init, update)`` and the functions every chain is built from."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import optree
import torch

from fadam._dispatch import can_write_in_place, first_overlap
from fadam._tree import PyTree, check_leaves, tree_map, tree_paths

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "Schedule",
    "ScalarOrSchedule",
    "apply_updates",
    "identity",
    "set_to_zero",
    "stateless",
    "stateless_with_tree_map",
    "step",
]

Schedule = Callable[[torch.Tensor], torch.Tensor | float]
ScalarOrSchedule = float | torch.Tensor | Schedule


class InitFn(Protocol):
    def __call__(self, params: PyTree) -> PyTree: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, PyTree]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions.

    ``init(params) -> state`` builds the state; ``update(updates, state, params=None, **extra_args) -> (updates,
    state)`` transforms gradients into updates and returns the new state. Neither mutates its inputs. Every fadam
    ``update`` accepts and ignores extra keyword arguments it does not use, so ``GradientTransformationExtraArgs`` is
    the same type.
    """

    init: InitFn
    update: UpdateFn


GradientTransformationExtraArgs = GradientTransformation


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def identity() -> GradientTransformation:
    """Returns updates unchanged.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.identity()
        >>> tx.update({"w": torch.ones(2)}, tx.init({"w": torch.zeros(2)}))[0]["w"]
        tensor([1., 1.])
    """
    return GradientTransformation(
        lambda params: EmptyState(), lambda updates, state, params=None, **_: (updates, state)
    )


def set_to_zero() -> GradientTransformation:
    """Replaces every update with zeros (a frozen parameter, typically inside ``partition``).

    Example:
        >>> import torch, fadam
        >>> fadam.set_to_zero().update({"w": torch.ones(2)}, fadam.EmptyState())[0]["w"]
        tensor([0., 0.])
    """

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, EmptyState]:
        return tree_map(lambda g: None if g is None else torch.zeros_like(g), updates), state

    return GradientTransformation(lambda params: EmptyState(), update)


def stateless(fn: Callable[[PyTree, PyTree | None], PyTree]) -> GradientTransformation:
    """Builds a stateless transform from ``fn(updates, params) -> updates``.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.stateless(lambda u, p: fadam.tree_scale(u, 2.0))
        >>> tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))[0]
        [tensor([2.])]
    """

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None, **_: Any) -> tuple[PyTree, EmptyState]:
        return fn(updates, params), state

    return GradientTransformation(lambda params: EmptyState(), update)


def stateless_with_tree_map(fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> GradientTransformation:
    """Builds a stateless transform applying ``fn(update, param) -> update`` leaf by leaf (``None`` updates skipped).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.stateless_with_tree_map(lambda g, p: g.sign())
        >>> tx.update([torch.tensor([-3.0])], fadam.EmptyState())[0]
        [tensor([-1.])]
    """

    def per_leaf(updates: PyTree, params: PyTree | None) -> PyTree:
        if params is None:
            return tree_map(lambda g: None if g is None else fn(g, None), updates)
        return tree_map(lambda g, p: None if g is None else fn(g, p), updates, params)

    return stateless(per_leaf)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Returns ``params + updates`` as new tensors; each result keeps its param's dtype. A ``None`` update leaves its
    param as it is (torch.optim skips a param whose gradient is ``None``); a sparse COO update (``fadam.sgd``'s of a
    sparse gradient) changes the elements it stores.

    Example:
        >>> import torch, fadam
        >>> fadam.apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), 0.5)})["w"]
        tensor([1.5000, 1.5000], dtype=torch.bfloat16)
    """
    update_leaves, param_leaves, spec = check_leaves(updates, params, sparse=True)
    return spec.unflatten([p if u is None else add_update(p, u) for p, u in zip(param_leaves, update_leaves)])


def add_update(p: torch.Tensor, u: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``p + u`` in ``p``'s dtype, written into ``p`` with ``in_place``. A complex leaf adds as pairs of reals, as
    torch.optim adds to ``view_as_real`` views: ATen's complex add computes ``p + (1+0j) * u``, where an infinite
    part of ``u`` would make the other part NaN."""
    if u.dtype != p.dtype:
        u = u.to(p.dtype)
    if in_place:
        with torch.no_grad():
            (torch.view_as_real(p) if p.is_complex() else p).add_(torch.view_as_real(u) if u.is_complex() else u)
        return p
    if p.is_complex():
        return torch.view_as_complex(torch.view_as_real(p) + torch.view_as_real(u))
    return p + u


FusedStep = Callable[[PyTree, PyTree, PyTree, bool], "tuple[PyTree, PyTree] | None"]


class FusibleUpdate:
    """An ``update`` function that also knows its own step for ``fadam.step``: a wrapper that decides something before
    its inner transform steps (skip a non-finite step, accumulate gradients, stream state in chunks) and then runs the
    inner step by its fastest backend (``fadam._execute.fast_step``).

    Calling it is calling ``update``. ``fused_step(params, grads, state, donate)`` returns ``(params, state)``, or
    ``None`` when the inputs do not allow it; ``fadam.step`` then takes the general path. ``inner``, where given, is
    the inner transform and the field of the state that holds its state, for ``fadam.explain``.
    """

    def __init__(
        self, update: UpdateFn, fused_step: FusedStep, inner: tuple[GradientTransformation, str] | None = None
    ) -> None:
        self._update = update
        self.fused_step = fused_step
        self.inner = inner
        self.program = getattr(update, "program", None)  # what fadam.step runs when the fused step cannot

    def __call__(
        self, updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, PyTree]:
        return self._update(updates, state, params, **extra_args)


def step(
    tx: GradientTransformation,
    params: PyTree,
    grads: PyTree,
    state: PyTree,
    *,
    donate: bool = False,
    **extra_args: Any,
) -> tuple[PyTree, PyTree]:
    """One optimizer step: ``update`` then ``apply_updates``, returning ``(new_params, new_state)``.

    With ``donate=False`` (the default) nothing passed in is modified. With ``donate=True`` the caller gives up
    ``params`` and ``state``: their buffers may be overwritten with the results (like buffer donation in JAX), so a
    step allocates no new param-sized tensors; read only the returned values afterwards. DTensor params (FSDP2) are
    updated in place shard by shard, so a sharded module's own parameters hold the result. The step runs on the fastest
    backend the tensors allow (``fadam.explain`` says which, leaf by leaf, and why; ``fadam.backend`` chooses one):
    torch's fused kernel where a run of ``tx``'s stages is one of its chains (``adam``, ``adamw``, ``sgd``, ``adagrad``
    and any chain, mask or partition built of the same members) and the tensors are plain and contiguous on the CPU or
    CUDA; else, for the declared stages of any chain, fadam's generated
    CPU kernel on the leaves that are plain contiguous float32/float64 CPU tensors (the eager numbers bit for bit);
    else ``tx.update`` and the addition of the updates, which writes a non-contiguous param's own elements only.
    Inputs are checked before anything is written.

    A donated step whose leaves share memory where it would write (one buffer at two params, tied weights as views of
    one storage, a gradient or a state leaf that overlaps a param or another state leaf) returns what
    ``donate=False`` returns, new tensors, with a warning: writing one leaf's result would change the other's. Only the
    gradients may share memory with each other. The check reads one storage pointer per leaf (under 1 us a leaf).

    Under ``torch.compile`` the step traces ``tx.update`` (inductor fuses it), and with ``donate=True`` copies the
    results into the given buffers, which inductor then writes directly. Data pointers cannot be read while tracing,
    so there aliasing is not detected: buffers shared by two leaves hold the value of the leaf written last. Pass
    distinct buffers, or ``donate=False``, to a compiled step.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.sgd(lr=0.5)
        >>> params, state = {"w": torch.ones(2)}, tx.init({"w": torch.ones(2)})
        >>> params, state = fadam.step(tx, params, {"w": torch.ones(2)}, state, donate=True)
        >>> params["w"]
        tensor([0.5000, 0.5000])
    """
    from fadam._execute import fast_step, step_check  # _execute builds on the transforms, which build on this module

    checked = None
    if donate and not torch.compiler.is_compiling():
        checked = None if extra_args else step_check(tx, params, grads)
        donate = not _warn_if_aliased(params, grads, state, checked)
    if not extra_args:
        result = fast_step(tx, params, grads, state, donate, checked=checked)
        if result is not None:
            return result
    updates, new_state = tx.update(grads, state, params, **extra_args)
    if not donate:
        return apply_updates(params, updates), new_state
    if torch.compiler.is_compiling():
        # Results copied into the donated buffers: inductor then writes them there from its fused kernel, with no fresh
        # param-sized allocations (compiled AdamW step, 16.8M params, 2 CPU threads: 23 ms against 78 ms). The state
        # first: a new state leaf may be an old param itself, never the reverse.
        new_state = _write_into(state, new_state)
        return _write_into(params, apply_updates(params, updates)), new_state
    update_leaves, param_leaves, _ = check_leaves(updates, params, sparse=True)
    # DTensor shards are written in place too; updates that carry a graph (a learned lr) are added out of place,
    # since writing them in place under no_grad would cut the graph
    if not all(can_write_in_place(p) for p in param_leaves) or any(
        u is not None and not can_write_in_place(u) for u in update_leaves
    ):
        return apply_updates(params, updates), new_state
    for p, u in zip(param_leaves, update_leaves):
        if u is not None:
            add_update(p, u, in_place=True)
    return params, new_state


def _warn_if_aliased(params: PyTree, grads: PyTree, state: PyTree, checked: Any = None) -> bool:
    """Whether a donated step's leaves share memory where it would write (``first_overlap``), warning if so (Python's
    default filter shows it once per call site of ``step``): the step then allocates its results, which a caller who
    donates expects it not to. ``checked``: ``check_leaves(grads, params)``'s result, whose leaves are then read
    (the grads' in the params' order)."""
    if checked is None:
        found = first_overlap(params, grads, state)
    else:
        from fadam._execute import overlap_with_state  # as in ``step``

        found = overlap_with_state(checked, state)
    if found is None:
        return False
    # checked gradients are in the params' order, so the params' paths name them
    trees = (params, grads if checked is None else params, state)
    names = [f"{_TREE_NAMES[which]}{tree_paths(trees[which])[index]}" for which, index in found]
    warnings.warn(
        f"fadam.step(donate=True): {names[0]} and {names[1]} share memory, so the step does not write into the donated "
        "buffers and returns new tensors, as with donate=False",
        stacklevel=3,
    )
    return True


_TREE_NAMES = ("params", "grads", "state")


def _write_into(donated: PyTree, values: PyTree) -> PyTree:
    """``values`` with each tensor copied into the matching tensor of ``donated`` (same shape, dtype and device, neither
    needing a graph); other leaves are returned as they are, as is a tree of another shape. No identity checks: under
    torch.compile an ``id`` or ``is`` of a tensor becomes a guard on that object, and new buffers would recompile.
    Donated leaves must not alias each other: ``step`` cannot read data pointers while tracing to check (no fadam
    ``init`` makes such state; the conformance battery checks)."""
    donated_leaves, spec = optree.tree_flatten(donated, none_is_leaf=True)
    value_leaves, value_spec = optree.tree_flatten(values, none_is_leaf=True)
    if spec != value_spec:
        return values
    graph = torch.is_grad_enabled()
    written = []
    with torch.no_grad():
        for old, new in zip(donated_leaves, value_leaves):
            if (
                isinstance(old, torch.Tensor)
                and isinstance(new, torch.Tensor)
                and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
                and not (graph and (old.requires_grad or new.requires_grad))
            ):
                old.copy_(new)
                new = old
            written.append(new)
    return spec.unflatten(written)
