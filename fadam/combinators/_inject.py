"""``inject_hyperparams``: hyperparameters as tensors in the state, readable, writable, schedulable, differentiable."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._dispatch import is_plain
from fadam._numerics import safe_increment, zero_count
from fadam._program import Program, ProgramUpdate, Stage, program_of
from fadam._tree import PyTree
from fadam.transforms._validation import check_state

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]


class InjectHyperparamsState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken; schedules are evaluated at it
    hyperparams: dict[str, torch.Tensor]  # name -> 0-d tensor: the value used by the last update (or init)
    inner_state: PyTree


class _Numeric(NamedTuple):
    """A constant numeric hyperparameter: the dtype it is stored in, whether the user gave Python numbers, and for a
    tuple of numbers (``betas``) its length: it is stored as a 1-d tensor and handed to the factory as a tuple."""

    dtype: torch.dtype
    python_number: bool
    length: int | None = None


def _is_number_tuple(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    )


def _to_factory(value: torch.Tensor, numeric: _Numeric) -> float | int | torch.Tensor | tuple:
    """``_scalar_to_factory`` of each entry of a tuple hyperparameter, or of a scalar one."""
    if numeric.length is None:
        return _scalar_to_factory(value, numeric.python_number)
    return tuple(_scalar_to_factory(x, numeric.python_number) for x in value.unbind())


def _scalar_to_factory(value: torch.Tensor, python_number: bool) -> float | int | torch.Tensor:
    """The value handed to the factory for a stored hyperparameter.

    A hyperparameter the user gave as a Python number goes back to the factory as the Python number its tensor holds
    whenever that tensor is an ordinary CPU tensor that no autograd graph, ``torch.func`` transform or compiler needs
    to see. Transforms round a Python scalar differently from a 0-d tensor in places (``torch.add(..., alpha=x)`` is a
    fused multiply-add; bfloat16 math reads a scalar in float32), so this is what makes a wrapped optimizer
    bit-identical to the plain one. Reading a CPU tensor costs no device synchronisation. Everywhere else (a tensor
    that requires grad, inside vmap/grad, under ``torch.compile``, on an accelerator) the tensor itself is passed, so
    gradients flow, batches stay batched and a changed value does not recompile.
    """
    if (
        python_number
        and not torch.compiler.is_compiling()  # first: the checks below are opaque to dynamo
        and is_plain(value)
        and value.device.type == "cpu"
        and value.numel() == 1
    ):
        return value.item()
    return value


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: torch.dtype | None = None,
) -> Callable[..., GradientTransformation]:
    r"""Wraps a transform factory so that its numeric hyperparameters live as 0-d tensors in the state.

    ``inject_hyperparams(fadam.adam)(lr=..., eps=...)`` is ``fadam.adam(lr=..., eps=...)`` with the hyperparameters
    moved into ``InjectHyperparamsState(count, hyperparams, inner_state)``; the factory is called again at every
    update with the current values. This gives:

    - logging: ``state.hyperparams["lr"]`` is the learning rate the last update used;
    - control: replace a value between steps, ``state._replace(hyperparams={**state.hyperparams, "lr": new})``;
    - schedules: any numeric argument may be a schedule ``count -> value``, evaluated at the wrapper's count (such an
      argument is recomputed each step, so overwriting it has no effect);
    - meta-learning: a hyperparameter tensor that requires grad flows into the updates.

    Numeric arguments are Python ``int``/``float``, 0-d tensors, and tuples of Python numbers such as ``adam``'s
    ``betas`` (stored as one 1-d tensor; write a 1-d tensor or a tuple of 0-d tensors to meta-learn them, and the
    factory receives a tuple again); ``bool`` flags, other tuples and other values are static, passed through
    unchanged, as is every argument named in ``static_args``. Callables are schedules unless named in
    ``static_args``. Python floats are stored in float64 (``hyperparam_dtype`` if given), ints in int64, tensors as
    given; a value written into the state is cast to its hyperparameter's dtype, except a floating value written
    over an int, which stays floating (never truncated). On an ordinary eager step the factory receives values given
    as Python numbers back as Python numbers (read from their CPU tensors, no device sync), so the wrapped optimizer
    is bit-identical to the plain one; under autograd, ``torch.func`` or ``torch.compile`` it receives the tensors.
    ``fadam.step`` runs the inner transform's program, torch's fused kernel included where the inner alias is one. A
    hyperparameter whose value decides the structure of the factory's chain (``adam``'s ``weight_decay`` of 0 adds
    no decay transform) keeps that structure from ``init``: change it only between values of the same kind, or name
    it in ``static_args`` under ``torch.compile``. Under ``fadam.capturable`` the count lives on the params' device
    and the schedules are evaluated there, their values reaching the factory as device tensors, which its argument
    checks read on the host (a sync each; on the meta device they refuse); the values given as Python numbers stay on
    the host and reach the factory as numbers, read from their CPU tensors (a captured CUDA graph keeps the ones it
    was captured with).

    Args:
        inner_factory: a function returning a ``GradientTransformation``, such as ``fadam.adam``.
        static_args: names of arguments never injected (a callable that is not a schedule, a number the factory
            branches on such as ``sgd``'s ``momentum`` under ``torch.compile``).
        hyperparam_dtype: dtype for float hyperparameters and floating schedule values (default: float64 for Python
            floats, the schedule's own dtype for schedules).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.inject_hyperparams(fadam.adam)(lr=fadam.linear_schedule(0.1, 0.0, 10))
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.ones(2)}, state, params)
        >>> updates, state = tx.update({"w": torch.ones(2)}, state, params)
        >>> round(float(state.hyperparams["lr"]), 6)  # the lr of the second step
        0.09
        >>> state = state._replace(hyperparams={**state.hyperparams, "eps": torch.tensor(1e-6)})

    References:
        optax.inject_hyperparams.
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    float_dtype = hyperparam_dtype or torch.float64
    signature = inspect.signature(inner_factory)
    parameters = signature.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values()):
        raise ValueError(f"inject_hyperparams needs a factory with named arguments; {inner_factory} takes *args")
    if not takes_kwargs and not static <= set(parameters):
        raise ValueError(
            f"static_args {sorted(static - set(parameters))} are not arguments of {inner_factory.__name__}; "
            f"it takes {list(parameters)}"
        )

    @functools.wraps(inner_factory)
    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[name] = value

        schedules: dict[str, Callable[[torch.Tensor], Any]] = {}
        numerics: dict[str, _Numeric] = {}
        initial: dict[str, torch.Tensor] = {}
        others: dict[str, Any] = {}
        for name, value in arguments.items():
            if name in static or isinstance(value, bool):
                others[name] = value
            elif callable(value):
                schedules[name] = value
            elif isinstance(value, (int, float)):
                dtype = torch.int64 if isinstance(value, int) else float_dtype
                numerics[name] = _Numeric(dtype, python_number=True)
                initial[name] = torch.tensor(value, dtype=dtype)
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                numerics[name] = _Numeric(value.dtype, python_number=False)
                initial[name] = value
            elif _is_number_tuple(value):
                dtype = float_dtype if any(isinstance(x, float) for x in value) else torch.int64
                numerics[name] = _Numeric(dtype, python_number=True, length=len(value))
                initial[name] = torch.tensor(value, dtype=dtype)
            else:
                others[name] = value

        def scheduled(count: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            """Schedule values at ``count``: for the factory (as the schedule returns them, or cast to
            ``hyperparam_dtype``), and as stored tensors."""
            raw = {name: fn(count) for name, fn in schedules.items()}
            stored = {}
            for name, value in raw.items():
                tensor = torch.as_tensor(value, dtype=torch.float64 if isinstance(value, float) else None)
                if hyperparam_dtype is not None and tensor.is_floating_point():
                    tensor = raw[name] = tensor.to(hyperparam_dtype)
                stored[name] = tensor
            return raw, stored

        def current(state: InjectHyperparamsState) -> tuple[GradientTransformation, dict[str, torch.Tensor]]:
            """The inner transform for this step, and the hyperparameters it uses as stored tensors."""
            if not isinstance(state, InjectHyperparamsState):
                raise ValueError(f"inject_hyperparams expects an InjectHyperparamsState, got {type(state).__name__}")
            unknown = set(state.hyperparams) - set(numerics) - set(schedules)
            if unknown:
                raise ValueError(
                    f"state.hyperparams has {sorted(unknown)}, which {inner_factory.__name__} does not take "
                    f"as injected hyperparameters ({sorted(numerics) + sorted(schedules)})"
                )
            stored: dict[str, torch.Tensor] = {}
            for name, numeric in numerics.items():
                if name not in state.hyperparams:
                    raise ValueError(f"state.hyperparams lacks {name!r}")
                value = state.hyperparams[name]
                if numeric.length is not None:
                    value = _as_vector(name, value, numeric)
                elif not isinstance(value, torch.Tensor):  # a Python number written into the state: stored as in init
                    value = torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else float_dtype)
                # a floating value written over an int (a meta-learned lr over ``lr=1``) keeps its dtype: casting it
                # would truncate it and cut its gradient
                truncates = value.is_floating_point() and not numeric.dtype.is_floating_point
                stored[name] = value if value.dtype == numeric.dtype or truncates else value.to(numeric.dtype)
            raw, stored_schedules = scheduled(state.count)
            stored.update(stored_schedules)
            values = {name: _to_factory(stored[name], numerics[name]) for name in numerics}
            return inner_factory(**others, **values, **raw), stored

        def init(params: PyTree) -> InjectHyperparamsState:
            count = zero_count()
            raw, stored = scheduled(count)
            values = {name: _to_factory(tensor, numerics[name]) for name, tensor in initial.items()}
            inner = inner_factory(**others, **values, **raw)
            return InjectHyperparamsState(count, {**initial, **stored}, inner.init(params))

        def update(
            updates: PyTree, state: InjectHyperparamsState, params: PyTree | None = None, **extra_args: Any
        ) -> tuple[PyTree, InjectHyperparamsState]:
            check_state(state, InjectHyperparamsState, "inject_hyperparams")
            inner, hyperparams = current(state)
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
            return updates, InjectHyperparamsState(safe_increment(state.count), hyperparams, inner_state)

        def expand(state: InjectHyperparamsState) -> tuple[Program, str, InjectHyperparamsState]:
            inner, hyperparams = current(state)
            advanced = InjectHyperparamsState(safe_increment(state.count), hyperparams, state.inner_state)
            return program_of(inner), "inner_state", advanced

        program = Program((Stage(None, (), GradientTransformation(init, update), expand=expand),))
        return GradientTransformation(init, ProgramUpdate(update, program))

    return wrapped


def _as_vector(name: str, value: Any, numeric: _Numeric) -> torch.Tensor:
    """A tuple hyperparameter written into the state as a 1-d tensor, or a tuple of numbers or 0-d tensors (stacked,
    so gradients reach each), checked for its length."""
    if isinstance(value, (tuple, list)):
        if all(isinstance(x, torch.Tensor) for x in value) and value:
            value = torch.stack([x.reshape(()).to(numeric.dtype) for x in value])
        else:
            value = torch.tensor(value, dtype=numeric.dtype)
    if not isinstance(value, torch.Tensor) or value.shape != (numeric.length,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"state.hyperparams[{name!r}] must hold {numeric.length} values (a 1-d tensor or a tuple), got {shape}"
        )
    return value
