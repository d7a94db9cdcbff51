"""``inject_stateful_hyperparams``: ``inject_hyperparams`` whose hyperparameters may also follow stateful schedules,
which carry a state of their own and read the update's extra arguments (a loss for a plateau rule)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from fadam._base import GradientTransformation
from fadam._tree import PyTree
from fadam.combinators._inject import InjectHyperparamsState, inject_hyperparams
from fadam.transforms._validation import check_state

__all__ = ["InjectStatefulHyperparamsState", "StatefulSchedule", "inject_stateful_hyperparams"]


@runtime_checkable
class StatefulSchedule(Protocol):
    """A schedule with a state: ``init() -> state``, ``update(state, **extra_args) -> state`` and
    ``__call__(state, **extra_args) -> value``, the value for the step about to be taken."""

    def init(self) -> PyTree: ...

    def update(self, state: PyTree, **extra_args: Any) -> PyTree: ...

    def __call__(self, state: PyTree, **extra_args: Any) -> float | torch.Tensor: ...


class InjectStatefulHyperparamsState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    hyperparams: dict[str, torch.Tensor]  # name -> 0-d tensor: the value used by the last update (or init)
    hyperparams_states: dict[str, PyTree]  # name -> the state of its stateful schedule
    inner_state: PyTree


def inject_stateful_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: torch.dtype | None = None,
) -> Callable[..., GradientTransformation]:
    r"""``inject_hyperparams`` where an argument may also be a ``StatefulSchedule``: an object with ``init``,
    ``update`` and ``__call__``, whose state lives in ``hyperparams_states``.

    At each update, with the update's extra arguments :math:`e`, a stateful schedule :math:`S` of state :math:`s_t`
    gives the value :math:`S(s_t, e)` to the inner transform, and its state becomes ``S.update(s_t, e)``. Its value at
    ``init`` is :math:`S(S.init())`. The other arguments behave as in ``inject_hyperparams`` (numbers stored as 0-d
    tensors, plain schedules evaluated at the count), and ``state.hyperparams`` holds every value last used. optax
    0.2.8 deprecates this name, its ``inject_hyperparams`` taking stateful schedules; fadam's ``inject_hyperparams``
    does not, so this one does, without a warning. optax also keeps a count per plain schedule in
    ``hyperparams_states``; here they read the wrapper's count, and ``hyperparams_states`` holds the stateful ones.

    Args:
        inner_factory: a function returning a ``GradientTransformation``, such as ``fadam.adam``.
        static_args: names of arguments never injected.
        hyperparam_dtype: dtype for float hyperparameters (default: float64 for Python floats).

    Example:
        >>> import torch, fadam
        >>> class HalveOnRise:  # halves the rate when the loss rises
        ...     def init(self):
        ...         return {"lr": torch.tensor(0.1), "last": torch.tensor(float("inf"))}
        ...     def update(self, state, *, loss, **_):
        ...         return {"lr": torch.where(loss > state["last"], state["lr"] / 2, state["lr"]), "last": loss}
        ...     def __call__(self, state, **_):
        ...         return state["lr"]
        >>> tx = fadam.inject_stateful_hyperparams(fadam.sgd)(lr=HalveOnRise())
        >>> params = [torch.zeros(1)]
        >>> state = tx.init(params)
        >>> for loss in (1.0, 2.0, 1.5):
        ...     _, state = tx.update([torch.ones(1)], state, params, loss=torch.tensor(loss))
        >>> state.hyperparams["lr"], state.hyperparams_states["lr"]["lr"]  # used at the third step; for the next
        (tensor(0.0500), tensor(0.0500))

    References:
        optax's ``optax.inject_stateful_hyperparams`` and ``optax.inject_hyperparams`` (0.2.8).
    """
    injected = inject_hyperparams(inner_factory, static_args, hyperparam_dtype)
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)

    @functools.wraps(inner_factory)
    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        stateful = {
            name: value
            for name, value in bound.arguments.items()
            if name not in static and isinstance(value, StatefulSchedule)
        }
        for name, schedule in stateful.items():
            # a stateful schedule enters the inner wrapper as a number, its first value, overwritten at every step
            bound.arguments[name] = schedule(schedule.init())
        tx = injected(*bound.args, **bound.kwargs)

        def init(params: PyTree) -> InjectStatefulHyperparamsState:
            inner = tx.init(params)
            states = {name: schedule.init() for name, schedule in stateful.items()}
            return InjectStatefulHyperparamsState(inner.count, inner.hyperparams, states, inner.inner_state)

        def update(
            updates: PyTree, state: InjectStatefulHyperparamsState, params: PyTree | None = None, **extra_args: Any
        ) -> tuple[PyTree, InjectStatefulHyperparamsState]:
            check_state(state, InjectStatefulHyperparamsState, "inject_stateful_hyperparams")
            states = state.hyperparams_states
            values = {name: schedule(states[name], **extra_args) for name, schedule in stateful.items()}
            hyperparams = {**state.hyperparams, **values}  # stored by the inner wrapper in each one's dtype
            inner = InjectHyperparamsState(state.count, hyperparams, state.inner_state)
            updates, inner = tx.update(updates, inner, params, **extra_args)
            new_states = {name: schedule.update(states[name], **extra_args) for name, schedule in stateful.items()}
            return updates, InjectStatefulHyperparamsState(
                inner.count, inner.hyperparams, new_states, inner.inner_state
            )

        return GradientTransformation(init, update)

    return wrapped
