"""torch.optim.LBFGS's state as ``fadam.lbfgs``'s ``LbfgsState``, and back: what ``fadam.state_from_torch`` and
``fadam.state_to_torch`` do for L-BFGS.

torch.optim.LBFGS keeps one state for all its params, in the dict of its first param: ``func_evals`` and ``n_iter``
(ints), and once it has iterated (``n_iter`` of at least 1) the flat vectors ``d`` and ``prev_flat_grad``, the step
length ``t`` (a float or a 0-d tensor), the pairs ``old_dirs`` and ``old_stps`` (lists of flat vectors, oldest
first) with their ``ro`` (0-d tensors), ``H_diag`` (1 until a pair is kept, then a 0-d tensor) and ``prev_loss`` (a
float); from its second iteration on also ``al``, scratch space that each iteration writes before reading it, which
is not converted (torch creates it again). Its flat vectors lay the params out one after the other in the
optimizer's order, as ``fadam.lbfgs`` lays them out in the order the params are given; ``LbfgsState`` keeps
``history_size`` pairs, of which the first ``num_old`` are in use.
"""

from __future__ import annotations

from typing import Any

import torch

from fadam._tree import PyTree, tree_flatten
from fadam.transforms._lbfgs import LbfgsState, _given_order

__all__ = ["lbfgs_from_torch", "lbfgs_to_torch"]

_COUNTS = frozenset({"func_evals", "n_iter"})
_ITERATED = _COUNTS | {"d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss"}
_SCRATCH = "al"


