"""optax's L-BFGS as a transform: ``scale_by_lbfgs``, the updates multiplied by the inverse Hessian approximation
of the last pairs of param and update differences (the two-loop recursion of fadam/transforms/_lbfgs.py). Chained
with a line search (``scale_by_zoom_linesearch``) it is optax's ``lbfgs``; ``fadam.lbfgs`` is torch.optim's."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch._C import _functorch

from fadam._base import GradientTransformation
from fadam._numerics import safe_increment, zero_count
from fadam._tree import PyTree, check_leaves, check_params, tree_flatten
from fadam.transforms._lbfgs import _direction, _flat, _real
from fadam.transforms._validation import check_state


class ScaleByLBFGSState(NamedTuple):
    count: torch.Tensor  # 0-d int32: updates taken
    params: PyTree  # the params of the last update
    updates: PyTree  # its incoming updates (a missing one as zeros)
    diff_params_memory: PyTree  # per leaf (memory_size, *shape): param differences, a ring buffer
    diff_updates_memory: PyTree  # per leaf (memory_size, *shape): the matching update differences
    weights_memory: torch.Tensor  # (memory_size,): 1 / (dw . du) of each pair, 0 for an unused slot


def _leaves_of(vector: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``vector`` cut into tensors shaped like ``like`` (a complex one from its pairs of reals)."""
    leaves, offset = [], 0
    for x in like:
        real = _real(x)
        part = vector[offset : offset + real.numel()].reshape(real.shape).to(real.dtype)
        # a copy: a slice at an odd offset cannot be viewed as complex
        leaves.append(torch.view_as_complex(part.clone()) if x.is_complex() else part)
        offset += real.numel()
    return leaves


def _rows(memory: list[torch.Tensor], size: int) -> torch.Tensor:
    """The ring buffer as a ``(size, n)`` matrix: row ``i`` the flat vector of every leaf's slot ``i``."""
    return torch.cat([_real(x).reshape(size, -1) for x in memory], dim=1)


