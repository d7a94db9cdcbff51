"""Measurements of the updates inside a chain, kept in the state: ``snapshot`` (the last value), ``monitor`` (several,
stateful ones too) and ``measure_with_ema`` (a measurement's moving average)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation, stateless
from fadam._tree import PyTree, tree_map
from fadam.combinators._chain import chain
from fadam.transforms._momentum import ema

Measure = Callable[[PyTree], PyTree]  # updates -> a tree of tensors (a norm, a flag, a tree like the updates)


class SnapshotState(NamedTuple):
    measurement: dict[str, PyTree]  # {measure_name: the measure of the last updates (of the params after init)}


def snapshot(measure_name: str, measure: Measure) -> GradientTransformation:
    r"""Stores ``measure(updates)`` in the state under ``measure_name``; the updates pass through unchanged.

    .. math::
        u_t = g_t,\qquad S_t = \{\text{name}: \text{measure}(g_t)\},\qquad S_0 = \{\text{name}: \text{measure}(p_0)\}

    In a chain, the updates measured are those of the transforms before it (e.g. the norm before clipping).

    Args:
        measure_name: the key of the measurement in ``SnapshotState.measurement``.
        measure: ``updates -> measurement`` (a tensor or a tree of them).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.chain(fadam.snapshot("norm", fadam.tree_norm), fadam.clip_by_global_norm(1.0))
        >>> params = [torch.zeros(2)]
        >>> updates, state = tx.update([torch.tensor([3.0, 4.0])], tx.init(params))
        >>> updates, state[0].measurement["norm"]
        ([tensor([0.6000, 0.8000])], tensor(5.))

    References:
        optax's ``optax.snapshot`` (0.2.8), whose semantics these are.
    """
    if not isinstance(measure_name, str):
        raise TypeError(f"snapshot: measure_name is a {type(measure_name).__name__}, expected a str")
    if not callable(measure):
        raise TypeError(f"snapshot: measure is a {type(measure).__name__}, expected a callable updates -> measurement")

    def init(params: PyTree) -> SnapshotState:
        return SnapshotState({measure_name: measure(params)})

    def update(updates: PyTree, state: SnapshotState, params: PyTree | None = None, **_: Any) -> tuple:
        return updates, SnapshotState({measure_name: measure(updates)})

    return GradientTransformation(init, update)


class MonitorState(NamedTuple):
    measurements: dict[str, PyTree]  # {name: the last measurement} (empty after init, as optax)
    measure_states: tuple[PyTree, ...]  # each measure's state, in the order of the names


def monitor(measures: Mapping[str, GradientTransformation | Measure]) -> GradientTransformation:
    r"""Stores several measurements of the updates in the state, each by name; the updates pass through unchanged.

    .. math::
        u_t = g_t,\qquad (m^{(k)}_t, S^{(k)}_t) = \text{measure}_k\text{.update}(g_t, S^{(k)}_{t-1}, p_t)

    A measure is a transform, whose output is the measurement and whose state is kept (``measure_with_ema``), or a
    function ``updates -> measurement`` (stateless). Extra keyword arguments of ``update`` reach every measure.

    Args:
        measures: ``{name: measure}``.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.chain(
        ...     fadam.monitor(
        ...         {"norm": fadam.tree_norm, "clipped": fadam.measure_with_ema(lambda u: fadam.tree_norm(u) > 1, 0.9)}
        ...     ),
        ...     fadam.clip_by_global_norm(1.0),
        ... )
        >>> params = [torch.zeros(2)]
        >>> state = tx.init(params)
        >>> for g in ([0.3, 0.4], [3.0, 4.0]):
        ...     updates, state = tx.update([torch.tensor(g)], state)
        >>> state[0].measurements  # the last norm; the clipped fraction's debiased average: 0.1 / (1 - 0.9 ** 2)
        {'norm': tensor(5.), 'clipped': tensor(0.5263)}

    References:
        optax's ``optax.monitor`` (0.2.8), whose semantics these are.
    """
    if not isinstance(measures, Mapping):
        raise TypeError(f"monitor: measures is a {type(measures).__name__}, expected a dict name -> measure")
    transforms = {}
    for name, measure in measures.items():
        if callable(measure):
            transforms[name] = stateless(lambda updates, _, measure=measure: measure(updates))
        elif isinstance(measure, GradientTransformation):
            transforms[name] = measure
        else:
            raise TypeError(
                f"monitor: measure {name!r} is a {type(measure).__name__}, expected a GradientTransformation or a "
                "callable updates -> measurement"
            )

    def init(params: PyTree) -> MonitorState:
        return MonitorState({}, tuple(tx.init(params) for tx in transforms.values()))

    def update(updates: PyTree, state: MonitorState, params: PyTree | None = None, **extra_args: Any) -> tuple:
        measurements, new_states = {}, []
        for (name, tx), measure_state in zip(transforms.items(), state.measure_states, strict=True):
            measurements[name], measure_state = tx.update(updates, measure_state, params, **extra_args)
            new_states.append(measure_state)
        return updates, MonitorState(measurements, tuple(new_states))

    return GradientTransformation(init, update)


def _floating(x: Any) -> torch.Tensor:
    """A measurement as a floating tensor: a bool or an int one in torch's default dtype, as jax promotes it to its
    default float in the average."""
    x = torch.as_tensor(x)
    return x if x.is_floating_point() or x.is_complex() else x.to(torch.get_default_dtype())


def measure_with_ema(
    measure: Measure, decay: float, debias: bool = True, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    r"""A measurement of the updates, averaged over steps: its output is the moving average (use it in ``monitor``).

    .. math::
        e_t = \beta e_{t-1} + (1-\beta)\,\text{measure}(g_t),\qquad
        u_t = e_t \text{ or, debiased, } \frac{e_t}{1-\beta^t}

    ``chain(stateless(measure), ema(decay, debias, accumulator_dtype))`` with the average initialised as zeros of
    ``measure(params)``, as optax's; the state is ``(EmptyState(), EmaState)``. A bool or int measurement is averaged
    in torch's default dtype.

    Args:
        measure: ``updates -> measurement`` (a tensor, a bool tensor or a tree of them).
        decay: the decay :math:`\beta`.
        debias: divide by :math:`1-\beta^t`.
        accumulator_dtype: dtype of the average (default: the measurement's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.measure_with_ema(fadam.tree_norm, 0.5, debias=False)
        >>> state = tx.init([torch.zeros(2)])
        >>> average, state = tx.update([torch.tensor([3.0, 4.0])], state)
        >>> average  # 0.5 * 0 + 0.5 * 5
        tensor(2.5000)

    References:
        optax's ``optax.measure_with_ema`` (0.2.8), whose semantics these are.
    """
    if not callable(measure):
        raise TypeError(
            f"measure_with_ema: measure is a {type(measure).__name__}, expected a callable updates -> measurement"
        )

    def measured(tree: PyTree) -> PyTree:
        return tree_map(_floating, measure(tree))

    average = ema(decay, debias, accumulator_dtype)

    def init(params: PyTree) -> PyTree:
        return average.init(measured(params))

    def update(updates: PyTree, state: PyTree, params: PyTree | None = None, **_: Any) -> tuple:
        return average.update(updates, state)  # the measurement is not shaped as the params

    return chain(stateless(lambda updates, _: measured(updates)), GradientTransformation(init, update))
