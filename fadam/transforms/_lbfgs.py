"""L-BFGS as torch.optim.LBFGS takes it: ``lbfgs``, whose update drives a loss closure given as ``value_fn``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch._C import _functorch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._numerics import safe_increment, zero_count
from fadam._tree import PyTree, check_params, tree_flatten

__all__ = ["LbfgsState", "LbfgsUpdate", "lbfgs"]

Scalar = float | torch.Tensor  # torch.optim.LBFGS mixes Python floats (losses) and 0-d tensors (dot products)
ValueFn = Callable[[PyTree], tuple[Scalar, PyTree]]
Evaluate = Callable[[Scalar], tuple[float, torch.Tensor]]

# the optree namespace in which the flat vector follows the order the params' dicts were built in (torch's order)
_GIVEN_ORDER = "fadam.lbfgs"
# the strong Wolfe constants of torch.optim.LBFGS's line search (sufficient decrease, curvature)
_C1, _C2 = 1e-4, 0.9
# torch keeps a pair only where the curvature y.s exceeds this
_MIN_CURVATURE = 1e-10


class LbfgsState(NamedTuple):
    count: torch.Tensor  # 0-d int32: updates taken (optimizer steps), what a learning-rate schedule reads
    func_evals: torch.Tensor  # 0-d int64: loss evaluations (torch.optim.LBFGS's ``func_evals``)
    n_iter: torch.Tensor  # 0-d int64: iterations over all updates (its ``n_iter``)
    d: torch.Tensor  # the last search direction, flat (its ``d``)
    t: torch.Tensor  # 0-d float64: the last step length (its ``t``)
    old_dirs: tuple[torch.Tensor, ...]  # gradient differences y, oldest first, the first ``num_old`` in use
    old_stps: tuple[torch.Tensor, ...]  # the matching steps s
    ro: tuple[torch.Tensor, ...]  # the matching 1 / (y . s), 0-d
    num_old: torch.Tensor  # 0-d int64: pairs in use
    h_diag: torch.Tensor  # 0-d: the scale y.s / y.y of the initial inverse Hessian (its ``H_diag``)
    prev_flat_grad: torch.Tensor  # the gradient where the last iteration started (its ``prev_flat_grad``)
    prev_loss: torch.Tensor  # 0-d float64: the loss there (its ``prev_loss``)


def _given_order(tree: PyTree) -> list[int]:
    """Indices into optree's leaf order (dict keys sorted), listed in the order the tree's dicts were built in."""
    with optree.dict_insertion_ordered(True, namespace=_GIVEN_ORDER):
        given = optree.tree_paths(tree, none_is_leaf=True, namespace=_GIVEN_ORDER)
    position = {path: i for i, path in enumerate(optree.tree_paths(tree, none_is_leaf=True))}
    return [position[path] for path in given]


def _real(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(x) if x.is_complex() else x


def _flat(leaves: list[Any], like: list[torch.Tensor]) -> torch.Tensor:
    """``leaves`` as one vector, laid out as torch.optim.LBFGS lays out the gradient: leaf after leaf, a complex one
    as pairs of reals, a missing one as zeros."""
    parts = []
    for g, p in zip(leaves, like):
        if g is None:
            g = p.new_zeros(p.shape)
        elif g.is_sparse:
            g = g.to_dense()
        parts.append(_real(g).reshape(-1))
    return torch.cat(parts)


def _moved(leaves: list[torch.Tensor], t: Scalar, d: torch.Tensor) -> list[torch.Tensor]:
    """``x + t d`` leaf by leaf: the same kernel on the same shapes as torch's in-place ``p.add_(d, alpha=t)``."""
    moved, offset = [], 0
    for x in leaves:
        real = _real(x)
        new = torch.add(real, d[offset : offset + real.numel()].view_as(real), alpha=t)
        if new.dtype != real.dtype:  # a leaf of a narrower dtype than the vector: rounded as torch's add_ writes it
            new = new.to(real.dtype)
        moved.append(torch.view_as_complex(new) if x.is_complex() else new)
        offset += real.numel()
    return moved


