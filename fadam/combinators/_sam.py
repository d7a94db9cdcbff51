"""Sharpness-Aware Minimization: ``sam`` (adversarial steps, then an outer step from where they started) and its
``normalize``, as optax's ``optax.contrib.sam``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fadam._base import EmptyState, GradientTransformation, apply_updates
from fadam._numerics import zero_count
from fadam._program import Elementwise, elementwise
from fadam._tree import PyTree, check_leaves, check_params, tree_global_norm, tree_map
from fadam.combinators._wrappers import _host_bool, _select
from fadam.transforms._validation import check_state


def normalize() -> GradientTransformation:
    r"""Divides the updates by their global L2 norm: :math:`u = g / \|g\|_2` (SAM's adversarial direction).

    The norm runs over every leaf (complex leaves by modulus). Gradients that are all zero stay zero (no ascent),
    where optax's ``normalize`` gives NaN.

    Example:
        >>> import torch, fadam
        >>> fadam.normalize().update([torch.tensor([3.0]), torch.tensor([4.0])], fadam.EmptyState())[0]
        [tensor([0.6000]), tensor([0.8000])]

    References:
        optax's ``optax.contrib.normalize`` (0.2.8).
    """

    def reduce(updates: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        norm = tree_global_norm(updates)
        return {"norm": torch.where(norm > 0, norm, 1.0)}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (g / s.norm,)

    return elementwise(Elementwise("normalize", EmptyState, (), False, lambda count: {}, body, reduce=reduce))


class SAMState(NamedTuple):
    steps_since_sync: torch.Tensor  # 0-d int32: adversarial steps since the last outer step
    opt_state: PyTree  # the outer optimizer's state
    adv_state: PyTree  # the adversarial optimizer's state
    cache: PyTree  # the params where the adversarial steps started (None in opaque mode)


def _copy(params: PyTree) -> PyTree:
    return tree_map(lambda p: None if p is None else p.detach().clone(), params)


def _negated(updates: PyTree) -> PyTree:
    return tree_map(lambda u: None if u is None else -u, updates)


def _back_and_step(cache: PyTree, params: PyTree, updates: PyTree) -> PyTree:
    """``cache - params + u``: from the adversarial point back to ``cache``, then the outer update (none: 0)."""
    return tree_map(lambda c, p, u: None if p is None else (c - p if u is None else c - p + u), cache, params, updates)


def sam(
    optimizer: GradientTransformation,
    adv_optimizer: GradientTransformation,
    sync_period: int = 2,
    reset_state: bool = True,
    opaque_mode: bool = False,
) -> GradientTransformation:
    r"""SAM: ``sync_period - 1`` adversarial steps (ascent), then ``optimizer``'s step from where they started, with
    the gradient at the adversarial point.

    .. math::
        \tilde\theta = \theta + \rho \frac{\nabla L(\theta)}{\|\nabla L(\theta)\|_2},\quad
        \theta' = \theta + \mathrm{opt}\big(\nabla L(\tilde\theta)\big)

    for the paper's SAM with ``adv_optimizer = chain(normalize(), sgd(rho))`` and ``sync_period=2``. The adversarial
    optimizer's updates are negated (an SGD of rate :math:`\rho` ascends by :math:`\rho` along the gradient). The
    outer optimizer is called with the params where the adversarial steps started (the state's ``cache``).

    In the default transparent mode each ``update`` is one of those steps: the adversarial ones return their
    (ascending) updates, the last returns ``cache - params + u``, which lands on the outer step from ``cache``; the
    gradients passed in are always taken at the current params. With ``opaque_mode`` every ``update`` takes a whole
    SAM step: it calls ``grad_fn(params, i)``, given as a keyword argument, for the gradient at the ``i``-th
    adversarial point, and returns the outer update (for models whose other state, such as batch norm statistics,
    must only see real steps).

    For PyTorch, as against optax 0.2.8: where the count can be read for free (an eager step on the CPU) only the
    optimizer whose step it is runs (optax computes both and selects arithmetically; under ``torch.func`` and
    ``torch.compile`` fadam computes both and selects with ``torch.where``); ``cache`` holds a copy of the params, so
    a donated ``fadam.step`` may overwrite the params; ``sync_period=1`` is the outer optimizer itself (optax then
    steps from the previous step's params); optax's ``batch_axis_name`` (a ``jax.lax.pmean`` of the adversarial
    gradients) is left out: ``grad_fn`` returns gradients already averaged across ranks, as DDP's are. A ``None``
    gradient leaves its leaf out of the adversarial step, and the last step still brings it back to ``cache``.
    Extra keyword arguments of ``update`` reach both optimizers.

    Args:
        optimizer: the outer optimizer.
        adv_optimizer: the adversarial optimizer (``chain(normalize(), sgd(rho))`` for the paper's SAM).
        sync_period: the steps of one SAM step: ``sync_period - 1`` adversarial ones and the outer one.
        reset_state: re-initialise the adversarial optimizer's state after every outer step.
        opaque_mode: take whole SAM steps, calling ``grad_fn`` (see above).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.sam(fadam.sgd(0.1), fadam.chain(fadam.normalize(), fadam.sgd(0.5)))
        >>> params = [torch.tensor([1.0, 0.0])]
        >>> state = tx.init(params)
        >>> updates, state = tx.update([2 * params[0]], state, params)  # ascent by 0.5 along the gradient
        >>> params = fadam.apply_updates(params, updates)
        >>> params
        [tensor([1.5000, 0.0000])]
        >>> updates, state = tx.update([2 * params[0]], state, params)  # back to 1, then 0.1 of the gradient at 1.5
        >>> fadam.apply_updates(params, updates)
        [tensor([0.7000, 0.0000])]

    References:
        Foret et al., "Sharpness-Aware Minimization for Efficiently Improving Generalization", ICLR 2021.
        optax's ``optax.contrib.sam`` (0.2.8), whose contract this is.
    """
    if not isinstance(sync_period, int) or sync_period < 1:
        raise ValueError(f"Invalid sync_period: {sync_period} (expected an int >= 1)")

    def init(params: PyTree) -> SAMState:
        check_params(params)  # before the copy, which would fail on a non-tensor leaf or use up a generator
        cache = None if opaque_mode else _copy(params)
        return SAMState(zero_count(), optimizer.init(params), adv_optimizer.init(params), cache)

    def transparent_update(
        updates: PyTree, state: SAMState, params: PyTree | None, extra_args: dict[str, Any]
    ) -> tuple[PyTree, SAMState]:
        steps = state.steps_since_sync
        first, last = steps == 0, steps == sync_period - 1
        next_steps = torch.remainder(steps + 1, sync_period).to(torch.int32)
        decided = _host_bool(last)
        if decided is not None:
            cache = _copy(params) if bool(first) else state.cache
            if decided:
                opt_updates, opt_state = optimizer.update(updates, state.opt_state, cache, **extra_args)
                adv_state = adv_optimizer.init(params) if reset_state else state.adv_state
                return _back_and_step(cache, params, opt_updates), SAMState(next_steps, opt_state, adv_state, cache)
            adv_updates, adv_state = adv_optimizer.update(updates, state.adv_state, params, **extra_args)
            return _negated(adv_updates), SAMState(next_steps, state.opt_state, adv_state, cache)
        cache = _select(first, params, state.cache)
        adv_updates, adv_state = adv_optimizer.update(updates, state.adv_state, params, **extra_args)
        opt_updates, opt_state = optimizer.update(updates, state.opt_state, cache, **extra_args)
        outer = _back_and_step(cache, params, opt_updates)
        chosen = tree_map(lambda o, a: o if a is None else torch.where(last.to(o.device), o, -a), outer, adv_updates)
        kept = adv_optimizer.init(params) if reset_state else state.adv_state
        new_state = SAMState(
            next_steps, _select(last, opt_state, state.opt_state), _select(last, kept, adv_state), cache
        )
        return chosen, new_state

    def opaque_update(
        updates: PyTree, state: SAMState, params: PyTree | None, extra_args: dict[str, Any]
    ) -> tuple[PyTree, SAMState]:
        grad_fn: Callable[[PyTree, int], PyTree] | None = extra_args.pop("grad_fn", None)
        if grad_fn is None:
            raise ValueError("sam(opaque_mode=True) needs grad_fn=(params, i) -> gradients in update's arguments")
        adv_params, adv_grads, adv_state = params, updates, state.adv_state
        for i in range(sync_period - 1):
            adv_updates, adv_state = adv_optimizer.update(adv_grads, adv_state, adv_params, **extra_args)
            adv_params = apply_updates(adv_params, _negated(adv_updates))
            adv_grads = grad_fn(adv_params, i)
        if reset_state:
            adv_state = adv_optimizer.init(params)
        new_updates, opt_state = optimizer.update(adv_grads, state.opt_state, params, **extra_args)
        return new_updates, SAMState(zero_count(), opt_state, adv_state, None)

    def update(
        updates: PyTree, state: SAMState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, SAMState]:
        check_state(state, SAMState, "sam")
        if params is None:
            raise ValueError("sam needs params: call update(updates, state, params)")
        check_leaves(updates, params)
        if opaque_mode:
            return opaque_update(updates, state, params, dict(extra_args))
        extra_args.pop("grad_fn", None)
        return transparent_update(updates, state, params, extra_args)

    return GradientTransformation(init, update)
