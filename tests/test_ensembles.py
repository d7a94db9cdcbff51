"""Ensembles: ``torch.func.vmap`` of ``init``/``update`` over stacked models equals N separate runs.

Every row of the conformance table is covered (rows added later by ``rows_<topic>.py`` files included), plus the
wrappers. The model has one matrix of 4608 elements per member, above the 4096-element threshold under which
quantized optimizers keep fp32 state, so rows with quantized state exercise their blocks and scales per member.
Results are compared bit for bit: batching a per-leaf op does not change its arithmetic (measured on torch 2.13 CPU,
including the per-member norms of ``clip_by_global_norm``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

import fadam
from tests.conformance.table import VALUE_ROWS

N_MEMBERS = 3
STEPS = 3


def _members() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        torch.nn.Sequential(torch.nn.Linear(6, 72), torch.nn.Tanh(), torch.nn.Linear(72, 64), torch.nn.Linear(64, 2))
        for _ in range(N_MEMBERS)
    ]


def _loss(model: torch.nn.Module) -> Callable[[dict, torch.Tensor], torch.Tensor]:
    return lambda p, x: functional_call(model, p, (x,)).square().mean()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(N_MEMBERS, 5, 6, generator=generator) for _ in range(STEPS)]


WRAPPERS: dict[str, Callable[[], fadam.GradientTransformation]] = {
    "clip_by_global_norm+adam": lambda: fadam.chain(fadam.clip_by_global_norm(0.05), fadam.adam(1e-2)),
    "clip_by_global_norm+sgd": lambda: fadam.chain(fadam.clip_by_global_norm(0.05), fadam.sgd(1e-2, momentum=0.9)),
    "masked-adamw": lambda: fadam.masked(fadam.adamw(1e-2), lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    "partition": lambda: fadam.partition(
        {"adam": fadam.adam(1e-2), "sgd": fadam.sgd(1e-2, momentum=0.5)},
        lambda p: {k: "adam" if k.startswith("0.") else "sgd" for k in p},
    ),
    "named_chain": lambda: fadam.named_chain(("clip", fadam.clip(0.01)), ("adam", fadam.adamw(1e-2))),
}
CASES = [pytest.param(row.build, id=row.name) for row in VALUE_ROWS] + [
    pytest.param(make, id=name) for name, make in WRAPPERS.items()
]


def _member(tree: object, i: int) -> object:
    return fadam.tree_map(lambda x: x if x is None else x[i], tree)


def _leaves(tree: object) -> list[torch.Tensor]:
    return [leaf for leaf in fadam._tree.tree_leaves(tree) if leaf is not None]


@pytest.mark.parametrize("make", CASES)
def test_vmap_equals_separate_runs(make: Callable[[], fadam.GradientTransformation]) -> None:
    members = _members()
    params = {k: v.detach() for k, v in stack_module_state(members)[0].items()}
    loss, xs, tx = _loss(members[0]), _batches(), make()
    alone_tx = make()

    state = vmap(tx.init)(params)
    batched = params
    for x in xs:
        updates, state = vmap(tx.update)(vmap(grad(loss))(batched, x), state, batched)
        batched = vmap(fadam.apply_updates)(batched, updates)

    for i in range(N_MEMBERS):
        alone = _member(params, i)
        alone_state = alone_tx.init(alone)
        for x in xs:
            updates, alone_state = alone_tx.update(grad(loss)(alone, x[i]), alone_state, alone)
            alone = fadam.apply_updates(alone, updates)
        for name in alone:
            assert torch.equal(batched[name][i], alone[name]), (name, (batched[name][i] - alone[name]).abs().max())
        member_state, alone_leaves = _leaves(_member(state, i)), _leaves(alone_state)
        assert len(member_state) == len(alone_leaves)
        for b, a in zip(member_state, alone_leaves):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(b, a), (b - a).abs().max()


def test_global_norm_clipping_is_per_member() -> None:
    grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
    tx = fadam.clip_by_global_norm(1.0)
    clipped, _ = vmap(tx.update)(grads, vmap(tx.init)(grads))
    assert torch.equal(clipped["w"], torch.tensor([[0.6, 0.8], [0.3, 0.4]]))
    assert torch.equal(vmap(fadam.tree_global_norm)(grads), torch.tensor([5.0, 0.5]))


@pytest.mark.parametrize("make", [pytest.param(row.build, id=row.name) for row in VALUE_ROWS])
def test_vmap_of_step_equals_update(make: Callable[[], fadam.GradientTransformation]) -> None:
    """``fadam.step`` under vmap declines the fused kernels (no batching rule) and runs the chain."""
    tx = make()
    params = {"w": torch.randn(N_MEMBERS, 4, generator=torch.Generator().manual_seed(2))}
    grads = {"w": torch.linspace(-1, 1, N_MEMBERS * 4).reshape(N_MEMBERS, 4)}
    state = vmap(tx.init)(params)
    stepped, stepped_state = vmap(lambda p, g, s: fadam.step(tx, p, g, s))(params, grads, state)
    updates, updated_state = vmap(tx.update)(grads, state, params)
    assert torch.equal(stepped["w"], fadam.apply_updates(params, updates)["w"])
    for a, b in zip(_leaves(stepped_state), _leaves(updated_state)):
        assert torch.equal(a, b)


SCHEDULED = {
    "scheduled-sgd-dampening+adamw": lambda: fadam.chain(
        fadam.sgd(lambda count: 0.1 / (1 + count), momentum=0.5, dampening=0.2),
        fadam.adamw(lambda count: 1e-2 * (count + 1), weight_decay=0.1),
    )
}
ACCELERATORS = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", ACCELERATORS)
@pytest.mark.parametrize("make", [*CASES, *(pytest.param(m, id=n) for n, m in SCHEDULED.items())])
def test_vmap_on_an_accelerator(make: Callable[[], fadam.GradientTransformation], device: str) -> None:
    """Per-member step counts stay on the CPU while the params live elsewhere: a batched CPU count does not mix with
    an accelerator's tensors the way a 0-d one does, so transforms move what they derive from it. ``meta`` behaves
    like CUDA here (checks devices and shapes); on CUDA the values are compared with the CPU."""
    tx = make()
    params = {"0.weight": torch.randn(N_MEMBERS, 4, 3), "2.bias": torch.randn(N_MEMBERS, 2)}
    grads = fadam.tree_map(torch.ones_like, params)
    on_device = fadam.tree_map(lambda x: x.to(device), (params, grads))
    state, cpu_state = vmap(tx.init)(on_device[0]), vmap(tx.init)(params)
    for _ in range(2):
        updates, state = vmap(tx.update)(on_device[1], state, on_device[0])
        cpu_updates, cpu_state = vmap(tx.update)(grads, cpu_state, params)
    for name, u in updates.items():
        assert u.device.type == device and u.shape == params[name].shape
        if device != "meta":
            torch.testing.assert_close(u.cpu(), cpu_updates[name], rtol=1e-6, atol=1e-7)
