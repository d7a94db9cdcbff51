"""The conformance battery: the same checks over every row of ``ALL_ROWS`` (rows added in ``rows_<topic>.py`` files
run here without further code).

A row whose ``kwargs`` has ``maximize=True`` (torch.optim's name) ascends: the battery feeds it the gradient of
``-f``. Everything else is read from the ``Row`` fields only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.func import grad, vmap

import fadam
from tests.conformance.table import ALL_ROWS, VALUE_ROWS, Row
from tests.tree_checks import assert_no_shared_memory, max_rel_err, tensor_leaves

TORCH_ROWS = [row for row in ALL_ROWS if row.reference == "torch"]
COMPLEX_ROWS = [row for row in ALL_ROWS if row.complex_params]


def _sign(row: Row) -> float:
    return -1.0 if row.kwargs.get("maximize", False) else 1.0


# ------------------------------------------------------------------------------------------------------ problems


Problem = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], torch.Tensor]


def _quadratic(dtype: torch.dtype) -> Problem:
    """An ill-conditioned parabola (curvatures 0.5 to 2): ``f(x) = sum a_i |x_i - c_i|^2 / 2``, minimum 0.

    Returns ``f``, its gradient (torch's convention for complex ``x``: ``df/dRe + i df/dIm``) and the start.
    """
    n = 6
    a = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    c = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)
    if dtype.is_complex:
        c = torch.complex(c, c.flip(0))

    def f(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (a * (x - c).abs() ** 2).sum()

    def gradient(x: torch.Tensor) -> torch.Tensor:
        return (a * (x - c)).to(dtype)

    return f, gradient, torch.zeros(n, dtype=dtype)


def _rosenbrock(dtype: torch.dtype) -> Problem:
    """Rosenbrock's valley ``(1 - x)^2 + b (y - x^2)^2`` with ``b = 10``, from (-1, 1); minimum 0 at (1, 1).

    ``b = 10`` rather than the classic 100: with 100 the Hessian at the minimum has an eigenvalue of 1001.6, so plain
    gradient descent diverges for any lr above 0.002 (a property of the problem, not of an optimizer), while rows
    carry one set of hyperparameters. A complex param holds the point as ``x + iy`` (torch's ``view_as_real``).
    """
    b = 10.0

    def split(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (z.real[0], z.imag[0]) if z.is_complex() else (z[0], z[1])

    def f(z: torch.Tensor) -> torch.Tensor:
        x, y = split(z)
        return (1 - x) ** 2 + b * (y - x**2) ** 2

    def gradient(z: torch.Tensor) -> torch.Tensor:
        x, y = split(z)
        dx, dy = -2 * (1 - x) - 4 * b * x * (y - x**2), 2 * b * (y - x**2)
        return torch.complex(dx, dy).reshape(1) if z.is_complex() else torch.stack([dx, dy])

    start = torch.tensor([complex(-1.0, 1.0)]) if dtype.is_complex else torch.tensor([-1.0, 1.0])
    return f, gradient, start.to(dtype)


def test_problem_gradients_are_right():
    for make in (_quadratic, _rosenbrock):
        for dtype in (torch.float64, torch.complex128):
            f, gradient, x = make(dtype)
            x = x + 0.3
            torch.testing.assert_close(gradient(x), grad(f)(x))


PROBLEMS = {"quadratic": _quadratic, "rosenbrock": _rosenbrock}
CONVERGE_CASES = [
    pytest.param(row, problem, dtype, id=f"{row.name}-{problem}-{'complex' if dtype.is_complex else 'real'}")
    for row in ALL_ROWS
    for problem in PROBLEMS
    for dtype in ([torch.float64, torch.complex128] if row.complex_params else [torch.float64])
]


@pytest.mark.parametrize(("row", "problem", "dtype"), CONVERGE_CASES)
def test_converges(row, problem, dtype):
    """At most 1000 steps bring the loss below 1% of its start (rows with weight decay converge to a nearby point)."""
    f, gradient, x = PROBLEMS[problem](dtype)
    sign = _sign(row)
    tx = row.build(**row.converge_kwargs)
    state = tx.init(x)
    start = float(f(x))
    for step in range(1, 1001):
        # the pure path: on a loaded 2-core machine torch's CPU fused kernels can take ~20 ms per call on tiny
        # tensors (OpenMP threads waiting for a core); fadam.step's results are checked in the parity tests
        updates, state = tx.update(sign * gradient(x), state, x)
        x = fadam.apply_updates(x, updates)
        if step % 50 == 0 and float(f(x)) <= 1e-10 * start:
            break  # converged to rounding level; going on would only compute with subnormal numbers (slow)
    final = float(f(x))
    assert final <= 1e-2 * start, f"loss {start:.3g} -> {final:.3g}"


# --------------------------------------------------------------------------------------------------------- trees


def _tree(dtype: torch.dtype, complex_leaf: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    tree: dict[str, Any] = {
        "layer": {"w": torch.randn(4, 3, generator=gen).to(dtype), "b": torch.randn(3, generator=gen).to(dtype)},
        "scalar": torch.tensor(2.0, dtype=dtype),
    }
    if complex_leaf:
        tree["z"] = torch.randn(5, generator=gen, dtype=torch.complex64 if dtype != torch.float64 else torch.complex128)
    return tree


def _grads(tree: Any, steps: int, seed: int = 1) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [fadam.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), tree) for _ in range(steps)]


def _run(row: Row, params: Any, grads: list[Any], mode: str, **extra: Any) -> tuple[Any, Any, list[Any]]:
    """Runs ``row`` over ``grads`` through ``mode`` ('update', 'step' or 'donate'); returns params, state, states."""
    tx = row.build()
    state = tx.init(params)
    states = [state]
    for g in grads:
        if mode == "update":
            updates, state = tx.update(g, state, params, **extra)
            for (path, u), (_, p) in zip(tensor_leaves(updates), tensor_leaves(params), strict=True):
                assert u.dtype == p.dtype, f"update {path} has dtype {u.dtype}, param {p.dtype}"
            params = fadam.apply_updates(params, updates)
        else:
            params, state = fadam.step(tx, params, g, state, donate=mode == "donate", **extra)
        states.append(state)
    return params, state, states


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_accepts_unknown_extra_kwargs(row):
    params = _tree(torch.float64, row.complex_params)
    grads = _grads(params, 3)
    extra = {"unknown_flag": True, "loss_value": torch.tensor(1.5), "rng": None}
    for mode in ("update", "step"):
        plain = _run(row, params, grads, mode)[0]
        with_extra = _run(row, params, grads, mode, **extra)[0]
        err, where = max_rel_err(with_extra, plain)
        assert err <= 1e-15, f"{mode}: extra kwargs changed the result at {where}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_preserves_param_dtype(row, dtype):
    params = _tree(dtype, complex_leaf=False)
    for mode in ("update", "step", "donate"):
        start = fadam.tree_map(torch.clone, params)
        final = _run(row, start, _grads(params, 3), mode)[0]
        moved = False  # a bf16 leaf of 2.0 may not move under a step below its resolution; the tree must
        for (path, p), (_, p0) in zip(tensor_leaves(final), tensor_leaves(params), strict=True):
            assert p.dtype == dtype, f"{mode}: {path} became {p.dtype}"
            assert p.shape == p0.shape
            assert torch.isfinite(p.float()).all()
            moved = moved or not torch.equal(p, p0)
        assert moved, f"{mode}: no param moved"


@pytest.mark.parametrize("mode", ["update", "step", "donate"])
@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_state_structure_is_stable(row, mode):
    """The state has the same tree structure, shapes, dtypes and devices after every step as after init."""
    params = _tree(torch.float32, row.complex_params)
    *_, states = _run(row, params, _grads(params, 5), mode)
    spec = fadam._tree.tree_flatten(states[0])[1]
    layout = [(path, t.shape, t.dtype, t.device) for path, t in tensor_leaves(states[0])]
    for index, state in enumerate(states[1:], start=1):
        assert fadam._tree.tree_flatten(state)[1] == spec, f"step {index}: state structure changed"
        assert [(path, t.shape, t.dtype, t.device) for path, t in tensor_leaves(state)] == layout, f"step {index}"
    assert all(isinstance(leaf, torch.Tensor) for leaf in fadam._tree.tree_leaves(states[-1]))


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_vmap_equals_separate_runs(row):
    n = 3
    params = _tree(torch.float64, row.complex_params)
    stacked = fadam.tree_map(lambda p: torch.stack([p * (i + 1) for i in range(n)]), params)
    grads = [fadam.tree_map(lambda g: torch.stack([g * (1 - i) for i in range(n)]), g) for g in _grads(params, 3)]
    tx = row.build()
    if not row.value_state:  # paged state lives outside the traced tensors: refused with a clear error
        with pytest.raises(ValueError, match=r"torch\.func"):
            vmap(tx.init)(stacked)
        return
    state = vmap(tx.init)(stacked)
    for g in grads:
        updates, state = vmap(tx.update)(g, state, stacked)
        stacked = fadam.apply_updates(stacked, updates)
    for i in range(n):
        member = fadam.tree_map(lambda p, i=i: p[i], stacked)
        member_grads = [fadam.tree_map(lambda x, i=i: x[i], g) for g in grads]
        alone = _run(row, fadam.tree_map(lambda p, i=i: p * (i + 1), params), member_grads, "update")[0]
        err, where = max_rel_err(member, alone)
        assert err <= 1e-12, f"member {i}: {err:.2e} at {where}"


@pytest.mark.parametrize("backend", fadam._execute.BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("row", TORCH_ROWS, ids=str)
def test_parity_with_torch_reference(row, dtype, backend):
    """50 steps of ``row`` against ``row.torch_cls(**row.kwargs)`` (for-loop implementation), every step, on each
    backend."""
    with fadam.backend(backend):
        _parity_with_torch_reference(row, dtype)


def _parity_with_torch_reference(row: Row, dtype: torch.dtype) -> None:
    params = _tree(dtype, row.complex_params)
    grads = _grads(params, 50)
    ref = fadam.tree_map(torch.clone, params)
    ref_leaves = [t for _, t in tensor_leaves(ref)]
    opt = row.torch_cls(ref_leaves, foreach=False, **row.kwargs)
    tx = row.build()
    runs = {"update": (params, tx.init(params)), "step": (params, tx.init(params))}
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for index, g in enumerate(grads, start=1):
        for p, gl in zip(ref_leaves, [t for _, t in tensor_leaves(g)], strict=True):
            p.grad = gl.clone()
        opt.step()
        p, s = runs["update"]
        updates, s = tx.update(g, s, p)
        runs["update"] = (fadam.apply_updates(p, updates), s)
        p, s = runs["step"]
        runs["step"] = fadam.step(tx, p, g, s)
        for mode, (p, _) in runs.items():
            err, where = max_rel_err(p, ref)
            assert err <= tol, f"{mode}, step {index}: relative error {err:.2e} at {where}"


@pytest.mark.parametrize("mode", ["update", "donate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_generated_kernel_gives_the_eager_numbers_bit_for_bit(row, dtype, mode):
    """10 steps on the generated kernel (where the leaves allow it; never torch's fused kernels) equal the eager
    backend's bit for bit, params and state (a paged row's params: its state is a handle)."""
    params = _tree(dtype, row.complex_params)
    params["big"] = torch.randn(70_001, generator=torch.Generator().manual_seed(2), dtype=dtype)  # threads, tails
    grads = _grads(params, 10)
    results = {}
    for backend in ("eager", "kernel"):
        with fadam.backend(backend):
            final, state, _ = _run(row, fadam.tree_map(torch.clone, params), grads, mode)
        results[backend] = [final, state] if row.value_state else [final]
    for (path, a), (_, b) in zip(tensor_leaves(results["kernel"]), tensor_leaves(results["eager"]), strict=True):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), f"{path} differs"


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns (values and signs of zeros compared exactly; NaNs with their payloads)."""
    x = torch.view_as_real(x) if x.is_complex() else x
    if not x.is_floating_point():
        return x
    return x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


@pytest.mark.parametrize("row", VALUE_ROWS, ids=str)
def test_compiles_into_one_graph(row):
    """``torch.compile(fullgraph=True)`` traces a whole donated ``fadam.step`` (which traces ``tx.update`` and
    ``apply_updates``, then writes the results into the given buffers: one trace covers both, and dynamo's tracing is
    most of the battery's time) without a graph break, compiles once for all steps (the count is a tensor), and gives
    the eager results. A row with ``graph_breaks`` (its reason) compiles with them: more than one graph, the eager
    results. Paged rows keep their state in storage outside the traced tensors and are not compiled."""
    params = _tree(torch.float64, row.complex_params)
    grads = _grads(params, 3)
    tx = row.build()
    torch.compiler.reset()  # one code object per row's train_step: rows would add up to dynamo's recompile limit
    counter = CompileCounter()  # runs the traced graph eagerly: this checks tracing, not inductor's code

    @torch.compile(backend=counter, fullgraph=row.graph_breaks is None)
    def train_step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        return fadam.step(tx, params, grads, state, donate=True)

    compiled = fadam.tree_map(torch.clone, params)  # donated buffers
    state = tx.init(compiled)
    for g in grads:
        compiled, state = train_step(compiled, g, state)
    if row.graph_breaks is None:
        assert counter.frame_count == 1, f"compiled {counter.frame_count} graphs for 3 steps"
    else:
        assert counter.frame_count > 1, f"one graph for 3 steps, where the row breaks graphs: {row.graph_breaks}"
    err, where = max_rel_err(compiled, _run(row, params, grads, "donate")[0])
    assert err <= 1e-12, f"compiled run differs from eager by {err:.2e} at {where}"


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_init_state_leaves_share_no_memory(row):
    assert_no_shared_memory(row.build().init(_tree(torch.float32, row.complex_params)), "init state")
