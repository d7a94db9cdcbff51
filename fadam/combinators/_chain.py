"""Composition: ``chain`` and ``named_chain``."""

from __future__ import annotations

from typing import Any

from fadam._base import GradientTransformation
from fadam._execute import run_update
from fadam._program import Program, program_of, with_program
from fadam._sparse import check_sparse
from fadam._tree import PyTree, check_leaves, check_params, match_params


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies transforms in order; the state is the tuple of their states.

    Extra keyword arguments given to ``update`` reach every transform in the chain. The updates are checked against
    the params (or, without params, for being dense floating-point tensors) before any transform runs, so bad input
    raises a ``ValueError`` naming the leaf's path even when no member of the chain would check it. Given params, each
    update is cast to its param's dtype where that is wider (float16 gradients of float32 params are computed in
    float32, as torch.optim computes in the param's dtype) and laid out as the params (a dict and an OrderedDict with
    the same keys are the same tree). A sparse COO update (``nn.Embedding(sparse=True)``'s gradient) is refused then,
    naming the member, unless every member it reaches takes it (``fadam._sparse``).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.chain(fadam.clip(1.0), fadam.scale(-0.1))
        >>> tx.update([torch.tensor([5.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([-0.1000])]
    """
    for index, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain argument {index} is a {type(tx).__name__}, expected a GradientTransformation")

    program = Program(
        tuple(stage for index, tx in enumerate(transforms) for stage in program_of(tx).prefixed(index).stages)
    )

    def init(params: PyTree) -> tuple[PyTree, ...]:
        check_params(params)
        return tuple(tx.init(params) for tx in transforms)

    def update(
        updates: PyTree, state: tuple[PyTree, ...], params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, tuple[PyTree, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transforms got a state that is not a tuple of that length")
        if params is None:
            leaves, _, spec = check_leaves(updates, updates, sparse=True)
        else:
            updates, leaves, spec = match_params(updates, params, sparse=True)
        check_sparse(program, leaves, spec, params, state)  # each member's rule for sparse gradients
        # the generated kernel where the leaves allow it (opaque members would need the extra arguments)
        compiled = run_update(program, updates, state, params) if program.declared and not extra_args else None
        if compiled is not None:
            return compiled
        new_states = []
        for tx, tx_state in zip(transforms, state):
            updates, tx_state = tx.update(updates, tx_state, params, **extra_args)
            new_states.append(tx_state)
        return updates, tuple(new_states)

    return with_program(init, update, program)


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like ``chain``, with each state stored under a name: the state is a dict ``name -> state``.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.named_chain(("adam", fadam.scale_by_adam()), ("lr", fadam.scale(-1e-3)))
        >>> sorted(tx.init({"w": torch.zeros(2)}))
        ['adam', 'lr']
    """
    names = [name for name, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain names must be unique, got {names}")
    inner = chain(*(tx for _, tx in transforms))

    def init(params: PyTree) -> dict[str, PyTree]:
        return dict(zip(names, inner.init(params)))

    def update(
        updates: PyTree, state: dict[str, PyTree], params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, dict[str, PyTree]]:
        updates, states = inner.update(updates, tuple(state[name] for name in names), params, **extra_args)
        return updates, dict(zip(names, states))

    return with_program(
        init,
        update,
        Program(tuple(stage for name, tx in transforms for stage in program_of(tx).prefixed(name).stages)),
    )