def _pushed(entries: tuple[torch.Tensor, ...], used: int, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``entries`` with ``new`` after the ``used`` ones; the oldest is dropped when all are in use."""
    if used == len(entries):
        return (*entries[1:], new)
    return (*entries[:used], new, *entries[used + 1 :])


def _fitted(entries: tuple[torch.Tensor, ...], used: int, size: int) -> tuple[torch.Tensor, ...]:
    """``entries`` resized to ``size`` (a history size changed between steps): the newest kept, zeros after."""
    kept = entries[max(0, used - size) : used]
    return (*kept, *(torch.zeros_like(entries[0]) for _ in range(size - len(kept))))


def _direction(
    g: torch.Tensor, ys: tuple[torch.Tensor, ...], ss: tuple[torch.Tensor, ...], ro: tuple[torch.Tensor, ...], h: Any
) -> torch.Tensor:
    """``-H g`` by the two-loop recursion (Nocedal & Wright, algorithm 7.4), ``H`` built from the pairs ``(s, y)``
    on the initial inverse Hessian ``h I``."""
    q = g.neg()
    alphas: list[Any] = [None] * len(ys)  # written newest first, read oldest first
    for i in reversed(range(len(ys))):
        alphas[i] = ss[i].dot(q) * ro[i]
        q.add_(ys[i], alpha=-alphas[i])
    r = torch.mul(q, h)
    for i in range(len(ys)):
        beta = ys[i].dot(r) * ro[i]
        r.add_(ss[i], alpha=alphas[i] - beta)
    return r


def _cubic_minimizer(
    x1: Scalar, f1: Scalar, g1: torch.Tensor, x2: Scalar, f2: Scalar, g2: torch.Tensor, bounds: tuple | None = None
) -> Scalar:
    """The minimizer, within ``bounds`` (default: between the points), of the cubic through two points with their
    values and slopes (Nocedal & Wright, eq. 3.59); the middle of the bounds where the cubic has no minimum."""
    low, high = bounds if bounds is not None else ((x1, x2) if x1 <= x2 else (x2, x1))
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    discriminant = d1 * d1 - g1 * g2
    if not discriminant >= 0:
        return (low + high) / 2.0
    d2 = discriminant.sqrt()
    # measured from the larger point b toward the smaller a: torch's choice, which fixes the rounding
    a, ga, b, gb = (x1, g1, x2, g2) if x1 <= x2 else (x2, g2, x1, g1)
    minimum = b - (b - a) * ((gb + d2 - d1) / (gb - ga + 2 * d2))
    return min(max(minimum, low), high)


class _Point(NamedTuple):
    """A trial step length with the loss, gradient and slope along the direction there."""

    t: Scalar
    f: Scalar
    g: torch.Tensor
    gtd: Any


def _bracket(
    evaluate: Evaluate, start: _Point, t: Scalar, d: torch.Tensor, max_ls: int
) -> tuple[list[_Point], bool, int, int]:
    """The bracketing phase of the strong Wolfe search (Nocedal & Wright, algorithm 3.5): steps that grow by cubic
    extrapolation until one satisfies the conditions (``done``) or an interval holding such a step is found. Returns
    the bracket, done, the iterations and the evaluations."""
    f_new, g_new = evaluate(t)
    new = _Point(t, f_new, g_new, g_new.dot(d))
    prev, iterations = _Point(0, start.f, start.g, start.gtd), 0
    while iterations < max_ls:
        if new.f > (start.f + _C1 * new.t * start.gtd) or (iterations > 1 and new.f >= prev.f):
            return [prev, new], False, iterations, iterations + 1
        if abs(new.gtd) <= -_C2 * start.gtd:
            return [new], True, iterations, iterations + 1
        if new.gtd >= 0:
            return [prev, new], False, iterations, iterations + 1
        bounds = (new.t + 0.01 * (new.t - prev.t), new.t * 10)
        t = _cubic_minimizer(prev.t, prev.f, prev.gtd, new.t, new.f, new.gtd, bounds=bounds)
        prev = new
        f_new, g_new = evaluate(t)
        new = _Point(t, f_new, g_new, g_new.dot(d))
        iterations += 1
    # out of evaluations: the start and the last step, for the caller to take the lower
    return [_Point(0, start.f, start.g, None), new], False, iterations, iterations + 1


def _safeguarded(t: Scalar, ts: list[Scalar], insufficient: bool) -> tuple[Scalar, bool]:
    """A zoom trial moved a tenth of the bracket inside it when it lies too close to an end twice in a row or
    outside, and whether it was too close (torch.optim.LBFGS's guard against stalling on one end)."""
    high, low = max(ts), min(ts)
    margin = 0.1 * (high - low)
    if not min(high - t, t - low) < margin:
        return t, False
    if not (insufficient or t >= high or t <= low):
        return t, True
    return (high - margin if abs(t - high) < abs(t - low) else low + margin), False


def _strong_wolfe(
    evaluate: Evaluate, t: Scalar, d: torch.Tensor, start: _Point, tolerance_change: float, max_ls: int
) -> tuple[Scalar, torch.Tensor, Scalar, int]:
    """A step length along ``d`` that satisfies the strong Wolfe conditions, by bracketing then zooming in with
    cubic interpolation (Nocedal & Wright, algorithms 3.5 and 3.6). Returns the loss, gradient and step length found
    and the number of evaluations."""
    d_norm = d.abs().max()
    bracket, done, iterations, evals = _bracket(evaluate, start, t, d, max_ls)
    low, high = (0, 1) if bracket[0].f <= bracket[-1].f else (1, 0)
    insufficient = False
    while not done and iterations < max_ls:
        if abs(bracket[1].t - bracket[0].t) * d_norm < tolerance_change:
            break
        first, second = bracket
        t = _cubic_minimizer(first.t, first.f, first.gtd, second.t, second.f, second.gtd)
        t, insufficient = _safeguarded(t, [first.t, second.t], insufficient)
        f_new, g_new = evaluate(t)
        new = _Point(t, f_new, g_new, g_new.dot(d))
        evals += 1
        iterations += 1
        if new.f > (start.f + _C1 * t * start.gtd) or new.f >= bracket[low].f:
            bracket[high] = new  # too high: the new point closes the interval
            low, high = (0, 1) if bracket[0].f <= bracket[1].f else (1, 0)
            continue
        if abs(new.gtd) <= -_C2 * start.gtd:
            done = True
        elif new.gtd * (bracket[high].t - bracket[low].t) >= 0:
            bracket[high] = bracket[low]  # the minimum lies on the other side of the new point
        bracket[low] = new
    found = bracket[low]
    return found.f, found.g, found.t, evals


class LbfgsUpdate:
    """``lbfgs``'s update: ``update(grads, state, params, value=..., value_fn=...) -> (updates, state)``.

    ``minimize`` takes the same arguments and returns ``(new_params, state)``, the new params themselves, computed as
    torch.optim.LBFGS writes them; ``params + updates`` can differ from them in the last bit. ``fadam.Optimizer``
    steps through it, and writes ``resolved`` (``max_eval`` worked out from ``max_iter``) into the param group as
    torch.optim.LBFGS does."""

    def __init__(self, minimize: Callable[..., tuple[PyTree, LbfgsState]], resolved: dict[str, Any]) -> None:
        self.minimize = minimize
        self.resolved = resolved

    def __call__(
        self, updates: PyTree, state: LbfgsState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, LbfgsState]:
        if params is None:
            raise ValueError("lbfgs needs params: call update(grads, state, params, value=..., value_fn=...)")
        new_params, state = self.minimize(updates, state, params, **extra_args)
        return optree.tree_map(lambda new, p: new - p, new_params, params, none_is_leaf=True), state


def _check_lbfgs_args(lr: ScalarOrSchedule, history_size: int, line_search_fn: str | None) -> None:
    """torch.optim.LBFGS's checks, with its messages (the line search's at construction, not at the first step)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not callable(lr) and not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if history_size < 1:
        raise ValueError(f"Invalid history_size: {history_size}")
    if line_search_fn is not None and line_search_fn != "strong_wolfe":
        raise RuntimeError("only 'strong_wolfe' is supported")


def lbfgs(
    lr: ScalarOrSchedule = 1,
    max_iter: int = 20,
    max_eval: int | None = None,
    tolerance_grad: float = 1e-7,
    tolerance_change: float = 1e-9,
    history_size: int = 100,
    line_search_fn: str | None = None,
) -> GradientTransformation:
    r"""L-BFGS exactly as ``torch.optim.LBFGS``: each update runs up to ``max_iter`` iterations on a loss closure.

    .. math::
        d_k = -H_k g_k,\quad x_{k+1} = x_k + t_k d_k,\quad s_k = t_k d_k,\quad y_k = g_{k+1} - g_k,\quad
        \rho_k = 1 / y_k^\top s_k \ \text{(a pair kept where } y_k^\top s_k > 10^{-10})

    :math:`H_k g_k` by the two-loop recursion over the last ``history_size`` pairs on :math:`H^0 = \gamma I`,
    :math:`\gamma = y^\top s / y^\top y` of the newest pair; the very first direction is :math:`-g`, with
    :math:`t = \min(1, 1/\|g\|_1)\,\eta`, later ones :math:`t = \eta`, or the strong Wolfe step
    (:math:`c_1 = 10^{-4}`, :math:`c_2 = 0.9`, cubic interpolation) with ``line_search_fn="strong_wolfe"``. An
    update stops when :math:`\max|g| \le` ``tolerance_grad``, the slope :math:`g^\top d > -` ``tolerance_change``,
    the step or the loss changes by less than ``tolerance_change``, or after ``max_iter`` iterations or ``max_eval``
    evaluations (default ``max_iter * 5 // 4``).

    Call ``update(grads, state, params, value=loss, value_fn=f)`` with the loss and gradients at ``params`` and
    ``f(params) -> (loss, grads)``, the loss closure as a function (optax's ``value_fn`` convention, gradients
    included); the updates are the whole step. ``fadam.Optimizer(params, fadam.lbfgs, ...).step(closure)`` drives
    it from torch.optim's closure, as ``torch.optim.LBFGS.step`` does, and writes the params bit for bit as torch
    does (``LbfgsUpdate.minimize``). The state holds the flat direction, the previous gradient and ``history_size``
    pairs of flat vectors, allocated at ``init``: as much memory as torch's history when full.

    Args:
        lr: the step length :math:`\eta` (a float, a 0-d tensor, or a schedule of the update count).
        max_iter: iterations per update.
        max_eval: loss evaluations per update (default ``max_iter * 5 // 4``).
        tolerance_grad: stop when the gradient's largest magnitude is at most this.
        tolerance_change: stop when the slope, the step or the loss change is below this.
        history_size: the pairs :math:`(s, y)` kept.
        line_search_fn: ``None`` (fixed steps) or ``"strong_wolfe"``.

    Example:
        >>> import torch, fadam
        >>> def value_fn(params):
        ...     x = params[0]
        ...     return float((x - 3).pow(2).sum()), [2 * (x - 3)]
        >>> tx = fadam.lbfgs(line_search_fn="strong_wolfe")
        >>> params = [torch.zeros(2, dtype=torch.float64)]
        >>> loss, grads = value_fn(params)
        >>> updates, state = tx.update(grads, tx.init(params), params, value=loss, value_fn=value_fn)
        >>> fadam.apply_updates(params, updates)[0], int(state.func_evals)
        (tensor([3., 3.], dtype=torch.float64), 3)

    References:
        Nocedal & Wright, "Numerical Optimization", 2nd ed., 2006: algorithm 7.4 (the two-loop recursion),
        algorithms 3.5 and 3.6 (the strong Wolfe line search).
    """
    _check_lbfgs_args(lr, history_size, line_search_fn)
    evals_allowed = max_iter * 5 // 4 if max_eval is None else max_eval

    def init(params: PyTree) -> LbfgsState:
        leaves = [p for p in check_params(params) if p is not None]
        flat = _flat(leaves, leaves)

        def zeros() -> torch.Tensor:
            return torch.zeros_like(flat)

        def scalar(value: float, dtype: torch.dtype = flat.dtype) -> torch.Tensor:
            return torch.tensor(value, dtype=dtype, device=flat.device)

        return LbfgsState(
            count=zero_count(),
            func_evals=torch.zeros([], dtype=torch.int64),
            n_iter=torch.zeros([], dtype=torch.int64),
            d=zeros(),
            t=scalar(0.0, torch.float64),
            old_dirs=tuple(zeros() for _ in range(history_size)),
            old_stps=tuple(zeros() for _ in range(history_size)),
            ro=tuple(scalar(0.0) for _ in range(history_size)),
            num_old=torch.zeros([], dtype=torch.int64),
            h_diag=scalar(1.0),
            prev_flat_grad=zeros(),
            prev_loss=scalar(0.0, torch.float64),
        )

    def minimize(
        updates: PyTree,
        state: LbfgsState,
        params: PyTree,
        *,
        value: Scalar | None = None,
        value_fn: ValueFn | None = None,
        **_: Any,
    ) -> tuple[PyTree, LbfgsState]:
        if value is None or value_fn is None:
            raise ValueError(
                "lbfgs needs the loss at params and the loss closure: update(grads, state, params, value=loss, "
                "value_fn=f) with f(params) -> (loss, grads)"
            )
        if _functorch.maybe_current_level() is not None:
            raise ValueError(
                "lbfgs cannot run under torch.func (vmap, grad): its line search and stopping tests branch on the "
                "loss's values; run it outside the transform"
            )
        leaves, spec = tree_flatten(params)
        order = _given_order(params)
        given = [leaves[i] for i in order]
        kept = [i for i, p in enumerate(given) if p is not None]  # None params have no place in the vector
        x = [given[i] for i in kept]

        def flat_grad_of(grads: PyTree) -> torch.Tensor:
            grad_leaves = spec.flatten_up_to(grads)
            return _flat([grad_leaves[order[i]] for i in kept], x)

        def tree_of(moved: list[torch.Tensor]) -> PyTree:
            new_leaves = list(leaves)
            for i, leaf in zip(kept, moved):
                new_leaves[order[i]] = leaf
            return spec.unflatten(new_leaves)

        def evaluate_at(point: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
            with torch.enable_grad():
                loss, grads = value_fn(tree_of(point))
            return float(loss), flat_grad_of(grads)

        lr_now = float(lr(state.count) if callable(lr) else lr)
        with torch.no_grad():
            x, state = _run(state, x, float(value), flat_grad_of(updates), lr_now, evaluate_at)
        return tree_of(x), state

    def _run(
        state: LbfgsState,
        x: list[torch.Tensor],
        loss: float,
        flat_grad: torch.Tensor,
        lr_now: float,
        evaluate_at: Callable[[list[torch.Tensor]], tuple[float, torch.Tensor]],
    ) -> tuple[list[torch.Tensor], LbfgsState]:
        """One torch.optim.LBFGS step from the point ``x`` (leaves) with its loss and flat gradient."""
        func_evals, total = int(state.func_evals) + 1, int(state.n_iter)
        count = safe_increment(state.count)
        if flat_grad.abs().max() <= tolerance_grad:  # already optimal: nothing moves
            return x, state._replace(count=count, func_evals=torch.tensor(func_evals))
        d, t = state.d, float(state.t)
        dirs, stps, ro, used = state.old_dirs, state.old_stps, state.ro, int(state.num_old)
        if len(dirs) != history_size:
            dirs, stps, ro = (_fitted(e, used, history_size) for e in (dirs, stps, ro))
            used = min(used, history_size)
        h_diag: Any = state.h_diag
        prev_flat_grad, prev_loss = state.prev_flat_grad, loss
        current_evals, n_iter = 1, 0
        while n_iter < max_iter:
            n_iter += 1
            total += 1
            if total == 1:
                d, used, h_diag = flat_grad.neg(), 0, 1
            else:
                y, s = flat_grad.sub(prev_flat_grad), d.mul(t)
                ys = y.dot(s)
                if ys > _MIN_CURVATURE:
                    dirs, stps, ro = _pushed(dirs, used, y), _pushed(stps, used, s), _pushed(ro, used, 1.0 / ys)
                    used = min(used + 1, history_size)
                    h_diag = ys / y.dot(y)
                d = _direction(flat_grad, dirs[:used], stps[:used], ro[:used], h_diag)
            prev_flat_grad, prev_loss = flat_grad, loss
            t = min(1.0, 1.0 / flat_grad.abs().sum()) * lr_now if total == 1 else lr_now
            gtd = flat_grad.dot(d)
            if gtd > -tolerance_change:  # not a descent direction: torch stops without moving
                break
            evals, optimal = 0, False
            if line_search_fn is not None:
                start = _Point(0, loss, flat_grad, gtd)

                def evaluate(step: Scalar, x: list[torch.Tensor] = x, d: torch.Tensor = d) -> tuple[float, Any]:
                    return evaluate_at(_moved(x, step, d))

                loss, flat_grad, t, evals = _strong_wolfe(
                    evaluate, t, d, start, tolerance_change, evals_allowed - current_evals
                )
                x = _moved(x, t, d)
                optimal = bool(flat_grad.abs().max() <= tolerance_grad)
            else:
                x = _moved(x, t, d)
                if n_iter != max_iter:  # the last iteration's point is evaluated by the next update
                    loss, flat_grad = evaluate_at(x)
                    optimal, evals = bool(flat_grad.abs().max() <= tolerance_grad), 1
            current_evals += evals
            func_evals += evals
            if n_iter == max_iter or current_evals >= evals_allowed or optimal:
                break
            if d.mul(t).abs().max() <= tolerance_change or abs(loss - prev_loss) < tolerance_change:
                break  # no progress
        return x, LbfgsState(
            count=count,
            func_evals=torch.tensor(func_evals),
            n_iter=torch.tensor(total),
            d=d,
            t=torch.tensor(float(t), dtype=torch.float64),
            old_dirs=dirs,
            old_stps=stps,
            ro=ro,
            num_old=torch.tensor(used),
            h_diag=torch.as_tensor(h_diag, dtype=d.dtype, device=d.device),
            prev_flat_grad=prev_flat_grad,
            prev_loss=torch.tensor(prev_loss, dtype=torch.float64),
        )

    return GradientTransformation(init, LbfgsUpdate(minimize, {"max_eval": evals_allowed}))
