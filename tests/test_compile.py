"""fadam inside torch.compile: donated buffers written in place, and compiled torch.func transforms through steps.

The conformance battery (tests/conformance/test_battery.py) compiles every optimizer's step with ``fullgraph=True``;
these tests check what a compiled graph does with the buffers and with ``torch.func.grad`` and ``vmap`` around it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.func import grad, vmap

import fadam
from tests.tree_checks import assert_no_shared_memory, max_rel_err, tensor_leaves

BUILDERS = {
    "adamw": lambda: fadam.adamw(1e-2, weight_decay=0.1),
    "user-chain": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.scale_by_adam(), fadam.scale(-1e-2)),
    "adamw8bit": lambda: fadam.adamw8bit(1e-2, min_size=0, block_size=64),
}


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 16, generator=gen), "b": torch.randn(16, generator=gen)}


@pytest.mark.parametrize("name", BUILDERS)
def test_compiled_donated_step_writes_into_the_given_buffers(name):
    """A compiled ``fadam.step(..., donate=True)`` copies its results into the donated params and state, as the eager
    one does, so that inductor writes them there from its kernel instead of allocating new tensors."""
    tx = BUILDERS[name]()
    params, grads = _params(), fadam.tree_map(lambda p: p.flip(0).cos(), _params())  # signed: m takes the signed map
    state = tx.init(params)
    expected = fadam.step(tx, params, grads, state)

    @torch.compile(backend="eager", fullgraph=True)
    def train_step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        return fadam.step(tx, params, grads, state, donate=True)

    donated = [t.data_ptr() for _, t in tensor_leaves((params, state)) if t.dim()]
    result = train_step(params, grads, state)
    assert [t.data_ptr() for _, t in tensor_leaves(result) if t.dim()] == donated
    assert max_rel_err(result, expected)[0] <= 1e-6


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_compiled_grad_through_steps_equals_eager(donate):
    """Meta-gradients through two steps, under ``torch.func.grad`` and under autograd, compiled and not: the same.
    Donated buffers that carry a gradient are not written in place."""
    tx = fadam.adam(1e-2)

    def loss(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        params = {"w": w}
        state = tx.init(params)
        params, state = fadam.step(tx, params, {"w": g}, state, donate=donate)
        params, state = fadam.step(tx, params, {"w": g * 2}, state, donate=donate)
        return (params["w"] ** 2).sum()

    w, g = torch.randn(5), torch.randn(5)
    eager = grad(loss)(w, g)
    compiled = torch.compile(lambda w, g: grad(loss)(w, g), backend="eager", fullgraph=True)(w, g)
    tracked = w.clone().requires_grad_()
    (through_autograd,) = torch.autograd.grad(torch.compile(loss, backend="eager", fullgraph=True)(tracked, g), tracked)
    assert torch.allclose(compiled, eager, rtol=1e-6, atol=0)
    assert torch.allclose(through_autograd, eager, rtol=1e-6, atol=0)


def test_compiled_vmap_of_update_equals_eager():
    tx = fadam.adam(1e-2)
    params = {"w": torch.randn(3, 5)}
    grads = {"w": torch.randn(3, 5)}

    def train_step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        updates, state = vmap(tx.update)(grads, state, params)
        return fadam.apply_updates(params, updates), state

    state = vmap(tx.init)(params)
    compiled = torch.compile(train_step, backend="eager", fullgraph=True)(params, grads, state)
    assert max_rel_err(compiled, train_step(params, grads, state))[0] <= 1e-6


WRAPPERS = {
    "masked": lambda: fadam.chain(
        fadam.scale_by_adam(), fadam.masked(fadam.add_decayed_weights(0.1), {"w": True, "b": False}), fadam.scale(-1e-2)
    ),
    "masked-callable": lambda: fadam.masked(fadam.adam(1e-2), lambda params: {k: k == "w" for k in params}),
    "partition": lambda: fadam.partition({"adam": fadam.adam(1e-2), "sgd": fadam.sgd(1e-1)}, {"w": "adam", "b": "sgd"}),
    "inject_hyperparams": lambda: fadam.inject_hyperparams(fadam.adamw)(lr=fadam.linear_schedule(1e-2, 1e-3, 10)),
    "apply_if_finite": lambda: fadam.apply_if_finite(fadam.adam(1e-2), max_consecutive_errors=2),
    "MultiSteps": lambda: fadam.MultiSteps(fadam.adam(1e-2), every_k_schedule=2),
    "named_chain": lambda: fadam.named_chain(("clip", fadam.clip_by_global_norm(1.0)), ("adam", fadam.adam(1e-2))),
}


@pytest.mark.parametrize("name", WRAPPERS)
def test_combinators_init_state_leaves_share_no_memory(name):
    assert_no_shared_memory(WRAPPERS[name]().init(_params()), "init state")


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name", WRAPPERS)
def test_combinators_compile_into_one_graph(name, donate):
    """Masks and labels (constants that dynamo cannot flatten with optree), injected hyperparameters, skip counters
    (a non-finite gradient at step 3) and accumulators: one graph for four steps, equal to eager."""
    tx = WRAPPERS[name]()
    torch.compiler.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def train_step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        return fadam.step(tx, params, grads, state, donate=donate)

    params = _params()
    gen = torch.Generator().manual_seed(1)
    grads = [fadam.tree_map(lambda p: torch.randn(p.shape, generator=gen), params) for _ in range(4)]
    if name == "apply_if_finite":
        grads[2]["b"][0] = float("nan")  # a skipped step
    eager, eager_state = params, tx.init(params)
    compiled, state = fadam.tree_map(torch.clone, params), tx.init(params)
    for g in grads:
        eager, eager_state = fadam.step(tx, eager, g, eager_state)
        compiled, state = train_step(compiled, g, state)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} graphs for 4 steps"
    assert max_rel_err(compiled, eager)[0] <= 1e-6
    assert max_rel_err(state, eager_state)[0] <= 1e-6


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_paged_state_runs_eagerly_inside_a_compiled_step(donate):
    """page_state streams chunks outside any graph: a compiled step breaks the graph around it and runs it eagerly,
    giving the unpaged results; with fullgraph=True dynamo's error names page_state."""
    tx, reference = fadam.paged_adam(1e-2, chunk_bytes=256), fadam.adam(1e-2)
    train_step = torch.compile(lambda p, g, s: fadam.step(tx, p, g, s, donate=donate), backend="eager")
    params, expected = _params(), _params()
    state, expected_state = tx.init(params), reference.init(expected)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = fadam.tree_map(lambda p: torch.randn(p.shape, generator=gen), params)
        params, state = train_step(params, grads, state)
        expected, expected_state = fadam.step(reference, expected, grads, expected_state)
    assert max_rel_err(params, expected)[0] == 0.0
    whole_graph = torch.compile(lambda p, g, s: fadam.step(tx, p, g, s), backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="page_state"):
        whole_graph(params, grads, state)


