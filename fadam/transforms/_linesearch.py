"""optax's line searches under their names: ``scale_by_backtracking_linesearch`` (Armijo's sufficient decrease) and
``scale_by_zoom_linesearch`` (the strong Wolfe conditions, optax's zoom search), and ``value_and_grad_from_state``,
which reuses the value and gradient a line search computed at the new params.

A line search takes ``update(updates, state, params, value=f(params), grad=grad f(params), value_fn=f)``, ``f`` a
function of the params (and of extra keyword arguments it names, passed to ``update``) returning the loss as a
scalar tensor; gradients of ``f`` are taken by autograd. The search runs as Python control flow on the loss's values
(optax's ``while_loop``), so not under ``torch.func`` or ``torch.compile``; its numbers are Python floats (float64).
fadam.lbfgs's strong Wolfe search is torch.optim.LBFGS's, a different algorithm.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._C import _functorch

from fadam._base import GradientTransformation
from fadam._tree import PyTree, check_params, tree_flatten, tree_map, tree_zeros_like
from fadam._tree_math import tree_vdot
from fadam.transforms._validation import check_state

__all__ = [
    "BacktrackingLinesearchInfo",
    "ScaleByBacktrackingLinesearchState",
    "ScaleByZoomLinesearchState",
    "ZoomLinesearchInfo",
    "scale_by_backtracking_linesearch",
    "scale_by_zoom_linesearch",
    "value_and_grad_from_state",
]

ValueFn = Callable[..., torch.Tensor | float]


class BacktrackingLinesearchInfo(NamedTuple):
    num_linesearch_steps: torch.Tensor  # 0-d int64: the values computed by the last search
    decrease_error: torch.Tensor  # 0-d: how far the step taken is from a sufficient decrease (0: it is sufficient)


class ScaleByBacktrackingLinesearchState(NamedTuple):
    learning_rate: torch.Tensor  # 0-d: the step size of the last update
    value: torch.Tensor  # 0-d: the loss at the params it moved to
    grad: PyTree | None  # its gradient there with ``store_grad`` (else None)
    info: BacktrackingLinesearchInfo


class ZoomLinesearchInfo(NamedTuple):
    num_linesearch_steps: torch.Tensor  # 0-d int64: the values and gradients computed by the last search
    decrease_error: torch.Tensor  # 0-d: the violation of the sufficient decrease (0: satisfied)
    curvature_error: torch.Tensor  # 0-d: the violation of the curvature condition (0: satisfied)


class ScaleByZoomLinesearchState(NamedTuple):
    learning_rate: torch.Tensor  # 0-d: the step size of the last update
    value: torch.Tensor  # 0-d: the loss at the params it moved to
    grad: PyTree  # its gradient there
    info: ZoomLinesearchInfo


# ------------------------------------------------------------------------------------------- values and gradients


def _refuse_functorch(name: str) -> None:
    if _functorch.maybe_current_level() is not None:
        raise ValueError(f"{name} cannot run under torch.func: the search branches on the loss's values")


def _value_and_grad(value_fn: ValueFn, params: PyTree, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, PyTree]:
    """The loss at ``params`` and its gradient by autograd (zeros for a param it does not read), both detached."""
    leaves, spec = tree_flatten(params)
    inputs = [None if p is None else p.detach().requires_grad_(True) for p in leaves]
    with torch.enable_grad():
        value = torch.as_tensor(value_fn(spec.unflatten(inputs), *args, **kwargs))
    present = [x for x in inputs if x is not None]
    if value.requires_grad:
        grads = iter(torch.autograd.grad(value, present, allow_unused=True, materialize_grads=True))
    else:  # a loss that does not depend on the params
        grads = iter(torch.zeros_like(x) for x in present)
    return value.detach(), spec.unflatten([None if x is None else next(grads) for x in inputs])


def _value(value_fn: ValueFn, params: PyTree, **kwargs: Any) -> float:
    with torch.no_grad():
        return float(value_fn(params, **kwargs))


def _function_kwargs(value_fn: ValueFn, extra_args: dict[str, Any]) -> dict[str, Any]:
    """The extra arguments of ``update`` that ``value_fn`` names (all of them if it takes ``**kwargs``); the others are
    ignored, as every fadam update ignores what it does not take (optax raises on them)."""
    parameters = inspect.signature(value_fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(extra_args)
    return {name: value for name, value in extra_args.items() if name in parameters}


def _moved(params: PyTree, stepsize: float, updates: PyTree) -> PyTree:
    """``params + stepsize * updates`` (a param without an update stays)."""
    with torch.no_grad():
        return tree_map(lambda p, u: p if u is None else p + stepsize * u, params, updates)


def _slope(grad: PyTree, updates: PyTree) -> float:
    """The derivative of ``f(params + s updates)`` at ``s = 0``: ``Re <grad, updates>`` (torch's complex gradients)."""
    return float(tree_vdot(grad, updates).real)


def _scaled(updates: PyTree, stepsize: float) -> PyTree:
    return tree_map(lambda u: None if u is None else u * stepsize, updates)


def _dtype_and_device(params: PyTree) -> tuple[torch.dtype, torch.device]:
    """The real dtype and the device of the first param: those of the state's scalars."""
    leaves = [p for p in check_params(params) if p is not None]
    if not leaves:
        raise ValueError("a line search needs at least one param")
    return leaves[0].real.dtype, leaves[0].device


def _check_call(name: str, params: PyTree, value: Any, grad: Any, value_fn: Any) -> None:
    if params is None or value is None or grad is None or value_fn is None:
        raise ValueError(
            f"{name} needs update(updates, state, params, value=f(params), grad=grad_f(params), value_fn=f)"
        )
    _refuse_functorch(name)


def _nan_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _nan_min(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


def _violation(error: float) -> float:
    """How far a criterion is violated: 0 where it holds, infinite where it cannot be evaluated (NaN)."""
    error = _nan_max(error, 0.0)
    return math.inf if math.isnan(error) else error


def value_and_grad_from_state(value_fn: ValueFn) -> Callable[..., tuple[torch.Tensor, PyTree]]:
    r"""``value_fn``'s value and gradient at the params, taken from a line search's state where it holds them.

    The returned ``value_and_grad(params, *args, state, **kwargs) -> (value, grad)`` reads the single ``value`` and
    ``grad`` fields of ``state`` (at any depth, a chain's included): the loss and gradient at the params the last
    update moved to, which are the params passed now if nothing was applied in between. Where that value is not
    finite (the state of ``init``, or a failed search) they are computed: ``value_fn(params, *args, **kwargs)`` and
    its gradient by autograd, both detached (what ``jax.value_and_grad`` gives; the params themselves are not
    made to require grad).

    Args:
        value_fn: the loss, a function of the params (and of the further arguments) returning a scalar tensor.

    Returns:
        ``value_and_grad(params, *args, state, **kwargs)``; it raises where the state holds no ``value`` or no
        ``grad`` (``scale_by_backtracking_linesearch`` keeps one with ``store_grad=True``), or several.

    Example:
        >>> import torch, fadam
        >>> def f(x):
        ...     return (x**2).sum()
        >>> tx = fadam.chain(fadam.scale(-1.0), fadam.scale_by_backtracking_linesearch(15, store_grad=True))
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> value_and_grad = fadam.value_and_grad_from_state(f)
        >>> for _ in range(3):
        ...     value, grad = value_and_grad(params, state=state)
        ...     updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=f)
        ...     params = fadam.apply_updates(params, updates)
        >>> round(float(f(params)), 3), bool(value_and_grad(params, state=state)[0] == f(params))
        (0.653, True)

    References:
        optax's ``optax.value_and_grad_from_state`` (0.2.8).
    """

    def value_and_grad(params: PyTree, *fn_args: Any, state: PyTree, **fn_kwargs: Any) -> tuple[torch.Tensor, PyTree]:
        value, grad = _field(state, "value"), _field(state, "grad")
        if value is None or grad is None:
            raise ValueError(
                "value_and_grad_from_state: the state holds no value or no gradient; a line search keeps them "
                "(scale_by_backtracking_linesearch with store_grad=True)"
            )
        if bool(torch.isfinite(torch.as_tensor(value))):
            return value, grad
        return _value_and_grad(value_fn, params, *fn_args, **fn_kwargs)

    return value_and_grad


def _field(tree: Any, name: str) -> Any:
    """The value of the one NamedTuple field or dict key ``name`` in ``tree``; ``None`` if there is none."""
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            items = list(zip(node._fields, node))
        elif isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, (tuple, list)):
            items = [(None, child) for child in node]
        else:
            return
        for key, child in items:
            if key == name:
                found.append(child)
            else:
                visit(child)

    visit(tree)
    if len(found) > 1:
        raise ValueError(f"value_and_grad_from_state: the state holds {len(found)} fields named {name!r}, expected one")
    return found[0] if found else None


# -------------------------------------------------------------------------------------------------------- backtracking


def scale_by_backtracking_linesearch(
    max_backtracking_steps: int,
    slope_rtol: float = 1e-4,
    decrease_factor: float = 0.8,
    increase_factor: float = 1.5,
    max_learning_rate: float = 1.0,
    atol: float = 0.0,
    rtol: float = 0.0,
    store_grad: bool = False,
    verbose: bool = False,
) -> GradientTransformation:
    r"""Scales the updates by the first step size, from a guess down by ``decrease_factor``, with a sufficient
    decrease of the loss (Armijo's criterion).

    .. math::
        f(w + \eta u) \le (1 + \delta) f(w) + c\,\eta\,\langle u, \nabla f(w)\rangle + \epsilon

    (:math:`c` ``slope_rtol``, :math:`\delta` ``rtol``, :math:`\epsilon` ``atol``). The guess is
    :math:`\min(\text{increase\_factor}\cdot\eta_{prev}, \text{max\_learning\_rate})`; at most
    ``max_backtracking_steps`` decreases follow. Where no step gives a finite criterion the step size is 0. The
    updates must be a descent direction (``scale(-1.0)`` of the gradient before it). Call ``update(updates, state,
    params, value=f(params), grad=grad_f(params), value_fn=f)``; extra keyword arguments that ``f`` names are passed
    to it. With ``store_grad`` the gradient at the accepted params is kept for ``value_and_grad_from_state``.

    Args:
        max_backtracking_steps: the largest number of decreases.
        slope_rtol: :math:`c`.
        decrease_factor: the factor of each decrease.
        increase_factor: the factor of the last step size in the next guess (``math.inf``: start at
            ``max_learning_rate``).
        max_learning_rate: the largest step size.
        atol: :math:`\epsilon`.
        rtol: :math:`\delta`.
        store_grad: keep the gradient at the new params in the state.
        verbose: print the search's numbers when it fails.

    Example:
        >>> import torch, fadam
        >>> def f(x):
        ...     return (x**2).sum()
        >>> tx = fadam.chain(fadam.scale(-1.0), fadam.scale_by_backtracking_linesearch(max_backtracking_steps=15))
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> updates, state = tx.update(2 * params, tx.init(params), params, value=f(params), grad=2 * params,
        ...                            value_fn=f)
        >>> round(float(state[1].learning_rate), 4), round(float(f(fadam.apply_updates(params, updates))), 4)
        (0.8, 5.04)

    References:
        Vaswani et al., "Painless Stochastic Gradient: Interpolation, Line-Search, and Convergence Rates",
        NeurIPS 2019. Nocedal & Wright, "Numerical Optimization", 2nd ed., 2006, section 3.1. optax's
        ``optax.scale_by_backtracking_linesearch`` (0.2.8), whose semantics these are.
    """
    if not 0.0 < decrease_factor < 1.0:
        raise ValueError(f"decrease_factor must be in (0, 1), got {decrease_factor}")
    if max_backtracking_steps < 0:
        raise ValueError(f"max_backtracking_steps must be >= 0, got {max_backtracking_steps}")

    def init(params: PyTree) -> ScaleByBacktrackingLinesearchState:
        dtype, device = _dtype_and_device(params)
        return ScaleByBacktrackingLinesearchState(
            learning_rate=torch.tensor(1.0, dtype=dtype, device=device),
            value=torch.tensor(math.inf, dtype=dtype, device=device),
            grad=tree_zeros_like(params) if store_grad else None,
            info=BacktrackingLinesearchInfo(torch.tensor(0), torch.tensor(math.inf, dtype=dtype, device=device)),
        )

    def decrease_error(stepsize: float, slope: float, value: float, new_value: float) -> float:
        return _violation(new_value - (1.0 + rtol) * value - stepsize * slope_rtol * slope)

    def update(
        updates: PyTree,
        state: ScaleByBacktrackingLinesearchState,
        params: PyTree | None = None,
        *,
        value: Any = None,
        grad: PyTree = None,
        value_fn: ValueFn | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, ScaleByBacktrackingLinesearchState]:
        check_state(state, ScaleByBacktrackingLinesearchState, "scale_by_backtracking_linesearch")
        _check_call("scale_by_backtracking_linesearch", params, value, grad, value_fn)
        kwargs = _function_kwargs(value_fn, extra_args)
        slope, start = _slope(grad, updates), float(value)
        stepsize = _nan_min(increase_factor * float(state.learning_rate), max_learning_rate)
        new_value, new_grad, error, steps = start, None, math.inf, 0
        while not error <= atol and steps <= max_backtracking_steps:
            if steps > 0:
                stepsize = decrease_factor * stepsize
            moved = _moved(params, stepsize, updates)
            new_value = _value(value_fn, moved, **kwargs)
            error = decrease_error(stepsize, slope, start, new_value)
            if store_grad and (error <= atol or steps == max_backtracking_steps):  # once, where the search ends
                new_grad = _value_and_grad(value_fn, moved, **kwargs)[1]
            steps += 1
        if math.isinf(error):  # no step keeps the loss finite: stay
            stepsize = 0.0
        if verbose and error > atol:
            print(
                f"scale_by_backtracking_linesearch: no step size with a sufficient decrease (value {start}, slope "
                f"{slope}, step size {stepsize}, decrease error {error})"
            )
        dtype, device = state.learning_rate.dtype, state.learning_rate.device
        if store_grad and new_grad is None:
            new_grad = tree_zeros_like(params)
        new_state = ScaleByBacktrackingLinesearchState(
            learning_rate=torch.tensor(stepsize, dtype=dtype, device=device),
            value=torch.tensor(new_value, dtype=dtype, device=device),
            grad=new_grad,
            info=BacktrackingLinesearchInfo(torch.tensor(steps), torch.tensor(error, dtype=dtype, device=device)),
        )
        return _scaled(updates, stepsize), new_state

    return GradientTransformation(init, update)


# -------------------------------------------------------------------------------------------------------------- zoom


class _Trial(NamedTuple):
    """A step size with the loss, its gradient and its slope along the updates at ``params + stepsize * updates``."""

    stepsize: float
    value: float
    grad: PyTree
    slope: float


class _ZoomOptions(NamedTuple):
    max_steps: int
    max_stepsize: float | None
    tol: float
    increase_factor: float
    slope_rtol: float
    curv_rtol: float
    approx_dec_rtol: float | None
    interval_threshold: float


def _cubic_minimizer(a: float, fa: float, fpa: float, b: float, fb: float, c: float, fc: float) -> float:
    """The critical point of the cubic through ``(a, fa)`` with slope ``fpa``, ``(b, fb)`` and ``(c, fc)``; NaN where
    there is none (a degenerate cubic, or a negative radical)."""
    db, dc = b - a, c - a
    denom = (db * dc) * (db * dc) * (db - dc)
    rb, rc = fb - fa - fpa * db, fc - fa - fpa * dc
    if denom == 0:
        return math.nan
    cubic = (dc * dc * rb - db * db * rc) / denom
    square = (-(dc * dc * dc) * rb + db * db * db * rc) / denom
    radical = square * square - 3.0 * cubic * fpa
    if cubic == 0 or radical < 0:
        return math.nan
    return a + (-square + math.sqrt(radical)) / (3.0 * cubic)


def _quadratic_minimizer(a: float, fa: float, fpa: float, b: float, fb: float) -> float:
    """The critical point of the parabola through ``(a, fa)`` with slope ``fpa`` and ``(b, fb)``; NaN where none."""
    db = b - a
    if db == 0:
        return math.nan
    curvature = (fb - fa - fpa * db) / (db * db)
    return math.nan if curvature == 0 else a - fpa / (2.0 * curvature)


class _ZoomSearch:
    """One run of optax's zoom line search: phase 1 grows the step until an interval holds a step satisfying both
    criteria (Nocedal & Wright's algorithm 3.5), phase 2 narrows it by cubic, quadratic or bisection steps
    (algorithm 3.6), keeping the best step with a sufficient decrease to fall back on."""

    def __init__(self, options: _ZoomOptions, start: _Trial, guess: float, evaluate: Callable[[float], _Trial]):
        self.options, self.start, self.guess, self.evaluate = options, start, guess, evaluate
        self.current = self.low = self.high = self.cubic_ref = self.safe = start
        self.count = 0
        self.decrease_error = self.curvature_error = math.inf
        self.interval_found = self.done = self.failed = False

    def run(self) -> _Trial:
        while not (self.done or self.failed):
            if self.interval_found:
                self._zoom()
            else:
                self._search_interval()
            if self.failed and (self.safe.stepsize > 0.0 or math.isinf(self.decrease_error)):
                self.current = self.safe  # the best step with a sufficient decrease (or none, outside the domain)
        return self.current

    def _errors(self, trial: _Trial) -> tuple[float, float]:
        """The violations of the sufficient decrease (or Hager & Zhang's approximate one near a minimum) and of the
        curvature condition."""
        o, start = self.options, self.start
        decrease = trial.value - start.value - o.slope_rtol * trial.stepsize * start.slope
        if o.approx_dec_rtol is not None:
            approximate = trial.slope - (2 * o.slope_rtol - 1.0) * start.slope
            near = trial.value - start.value - o.approx_dec_rtol * abs(start.value)
            decrease = _nan_min(_nan_max(approximate, near), decrease)
        curvature = abs(trial.slope) - o.curv_rtol * abs(start.slope)
        return _violation(decrease), _violation(curvature)

    def _tried(self, trial: _Trial) -> tuple[float, float]:
        """Evaluates ``trial``'s criteria, counts it and makes it the current step."""
        decrease, curvature = self._errors(trial)
        self.current, self.count = trial, self.count + 1
        self.decrease_error, self.curvature_error = decrease, curvature
        return decrease, max(decrease, curvature)

    def _search_interval(self) -> None:
        o, previous = self.options, self.current
        stepsize = self.guess if self.count == 0 else o.increase_factor * previous.stepsize
        at_max = o.max_stepsize is not None and stepsize >= o.max_stepsize
        if o.max_stepsize is not None:
            stepsize = min(stepsize, o.max_stepsize)
        first = self.count == 0
        new = self.evaluate(stepsize)
        decrease, error = self._tried(new)
        if decrease <= o.tol:
            self.safe = new
        high_to_new = decrease > 0.0 or (new.value >= previous.value and not first)
        low_to_new = new.slope >= 0.0 and not high_to_new
        self.low, self.high = (new, previous) if low_to_new else (previous, new)
        self.cubic_ref = self.low
        self.interval_found = high_to_new or low_to_new or error <= o.tol
        # at the largest step without an interval, no larger step can satisfy the curvature condition: take it
        self.done = error <= o.tol or (at_max and not self.interval_found)
        self.failed = self.count >= o.max_steps and not self.done

    def _zoom(self) -> None:
        o, low, high, ref = self.options, self.low, self.high, self.cubic_ref
        delta = abs(high.stepsize - low.stepsize)
        left, right = min(low.stepsize, high.stepsize), max(low.stepsize, high.stepsize)
        middle = _cubic_minimizer(
            low.stepsize, low.value, low.slope, high.stepsize, high.value, ref.stepsize, ref.value
        )
        if not left + 0.2 * delta < middle < right - 0.2 * delta:
            middle = _quadratic_minimizer(low.stepsize, low.value, low.slope, high.stepsize, high.value)
            if not left + 0.1 * delta < middle < right - 0.1 * delta:
                middle = (low.stepsize + high.stepsize) / 2.0
        new = self.evaluate(middle)
        decrease, error = self._tried(new)
        if decrease <= o.tol and new.value < self.safe.value:
            self.safe = new
        self.done = error <= o.tol
        high_to_middle = decrease > 0.0 or new.value >= low.value
        high_to_low = new.slope * (high.stepsize - low.stepsize) >= 0.0 and not high_to_middle
        self.high = new if high_to_middle else (low if high_to_low else high)
        self.low = low if high_to_middle else new
        self.cubic_ref = high if high_to_middle or high_to_low else low
        # stop once the interval is below the precision asked and a step with a sufficient decrease is known
        too_small = delta <= o.interval_threshold and self.safe.stepsize > 0.0
        self.failed = (self.count >= o.max_steps or too_small) and not self.done


def scale_by_zoom_linesearch(
    max_linesearch_steps: int,
    max_learning_rate: float | None = None,
    tol: float = 0.0,
    increase_factor: float = 2.0,
    slope_rtol: float = 1e-4,
    curv_rtol: float = 0.9,
    approx_dec_rtol: float | None = 1e-6,
    stepsize_precision: float = 1e-5,
    initial_guess_strategy: str = "keep",
    verbose: bool = False,
) -> GradientTransformation:
    r"""Scales the updates by a step size satisfying the strong Wolfe conditions, found by optax's zoom search.

    .. math::
        f(w + \eta u) \le f(w) + c_1 \eta \langle u, \nabla f(w)\rangle + \epsilon,\qquad
        |\langle \nabla f(w + \eta u), u\rangle| \le c_2 |\langle \nabla f(w), u\rangle| + \epsilon

    (:math:`c_1` ``slope_rtol``, :math:`c_2` ``curv_rtol``, :math:`\epsilon` ``tol``). Near a minimum, where
    :math:`f(w + \eta u) \le f(w) + c_3|f(w)|` (:math:`c_3` ``approx_dec_rtol``, ``None`` to turn it off), the
    first may be met instead as Hager & Zhang's approximate decrease, :math:`\langle \nabla f(w + \eta u), u\rangle
    \le (2c_1 - 1)\langle \nabla f(w), u\rangle`. The step grows by ``increase_factor`` from the guess (1 with
    ``initial_guess_strategy="one"``, for quasi-Newton directions; the last step size with ``"keep"``, for SGD) until
    an interval holds such a step, then the interval is narrowed by cubic, quadratic or bisection steps. After
    ``max_linesearch_steps`` evaluations, or once the interval is below ``stepsize_precision``, the best step with a
    sufficient decrease is taken. Call ``update(updates, state, params, value=f(params), grad=grad_f(params),
    value_fn=f)``; each trial evaluates ``f`` and its gradient by autograd, and the state keeps those of the step
    taken (``value_and_grad_from_state``).

    Args:
        max_linesearch_steps: the largest number of evaluations.
        max_learning_rate: the largest step size (``None``: unbounded).
        tol: :math:`\epsilon`.
        increase_factor: the growth of the step while no interval is found.
        slope_rtol: :math:`c_1`.
        curv_rtol: :math:`c_2` (``math.inf``: sufficient decrease only).
        approx_dec_rtol: :math:`c_3`, or ``None``.
        stepsize_precision: the interval length below which the search stops with a sufficient decrease.
        initial_guess_strategy: ``"one"`` or ``"keep"``.
        verbose: print the search's numbers when it fails.

    Example:
        >>> import torch, fadam
        >>> def f(x):
        ...     return (x**2).sum()
        >>> tx = fadam.chain(fadam.scale(-1.0), fadam.scale_by_zoom_linesearch(max_linesearch_steps=15))
        >>> params = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        >>> updates, state = tx.update(2 * params, tx.init(params), params, value=f(params), grad=2 * params,
        ...                            value_fn=f)
        >>> float(state[1].learning_rate), float(f(fadam.apply_updates(params, updates)))  # the exact step
        (0.5, 0.0)

    References:
        Nocedal & Wright, "Numerical Optimization", 2nd ed., 2006, algorithms 3.5 and 3.6. Hager & Zhang,
        "Algorithm 851: CG_DESCENT", ACM TOMS 2006. optax's ``optax.scale_by_zoom_linesearch`` (0.2.8), whose
        algorithm this is.
    """
    if initial_guess_strategy not in ("one", "keep"):
        raise ValueError(f"Unknown initial guess strategy: {initial_guess_strategy!r} (expected 'one' or 'keep')")
    if max_linesearch_steps < 1:
        raise ValueError(f"max_linesearch_steps must be >= 1, got {max_linesearch_steps}")
    options = _ZoomOptions(
        max_linesearch_steps,
        max_learning_rate,
        tol,
        increase_factor,
        slope_rtol,
        curv_rtol,
        approx_dec_rtol,
        stepsize_precision,
    )

    def init(params: PyTree) -> ScaleByZoomLinesearchState:
        dtype, device = _dtype_and_device(params)
        inf = torch.tensor(math.inf, dtype=dtype, device=device)
        return ScaleByZoomLinesearchState(
            learning_rate=torch.tensor(1.0, dtype=dtype, device=device),
            value=inf,
            grad=tree_zeros_like(params),
            info=ZoomLinesearchInfo(torch.tensor(0), inf, inf),
        )

    def update(
        updates: PyTree,
        state: ScaleByZoomLinesearchState,
        params: PyTree | None = None,
        *,
        value: Any = None,
        grad: PyTree = None,
        value_fn: ValueFn | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, ScaleByZoomLinesearchState]:
        check_state(state, ScaleByZoomLinesearchState, "scale_by_zoom_linesearch")
        _check_call("scale_by_zoom_linesearch", params, value, grad, value_fn)
        kwargs = _function_kwargs(value_fn, extra_args)

        def evaluate(stepsize: float) -> _Trial:
            value_there, grad_there = _value_and_grad(value_fn, _moved(params, stepsize, updates), **kwargs)
            return _Trial(stepsize, float(value_there), grad_there, _slope(grad_there, updates))

        guess = 1.0 if initial_guess_strategy == "one" else float(state.learning_rate)
        search = _ZoomSearch(options, _Trial(0.0, float(value), grad, _slope(grad, updates)), guess, evaluate)
        found = search.run()
        if verbose and search.failed:
            print(
                f"scale_by_zoom_linesearch: no step size met both criteria (value {float(value)}, step size "
                f"{found.stepsize}, decrease error {search.decrease_error}, curvature error {search.curvature_error})"
            )
        dtype, device = state.learning_rate.dtype, state.learning_rate.device

        def scalar(x: float) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        info = ZoomLinesearchInfo(
            torch.tensor(search.count), scalar(search.decrease_error), scalar(search.curvature_error)
        )
        new_state = ScaleByZoomLinesearchState(scalar(found.stepsize), scalar(found.value), found.grad, info)
        return _scaled(updates, found.stepsize), new_state

    return GradientTransformation(init, update)
