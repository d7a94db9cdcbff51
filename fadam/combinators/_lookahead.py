"""Lookahead: ``lookahead`` (k fast steps forward, one slow step back) over ``LookaheadParams``, as optax's."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import zero_count
from fadam._tree import PyTree, check_leaves, tree_map
from fadam.combinators._wrappers import _host_bool, _select
from fadam.transforms._validation import check_state


class LookaheadState(NamedTuple):
    fast_state: PyTree  # the fast optimizer's state
    steps_since_sync: torch.Tensor  # 0-d int32: fast steps since the last synchronisation


class LookaheadParams(NamedTuple):
    """The pair of params lookahead steps: take gradients at ``fast``, evaluate (and deploy) ``slow``."""

    fast: PyTree
    slow: PyTree

    @classmethod
    def init_synced(cls, params: PyTree) -> LookaheadParams:
        """Both sequences at ``params`` (the slow ones a copy, so that no two leaves share memory)."""
        return cls(fast=params, slow=tree_map(lambda p: None if p is None else p.detach().clone(), params))


def lookahead(
    fast_optimizer: GradientTransformation,
    sync_period: int,
    slow_step_size: float | torch.Tensor,
    reset_state: bool = False,
) -> GradientTransformation:
    r"""Lookahead: the fast optimizer takes ``sync_period`` steps, then the slow params move towards the fast ones
    and the fast params restart from them.

    .. math::
        \phi_{t+1} = \theta_t + u_t \text{ (the fast step)};\ \text{every } k\text{-th step: }
        s' = s + \alpha (\phi_{t+1} - s),\quad \theta_{t+1} = s'

    with :math:`\theta` the fast params, :math:`s` the slow ones, :math:`u_t` the fast optimizer's update at
    :math:`\theta_t`, :math:`k` ``sync_period`` and :math:`\alpha` ``slow_step_size``. As optax's ``lookahead``, the
    params are a ``LookaheadParams(fast, slow)`` (``LookaheadParams.init_synced(params)`` to start), the gradients
    are taken at ``params.fast``, and the update is a ``LookaheadParams`` of updates for both, applied with
    ``apply_updates`` (or ``fadam.step``) and not to be changed before. ``init`` also takes the fast params alone.

    For PyTorch: a synchronising step is told from the others by the count in the state; where that count can be
    read for free (an eager step on the CPU) only the step taken is computed, and ``reset_state`` calls the fast
    optimizer's ``init`` on synchronising steps only. Under ``torch.func`` or ``torch.compile`` both are computed and
    selected with ``torch.where`` (optax's arithmetic select, exact for infinite values too). A ``None`` fast update
    leaves its leaf out of the fast step, but a synchronising step still moves both of its params (torch's
    param groups synchronise every param). ``init_synced`` copies the slow params, so that no two leaves of the
    tree share memory (a donated ``fadam.step`` writes into them).

    Args:
        fast_optimizer: the inner optimizer, stepping the fast params.
        sync_period: :math:`k`, the fast steps between synchronisations (>= 1).
        slow_step_size: :math:`\alpha`, the slow params' step towards the fast ones.
        reset_state: re-initialise the fast optimizer's state at each synchronisation.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.lookahead(fadam.sgd(0.5), sync_period=2, slow_step_size=0.5)
        >>> params = fadam.LookaheadParams.init_synced([torch.tensor([4.0])])
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     updates, state = tx.update([torch.ones(1)], state, params)
        ...     params = fadam.apply_updates(params, updates)
        >>> params  # fast: 4 - 0.5 - 0.5 = 3, then both at 4 + 0.5 (3 - 4)
        LookaheadParams(fast=[tensor([3.5000])], slow=[tensor([3.5000])])

    References:
        Zhang et al., "Lookahead Optimizer: k steps forward, 1 step back", NeurIPS 2019.
        optax's ``optax.lookahead`` (0.2.8), whose contract this is.
    """
    if not isinstance(sync_period, int) or sync_period < 1:
        raise ValueError(f"Invalid sync_period: {sync_period} (expected an int >= 1)")

    def init(params: PyTree) -> LookaheadState:
        fast = params.fast if isinstance(params, LookaheadParams) else params
        return LookaheadState(fast_optimizer.init(fast), zero_count())

    def synced(updates: PyTree, params: LookaheadParams) -> LookaheadParams:
        """The updates of a synchronising step: the slow params to ``s + alpha (f + u - s)``, the fast ones too."""
        leaves, fast, spec = check_leaves(updates, params.fast)
        slow = spec.flatten_up_to(params.slow)
        fast_updates, slow_updates = [], []
        for u, f, s in zip(leaves, fast, slow):
            if f is None:
                fast_updates.append(None)
                slow_updates.append(None)
                continue
            difference = f - s if u is None else f + u - s
            slow_updates.append(slow_step_size * difference)
            pulled = difference * (1 - slow_step_size)
            fast_updates.append(-pulled if u is None else u - pulled)
        return LookaheadParams(spec.unflatten(fast_updates), spec.unflatten(slow_updates))

    def update(
        updates: PyTree, state: LookaheadState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[LookaheadParams, LookaheadState]:
        check_state(state, LookaheadState, "lookahead")
        if not isinstance(params, LookaheadParams):
            raise ValueError(
                "lookahead needs its params as fadam.LookaheadParams(fast, slow) "
                "(LookaheadParams.init_synced(params) to start), and the gradients taken at params.fast"
            )
        fast_updates, fast_state = fast_optimizer.update(updates, state.fast_state, params.fast, **extra_args)
        sync_next = state.steps_since_sync == sync_period - 1
        steps_since_sync = torch.remainder(state.steps_since_sync + 1, sync_period).to(torch.int32)
        decided = _host_bool(sync_next)
        if decided is False:
            no_slow = tree_map(lambda p: None, params.slow)
            return LookaheadParams(fast_updates, no_slow), LookaheadState(fast_state, steps_since_sync)
        sync_updates = synced(fast_updates, params)
        if reset_state:
            initial = fast_optimizer.init(params.fast)
            fast_state = initial if decided else _select(sync_next, initial, fast_state)
        if decided:
            return sync_updates, LookaheadState(fast_state, steps_since_sync)
        zeros = tree_map(lambda s: None if s is None else torch.zeros_like(s), params.slow)
        plain = LookaheadParams(fast_updates, zeros)
        chosen = tree_map(
            lambda a, b: b if a is None else torch.where(sync_next.to(a.device), a, b if b is not None else 0.0),
            sync_updates,
            plain,
        )
        return chosen, LookaheadState(fast_state, steps_since_sync)

    return GradientTransformation(init, update)
