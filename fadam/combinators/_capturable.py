"""``capturable``: a transform whose state lives on the params' device and whose steps read nothing on the host, so
that a donated step can be captured in a CUDA graph and replayed (torch.optim's ``capturable=True``)."""

from __future__ import annotations

from typing import Any

import torch

from fadam._base import FusibleUpdate, GradientTransformation, _write_into, step
from fadam._numerics import resident
from fadam._tree import PyTree
from fadam.combinators._wrappers import _device_of

__all__ = ["capturable"]


def capturable(tx: GradientTransformation) -> GradientTransformation:
    r"""``tx`` with its step counts on the params' device and steps that read no device value on the host: what
    ``torch.optim.AdamW(fused=True, capturable=True)`` gives, for any chain.

    ``init`` builds ``tx``'s state with the params' device as torch's default device, so that the step counts, the
    counters of ``apply_if_finite`` and ``MultiSteps`` and every other 0-d tensor ``tx.init`` creates live there, not on
    the CPU. ``update`` and ``fadam.step`` run ``tx`` with every count and every scalar computed from one kept as a
    tensor where it lives (``fadam._numerics.resident``): bias corrections, schedules and the values of
    ``inject_hyperparams``' schedules are computed by torch ops on the device; ``apply_if_finite`` and ``MultiSteps``
    compute both outcomes and select one, as under ``torch.compile``; torch's fused kernels get ``lr`` and ``step`` as
    device tensors, as their capturable mode takes them (SGD's, which takes the first step as a flag, gives way to the
    generated kernel where there is momentum); the generated Triton kernel gets its scalars as one device tensor built
    by torch ops and reuses its table of the leaves' pointers while they are unchanged. The numbers are ``tx``'s on
    the backend that runs them: where the plain step would read a decision on the host to take torch's fused kernel
    (``apply_if_finite``, ``MultiSteps``, SGD with momentum), they are the generated kernel's. A donated
    ``fadam.step`` writes the new params and the new state into the given ones (counts included): the same storage at
    every step, so a step captured in a CUDA graph after a first step outside it replays it, and nothing is read back
    to the host to decide anything. On the CPU the same route runs (it is what ``fadam.Optimizer(capturable=True)``
    runs there), and reads nothing on the host but what the C++ kernel reads of its scalars, where the host holds them.

    Wrap the whole transform: the counts of the members ``tx`` holds move with it, and an inner ``capturable`` in a
    chain is an opaque member there. Numbers given to ``inject_hyperparams`` stay numbers on the host, where its
    factory reads them (a captured graph keeps the values it was captured with, as torch.optim keeps its float
    hyperparameters); its schedules' values are device tensors, which the factory's argument checks then leave
    unread (as torch.optim's capturable steps leave a tensor lr unchecked). A step with extra arguments
    (``fadam.step(..., value=...)``) or on ``fadam.backend("eager")`` runs ``tx.update`` and returns a new state
    (``fadam.Optimizer`` copies that into the old one).

    Args:
        tx: the transform to run.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.capturable(fadam.adamw(1e-2))
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> count = state[0].count
        >>> params, state = fadam.step(tx, params, {"w": torch.ones(2)}, state, donate=True)
        >>> state[0].count is count, int(count)
        (True, 1)

    References:
        torch.optim's ``capturable`` flag; "CUDA Graphs", the PyTorch documentation (torch.cuda.graph).
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"capturable expects a GradientTransformation, got {type(tx).__name__}")

    def init(params: PyTree) -> PyTree:
        with torch.device(_device_of(params)), resident():
            return tx.init(params)

    def update(
        updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, PyTree]:
        if torch.compiler.is_compiling():  # a traced step reads nothing back already
            return tx.update(updates, state, params, **extra_args)
        with resident():
            return tx.update(updates, state, params, **extra_args)

    def fused_step(params: PyTree, grads: PyTree, state: PyTree, donate: bool) -> tuple[PyTree, PyTree] | None:
        """``fadam.step``: ``tx``'s step by its fastest backend, its new state written into the donated one."""
        if torch.compiler.is_compiling():  # fadam.step traces the update and writes into the donated buffers itself
            return None
        with resident():
            new_params, new_state = step(tx, params, grads, state, donate=donate)
        return new_params, _write_into(state, new_state) if donate else new_state

    return GradientTransformation(init, FusibleUpdate(update, fused_step))
