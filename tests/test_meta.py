"""fadam.meta: MetaOptimizer against a purely functional inner loop, snapshot/restore, truncation, vmap over tasks and
memory across outer iterations."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fadam

F64 = torch.float64
STEPS = 4


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)


def _task(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    amplitude, phase = 0.1 + 4.9 * torch.rand(1, generator=gen, dtype=F64), torch.pi * torch.rand(1, generator=gen)
    x = 10 * torch.rand(20, 1, generator=gen, dtype=F64) - 5
    y = amplitude * torch.sin(x + phase)
    return x[:10], y[:10], x[10:], y[10:]


def _mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((pred - y) ** 2).mean()


def _functional_adapt(net: nn.Module, tx: fadam.GradientTransformation, params: dict, x: torch.Tensor, y: torch.Tensor):
    def loss(p: dict) -> torch.Tensor:
        return _mse(functional_call(net, p, (x,)), y)

    state = tx.init(params)
    for _ in range(STEPS):
        params, state = fadam.step(tx, params, torch.func.grad(loss)(params), state)
    return params


def test_meta_optimizer_matches_a_functional_inner_loop() -> None:
    net = _net()
    x, y, xq, yq = _task(1)
    lr = torch.tensor(0.05, dtype=F64, requires_grad=True)
    meta_params = dict(net.named_parameters())
    opt = fadam.MetaOptimizer(net, fadam.adam(lr=lr, betas=(0.8, 0.9)))
    for _ in range(STEPS):
        opt.step(_mse(net(x), y))
    assert all(not p.is_leaf for p in net.parameters())  # the module now holds graph tensors
    module_grads = torch.autograd.grad(_mse(net(xq), yq), [*meta_params.values(), lr])

    def outer(params: dict, lr: torch.Tensor) -> torch.Tensor:
        adapted = _functional_adapt(net, fadam.adam(lr=lr, betas=(0.8, 0.9)), params, x, y)
        return _mse(functional_call(net, adapted, (xq,)), yq)

    detached = {k: v.detach() for k, v in meta_params.items()}
    func_grads = torch.func.grad(outer, argnums=(0, 1))(detached, lr.detach())
    for expected, actual in zip(module_grads, [*func_grads[0].values(), func_grads[1]]):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)
    # nothing was modified in place: the meta-parameters still hold their initial values
    for name, p in _net().named_parameters():
        assert torch.equal(meta_params[name].detach(), p.detach())


def test_tied_and_frozen_parameters() -> None:
    torch.manual_seed(0)
    embed = nn.Linear(3, 3, bias=False).to(F64)
    net = nn.Sequential(embed, nn.Tanh(), embed, nn.Linear(3, 1).to(F64))
    net[3].bias.requires_grad_(False)
    frozen = net[3].bias
    opt = fadam.MetaOptimizer(net, fadam.sgd(lr=0.1))
    assert sorted(opt.params()) == ["0.weight", "3.bias", "3.weight"]
    x = torch.randn(5, 3, dtype=F64)
    opt.step(net(x).pow(2).sum())
    assert net[0].weight is net[2].weight and not net[0].weight.is_leaf
    assert net[3].bias is frozen


def test_snapshot_restore_between_tasks() -> None:
    net = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).to(F64)
    opt = fadam.MetaOptimizer(net, fadam.adam(lr=0.1))
    params_before = list(net.parameters())
    mean_before = net[1].running_mean.clone()
    start = opt.snapshot()
    frozen = opt.snapshot(detach=True)
    x = torch.randn(8, 2, dtype=F64)
    for _ in range(3):
        opt.step(net(x).pow(2).mean())
    assert not torch.equal(net[1].running_mean, mean_before)
    assert int(opt.state[0].count) == 3
    opt.restore(start)
    assert all(a is b for a, b in zip(net.parameters(), params_before))  # the very meta-parameters are back
    assert torch.equal(net[1].running_mean, mean_before)
    assert int(opt.state[0].count) == 0 and opt.steps == 0
    assert all(t.grad_fn is None for t in fadam._tree.tree_leaves(frozen) if isinstance(t, torch.Tensor))
    assert all(torch.equal(a, b.detach()) for a, b in zip(frozen.params.values(), params_before))
    with pytest.raises(ValueError, match="snapshot has parameters"):
        opt.restore(start._replace(params={"0.weight": params_before[0]}))


def test_truncate_is_stop_gradient_every_k_steps() -> None:
    x, y, xq, yq = _task(2)
    grads = []
    for truncated in (True, False):
        net = _net()
        lr = torch.tensor(0.05, dtype=F64, requires_grad=True)
        opt = fadam.MetaOptimizer(net, fadam.adam(lr=lr), truncate=2 if truncated else None)
        for step in range(5):
            if not truncated and step in (2, 4):
                opt.stop_gradient()
            opt.step(_mse(net(x), y))
        grads.append(torch.autograd.grad(_mse(net(xq), yq), lr)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    # the meta-parameters are cut off: only the last step's graph is left
    assert all(p.grad_fn is not None and p.grad_fn.next_functions for p in net.parameters())


def test_stop_gradient_keeps_values_and_requires_grad() -> None:
    w = torch.ones(2, requires_grad=True)
    tree = {"a": w * 2, "count": torch.zeros([], dtype=torch.int32), "none": None}
    cut = fadam.stop_gradient(tree)
    assert cut["a"].is_leaf and cut["a"].requires_grad and torch.equal(cut["a"], tree["a"].detach())
    assert not cut["count"].requires_grad and cut["none"] is None


def test_functional_maml_vmapped_over_tasks_matches_a_loop() -> None:
    net = _net()
    tasks = [_task(seed) for seed in range(4)]
    xs, ys, xqs, yqs = (torch.stack(parts) for parts in zip(*tasks))
    params = {k: v.detach() for k, v in net.named_parameters()}
    tx = fadam.sgd(lr=0.05, momentum=0.5)

    def task_loss(params: dict, x: torch.Tensor, y: torch.Tensor, xq: torch.Tensor, yq: torch.Tensor) -> torch.Tensor:
        adapted = _functional_adapt(net, tx, params, x, y)
        return _mse(functional_call(net, adapted, (xq,)), yq)

    def meta_loss(params: dict) -> torch.Tensor:
        return torch.func.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xqs, yqs).mean()

    batched = torch.func.grad(meta_loss)(params)
    looped = [torch.func.grad(task_loss)(params, *task) for task in tasks]
    for name in params:
        torch.testing.assert_close(batched[name], sum(g[name] for g in looped) / len(tasks), rtol=1e-10, atol=1e-12)


def _live_tensors() -> int:
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


@pytest.mark.parametrize("truncate", [None, 2])
def test_no_memory_is_retained_across_outer_iterations(truncate: int | None) -> None:
    """50 MAML outer iterations (meta-learning the init and the inner lr, outer step by torch.optim.Adam): every
    graph tensor of an iteration dies by reference counting alone (no cycles) once the next task is restored, and the
    number of live tensors does not grow."""
    net = _net()
    lr = torch.tensor(0.05, dtype=F64, requires_grad=True)
    inner = fadam.MetaOptimizer(net, fadam.adam(lr=lr, moment_requires_grad=True), truncate=truncate)
    outer = torch.optim.Adam([*net.parameters(), lr], lr=1e-3)
    meta = inner.snapshot()
    previous: list[weakref.ref] = []
    live = []
    gc.collect()
    gc.disable()  # the weakrefs below must die from reference counting alone
    try:
        for iteration in range(50):
            inner.restore(meta)
            assert all(ref() is None for ref in previous), f"iteration {iteration - 1} left graph tensors alive"
            x, y, xq, yq = _task(iteration)
            for _ in range(3):
                inner.step(_mse(net(x), y))
            query_loss = _mse(net(xq), yq)
            graph_tensors = [*inner.params().values(), *fadam._tree.tree_leaves(inner.state), query_loss]
            previous = [weakref.ref(t) for t in graph_tensors if isinstance(t, torch.Tensor)]
            outer.zero_grad()
            query_loss.backward()
            # truncation after 2 of 3 steps cuts the init off; the lr of the last step still gets its gradient
            assert (meta.params["0.weight"].grad is None) == (truncate is not None) and lr.grad is not None
            outer.step()
            del query_loss, graph_tensors
            if iteration % 10 == 9:  # a scan of every Python object: a few times suffice
                live.append(_live_tensors())
    finally:
        gc.enable()
    assert len(previous) > 10
    assert float(lr.detach()) != 0.05
    inner.restore(meta)
    assert all(ref() is None for ref in previous)
    assert len(live) == 5 and max(live) == min(live), live


def test_meta_optimizer_argument_errors() -> None:
    with pytest.raises(TypeError, match="an nn"):
        fadam.MetaOptimizer({"w": torch.ones(1)}, fadam.sgd())
    with pytest.raises(TypeError, match="GradientTransformation"):
        fadam.MetaOptimizer(nn.Linear(1, 1), torch.optim.SGD)
    with pytest.raises(ValueError, match="truncate"):
        fadam.MetaOptimizer(nn.Linear(1, 1), fadam.sgd(), truncate=0)
    net = nn.Linear(1, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter"):
        fadam.MetaOptimizer(net, fadam.sgd()).step(net(torch.ones(1, 1)).sum())
