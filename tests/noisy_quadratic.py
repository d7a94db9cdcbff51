"""The problem the matrix optimizers' tests share with their reference scripts (scripts/heavyball_soap_reference.py,
scripts/psgd_kron_reference.py): a noisy quadratic per leaf, in float64."""

from __future__ import annotations

from typing import Any

import torch


def f64(value: Any) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def gradient(name: str, p: torch.Tensor, t: int) -> torch.Tensor:
    """The gradient at ``p`` of leaf ``name``'s quadratic at step ``t``, plus a deterministic noise."""
    index = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
    a = 0.5 + 0.25 * torch.cos(index)
    c = torch.sin(index + len(name))
    return a * (p - c) + 0.5 * torch.sin(1.3 * t + 2.1 * index + len(name))


def start(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}


def ensemble_and_members(tx: Any, shapes: dict[str, tuple[int, ...]], steps: int) -> tuple[dict, list[dict]]:
    """An ensemble of 3 scaled copies of ``start(shapes)`` stepped ``steps`` times under ``torch.func.vmap`` (its
    stacked params), and each member stepped alone by ``fadam.step`` on its own gradients (their params)."""
    from torch.func import vmap

    import fadam

    start_params = start(shapes)
    members = [{k: v * (i + 1) for k, v in start_params.items()} for i in range(3)]
    grads = [
        [{k: gradient(k, p, t) * (1 - 0.5 * i) for k, p in start_params.items()} for i in range(3)]
        for t in range(steps)
    ]
    stacked = {k: torch.stack([m[k] for m in members]) for k in shapes}
    state = vmap(tx.init)(stacked)
    for step_grads in grads:
        g = {k: torch.stack([step_grads[i][k] for i in range(3)]) for k in shapes}
        updates, state = vmap(tx.update)(g, state, stacked)
        stacked = fadam.apply_updates(stacked, updates)
    alone = []
    for i, params in enumerate(members):
        member_state = tx.init(params)
        for step_grads in grads:
            params, member_state = fadam.step(tx, params, step_grads[i], member_state)
        alone.append(params)
    return stacked, alone


def float_state_dtypes_after_bfloat16_steps(tx: Any, shapes: dict[str, tuple[int, ...]], steps: int) -> set:
    """The dtypes of ``tx``'s floating-point state after ``steps`` on bfloat16 params of ``shapes``, each update
    checked to be finite bfloat16 on the way."""
    import fadam

    params = {k: v.to(torch.bfloat16) for k, v in start(shapes).items()}
    state = tx.init(params)
    for t in range(1, steps + 1):
        grads = {k: gradient(k, p.double(), t).bfloat16() for k, p in params.items()}
        updates, state = tx.update(grads, state, params)
        assert all(u.dtype == torch.bfloat16 and torch.isfinite(u).all() for u in updates.values())
        params = fadam.apply_updates(params, updates)
    return {x.dtype for x in fadam._tree.tree_leaves(state) if isinstance(x, torch.Tensor) and x.is_floating_point()}