def _as(value: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    """torch's ``value`` as a copy in the dtype and on the device of fadam's ``like``, which has its shape."""
    value = torch.as_tensor(value)
    if value.shape != like.shape:
        raise ValueError(
            f"torch.optim.LBFGS's {name} has shape {tuple(value.shape)}, fadam.lbfgs's for these params "
            f"{tuple(like.shape)}"
        )
    return value.detach().to(dtype=like.dtype, device=like.device, copy=True)


def _pairs(torch_state: dict[str, Any], state: LbfgsState) -> dict[str, Any]:
    """The history fields of ``state`` holding torch's pairs, the unused ones zero."""
    used, history = len(torch_state["old_dirs"]), len(state.old_dirs)
    if used > history:
        raise ValueError(f"torch.optim.LBFGS holds {used} pairs, more than fadam.lbfgs's history_size {history}")
    if len(torch_state["old_stps"]) != used or len(torch_state["ro"]) != used:
        raise ValueError("torch.optim.LBFGS's old_dirs, old_stps and ro hold different numbers of pairs")
    fields = {}
    for name in ("old_dirs", "old_stps", "ro"):
        zeros = getattr(state, name)
        given = [_as(value, zeros[i], f"{name}[{i}]") for i, value in enumerate(torch_state[name])]
        fields[name] = (*given, *zeros[used:])
    return {**fields, "num_old": torch.tensor(used)}


def lbfgs_from_torch(
    per_param: list[dict[str, Any]], state: LbfgsState, params: PyTree, count: int | None
) -> LbfgsState:
    """``state`` (``fadam.lbfgs``'s ``init``) holding torch.optim.LBFGS's state, ``per_param`` being torch's per-param
    state of each leaf of ``params`` in optree's order; ``count`` (the updates taken, for a learning-rate schedule)
    defaults to 1 once torch has stepped, as torch keeps no step count.

    Example:
        >>> import torch, fadam
        >>> from fadam._lbfgs_state import lbfgs_from_torch
        >>> w = torch.zeros(2, requires_grad=True)
        >>> opt = torch.optim.LBFGS([w], max_iter=3)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = ((w - 1) ** 2).sum()
        ...     loss.backward()
        ...     return loss
        >>> _ = opt.step(closure)
        >>> tx = fadam.lbfgs(max_iter=3)
        >>> state = lbfgs_from_torch([opt.state[w]], tx.init([w.detach()]), [w.detach()], None)
        >>> int(state.n_iter), int(state.func_evals), int(state.num_old)  # optimal after two iterations
        (2, 3, 1)
    """
    first = _given_order(params)[0]  # the first param given: torch's first param
    elsewhere = [i for i, entry in enumerate(per_param) if entry and i != first]
    if elsewhere:
        raise ValueError(
            "torch.optim.LBFGS keeps its state in its first param's, but it is found at params leaf "
            f"{elsewhere[0]}: give the params in the optimizer's order"
        )
    torch_state = per_param[first]
    stepped = {key for key in torch_state if key != _SCRATCH}
    iterated = bool(torch_state.get("n_iter", 0))
    expected = _ITERATED if iterated else _COUNTS
    if torch_state and stepped != expected:
        raise ValueError(
            f"cannot convert torch.optim.LBFGS state: expected keys {sorted(expected)}, found {sorted(torch_state)}"
        )
    count = int(bool(torch_state)) if count is None else count
    state = state._replace(count=torch.tensor(count, dtype=state.count.dtype))
    if not torch_state:
        return state
    state = state._replace(
        func_evals=torch.tensor(int(torch_state["func_evals"])), n_iter=torch.tensor(int(torch_state["n_iter"]))
    )
    if not iterated:
        return state
    return state._replace(
        d=_as(torch_state["d"], state.d, "d"),
        t=torch.tensor(float(torch_state["t"]), dtype=torch.float64),
        h_diag=_as(torch_state["H_diag"], state.h_diag, "H_diag"),
        prev_flat_grad=_as(torch_state["prev_flat_grad"], state.prev_flat_grad, "prev_flat_grad"),
        prev_loss=torch.tensor(float(torch_state["prev_loss"]), dtype=torch.float64),
        **_pairs(torch_state, state),
    )


def _torch_entry(state: LbfgsState) -> dict[str, Any]:
    """torch.optim.LBFGS's state dict of its first param, for ``state``."""
    entry: dict[str, Any] = {"func_evals": int(state.func_evals), "n_iter": int(state.n_iter)}
    if not entry["n_iter"]:
        return entry
    used = int(state.num_old)
    # copies: torch writes prev_flat_grad in place at its next iteration
    return {
        **entry,
        "d": state.d.detach().clone(),
        "t": float(state.t),
        "old_dirs": [y.detach().clone() for y in state.old_dirs[:used]],
        "old_stps": [s.detach().clone() for s in state.old_stps[:used]],
        "ro": [r.detach().clone() for r in state.ro[:used]],
        "H_diag": state.h_diag.detach().clone(),
        "prev_flat_grad": state.prev_flat_grad.detach().clone(),
        "prev_loss": float(state.prev_loss),
    }


def lbfgs_to_torch(state: Any, params: PyTree, optimizer: torch.optim.LBFGS, count: int | None) -> dict[str, Any]:
    """A ``state_dict`` for ``optimizer`` (torch.optim.LBFGS) holding ``fadam.lbfgs``'s ``state`` for ``params``,
    given in the optimizer's order (its own tensors, or tensors of the same shapes). Empty before the first step, as
    torch's.

    Example:
        >>> import torch, fadam
        >>> from fadam._lbfgs_state import lbfgs_to_torch
        >>> w = torch.zeros(2, requires_grad=True)
        >>> tx = fadam.lbfgs(max_iter=3)
        >>> def value_fn(p):
        ...     return float(((p[0] - 1) ** 2).sum()), [2 * (p[0] - 1)]
        >>> loss, grads = value_fn([w.detach()])
        >>> _, state = tx.update(grads, tx.init([w.detach()]), [w.detach()], value=loss, value_fn=value_fn)
        >>> opt = torch.optim.LBFGS([w], max_iter=3)
        >>> opt.load_state_dict(lbfgs_to_torch(state, [w], opt, None))
        >>> opt.state[w]["n_iter"], len(opt.state[w]["old_dirs"])
        (2, 1)
    """
    if not isinstance(state, LbfgsState):
        raise ValueError(
            "state_to_torch converts fadam.lbfgs's state (LbfgsState) into torch.optim.LBFGS, got "
            f"{type(state).__name__}"
        )
    if count is not None:
        raise ValueError("torch.optim.LBFGS keeps no step count: count does not apply")
    leaves = tree_flatten(params)[0]
    given = [leaves[i] for i in _given_order(params)]
    theirs = list(optimizer.param_groups[0]["params"])
    if [tuple(p.shape) for p in given] != [tuple(p.shape) for p in theirs] or (
        {id(p) for p in given} == {id(p) for p in theirs} and any(a is not b for a, b in zip(given, theirs))
    ):
        raise ValueError(
            "params must be torch.optim.LBFGS's params, or tensors of their shapes, in the optimizer's order"
        )
    sd = optimizer.state_dict()
    entry = _torch_entry(state)
    first = sd["param_groups"][0]["params"][0]
    return {"state": {first: entry} if entry["func_evals"] else {}, "param_groups": sd["param_groups"]}