def test_a_mask_missing_a_leaf_is_named_while_compiling():
    tx = fadam.masked(fadam.adam(1e-2), {"w": True})  # no entry for "b"
    params = _params()
    state = fadam.masked(fadam.adam(1e-2), {"w": True, "b": False}).init(params)
    train_step = torch.compile(lambda p, g, s: tx.update(g, s, p), backend="eager", fullgraph=True)
    # with fullgraph=True dynamo reports the ValueError raised while tracing as Unsupported, with its message
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"ValueError\(\"mask has no entry for \['b'\]"):
        train_step(params, params, state)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_compiled_step_takes_new_tensors_without_recompiling(donate):
    """Nothing in a traced step may depend on which tensor objects come in (an ``id`` or ``is`` of a tensor becomes a
    guard on that object): fresh params and state each call, as after loading a checkpoint, reuse the one graph."""
    tx = fadam.adamw(1e-2)
    torch.compiler.reset()
    counter = CompileCounter()
    train_step = torch.compile(lambda p, g, s: fadam.step(tx, p, g, s, donate=donate), backend=counter, fullgraph=True)
    params = _params()
    state = tx.init(params)
    for _ in range(3):
        params, state = fadam.tree_map(torch.clone, (params, state))
        params, state = train_step(params, fadam.tree_map(torch.ones_like, params), state)
    assert counter.frame_count == 1
