"""fadam inside torch.compile: donated buffers written in place, and compiled torch.func transforms through steps.

The conformance battery (tests/conformance/test_battery.py) compiles every optimizer's step with ``fullgraph=True``;
these tests check what a compiled graph does with the buffers and with ``torch.func.grad`` and ``vmap`` around it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.func import grad, vmap

import fadam
from tests.tree_checks import max_rel_err, tensor_leaves

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