def scale_by_lbfgs(memory_size: int = 10, scale_init_precond: bool = True) -> GradientTransformation:
    r"""Multiplies the updates by L-BFGS's approximation :math:`P_k` of the inverse Hessian, built from the last
    ``memory_size`` differences of params and updates.

    .. math::
        \delta w_{k-1} = w_k - w_{k-1},\quad \delta u_{k-1} = u_k - u_{k-1},\quad
        \rho_{k-1} = 1 / \delta u_{k-1}^\top \delta w_{k-1}\ (0 \text{ where that is } 0),\quad
        P_{k,j+1} = V_j^\top P_{k,j} V_j + \rho_j \delta w_j \delta w_j^\top,\quad V_j = I - \rho_j \delta u_j
        \delta w_j^\top

    from :math:`P_{k,k-m} = \gamma_k I`, :math:`\gamma_k = \delta w_{k-1}^\top \delta u_{k-1} / \|\delta
    u_{k-1}\|^2` with ``scale_init_precond`` (else 1; :math:`\min(1, 1/\|u_0\|)` at the first update); the output is
    :math:`P_k u_k` by the two-loop recursion. The pairs are taken as they come, without a curvature test (torch's
    L-BFGS skips those with :math:`\delta u^\top \delta w \le 10^{-10}`). Its sign is the update's: chain
    ``scale(-1.0)`` and a line search after it, ``chain(scale_by_lbfgs(), scale(-1.0),
    scale_by_zoom_linesearch(15, initial_guess_strategy="one"))``, optax's ``lbfgs``. Complex leaves are taken as
    pairs of reals; a missing update reads as zeros (as torch.optim.LBFGS reads it) and its leaf's output is
    ``None``. The direction is computed outside autograd, as torch.optim.LBFGS's (params that require grad are
    read, no graph is built), and not under ``torch.func`` (the ring buffer's slot is chosen by the count's value).

    Args:
        memory_size: the pairs kept.
        scale_init_precond: scale the initial approximation by :math:`\gamma_k`.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_lbfgs()
        >>> params = [torch.tensor([1.0, 1.0], dtype=torch.float64)]  # f = x^2 + 2 y^2
        >>> u, state = tx.update([torch.tensor([2.0, 4.0], dtype=torch.float64)], tx.init(params), params)
        >>> u  # the first update: u / |u|
        [tensor([0.4472, 0.8944], dtype=torch.float64)]

    References:
        Nocedal & Wright, "Numerical Optimization", 2nd ed., 2006, algorithms 7.4 and 7.5. Liu & Nocedal, "On the
        limited memory BFGS method for large scale optimization", Math. Programming 1989. optax's
        ``optax.scale_by_lbfgs`` (0.2.8), whose semantics these are.
    """
    if isinstance(memory_size, bool) or not isinstance(memory_size, int) or memory_size < 1:
        raise ValueError(f"memory_size must be an int >= 1, got {memory_size!r}")

    def init(params: PyTree) -> ScaleByLBFGSState:
        leaves, spec = tree_flatten(params)
        check_params(params)
        present = [p for p in leaves if p is not None]
        if not present:
            raise ValueError("scale_by_lbfgs needs at least one param")

        def each(make: Any) -> PyTree:
            return spec.unflatten([None if p is None else make(p) for p in leaves])

        dtype = _flat(present, present).dtype
        return ScaleByLBFGSState(
            count=zero_count(),
            params=each(torch.zeros_like),
            updates=each(torch.zeros_like),
            diff_params_memory=each(lambda p: p.new_zeros((memory_size, *p.shape))),
            diff_updates_memory=each(lambda p: p.new_zeros((memory_size, *p.shape))),
            weights_memory=torch.zeros(memory_size, dtype=dtype, device=present[0].device),
        )

    def step(
        x: list[torch.Tensor], u: list[torch.Tensor], old: list[list[torch.Tensor]], state: ScaleByLBFGSState
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]], torch.Tensor]:
        """The direction (flat) from params ``x`` and updates ``u``, and the memories and weights after the pair
        that ends at them is written into slot ``(count - 1) % memory_size``."""
        count = int(state.count)
        zeros = [torch.zeros_like(p) for p in x]
        dw = [p - q for p, q in zip(x, old[0])] if count > 0 else zeros  # no pair before the first update
        du = [g - h for g, h in zip(u, old[1])] if count > 0 else zeros
        dw_flat, du_flat, u_flat = _flat(dw, x), _flat(du, x), _flat(u, x)
        curvature = du_flat.dot(dw_flat)
        slot = torch.tensor([(count - 1) % memory_size])

        def written(memory: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            return memory.index_copy(0, slot.to(memory.device), value.unsqueeze(0).to(memory.dtype))

        memories = [[written(m, d) for m, d in zip(old[2], dw)], [written(m, d) for m, d in zip(old[3], du)]]
        weights = written(state.weights_memory, torch.where(curvature == 0, 0.0, 1 / curvature))
        if not scale_init_precond:
            gamma: Any = 1.0
        elif count > 0:
            squared = du_flat.dot(du_flat)
            gamma = torch.where(squared > 0, curvature / squared, 1.0)
        else:  # the first step: a trust region of radius 1
            gamma = torch.clamp(1 / torch.linalg.vector_norm(u_flat), max=1.0)
        order = [(count + i) % memory_size for i in range(memory_size)]  # oldest first
        ss, ys = (_rows(memory, memory_size) for memory in memories)
        # _direction returns -H g: given -u, it is H u
        direction = _direction(
            u_flat.neg(), [ys[i] for i in order], [ss[i] for i in order], [weights[i] for i in order], gamma
        )
        return direction, memories, weights

    def update(
        updates: PyTree, state: ScaleByLBFGSState, params: PyTree | None = None, **_: Any
    ) -> tuple[PyTree, ScaleByLBFGSState]:
        check_state(state, ScaleByLBFGSState, "scale_by_lbfgs")
        if params is None:
            raise ValueError("scale_by_lbfgs needs params: call update(updates, state, params)")
        if _functorch.maybe_current_level() is not None:
            raise ValueError("scale_by_lbfgs cannot run under torch.func: its ring buffer is indexed by the count")
        grads, param_leaves, spec = check_leaves(updates, params)
        kept = [i for i, p in enumerate(param_leaves) if p is not None]
        x = [param_leaves[i].detach() for i in kept]
        u = [torch.zeros_like(p) if grads[i] is None else grads[i].detach() for p, i in zip(x, kept)]
        old = [[spec.flatten_up_to(tree)[i] for i in kept] for tree in state[1:5]]
        with torch.no_grad():  # the two-loop recursion writes in place, as torch.optim.LBFGS's: no graph through it
            direction, memories, weights = step(x, u, old, state)

        def tree_of(kept_leaves: list[torch.Tensor | None]) -> PyTree:
            leaves: list[Any] = [None] * len(grads)
            for i, leaf in zip(kept, kept_leaves):
                leaves[i] = leaf
            return spec.unflatten(leaves)

        out = [None if grads[i] is None else d.to(grads[i].dtype) for d, i in zip(_leaves_of(direction, x), kept)]
        new_state = ScaleByLBFGSState(
            count=safe_increment(state.count),
            params=tree_of([p.clone() for p in x]),
            updates=tree_of([g.clone() for g in u]),
            diff_params_memory=tree_of(memories[0]),
            diff_updates_memory=tree_of(memories[1]),
            weights_memory=weights,
        )
        return tree_of(out), new_state

    return GradientTransformation(init, update)
