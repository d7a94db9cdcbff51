"""Gradient noise: ``add_noise`` (Gaussian noise whose variance is annealed with the step)."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import safe_increment, zero_count
from fadam._tree import PyTree, tree_flatten
from fadam.transforms._validation import check_non_negative, check_state

_KEY_RANGE = 2**62  # keys drawn for the next step and for each leaf: non-negative int64 seeds


class AddNoiseState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken
    rng_key: torch.Tensor  # 0-d int64: the seed of this step's noise


def add_noise(
    eta: float | torch.Tensor,
    gamma: float | torch.Tensor,
    key: int | torch.Tensor | None = None,
    *,
    seed: int | None = None,
) -> GradientTransformation:
    r"""Adds Gaussian noise of annealed variance to the updates (optax's ``add_noise``).

    .. math::
        u_t = g_t + \sigma_t\, \xi_t,\quad \xi_t \sim \mathcal N(0, I),\quad \sigma_t^2 = \frac{\eta}{t^{\gamma}}
        \quad (t = 1, 2, \dots)

    The noise is a function of the state alone: the same state and updates give the same noise (``update`` is
    pure), and every step draws new noise. The state's ``rng_key`` seeds a CPU ``torch.Generator`` that draws the next
    step's key and one seed per leaf; each leaf's noise is drawn on its own device, in its dtype, from a generator
    of that device seeded with its seed. (jax's generator differs: the noise is not optax's bit for bit.) A complex
    leaf gets complex noise of variance :math:`\sigma_t^2` (half in each part), as jax and torch draw it. The seed is
    read on the host, so the update does not run under ``torch.func`` transforms or ``torch.compile``.

    Args:
        eta: the initial variance :math:`\eta`.
        gamma: the annealing exponent :math:`\gamma`.
        key: the seed of the first step's noise, an int or a 0-d integer tensor (default 0, with a warning, as
            optax).
        seed: the deprecated name of ``key`` (optax's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.add_noise(eta=0.01, gamma=0.55, key=0)
        >>> state = tx.init([torch.zeros(3)])
        >>> a, _ = tx.update([torch.zeros(3)], state)
        >>> b, _ = tx.update([torch.zeros(3)], state)
        >>> torch.equal(a[0], b[0]), bool(a[0].abs().max() > 0)  # the same state: the same noise
        (True, True)

    References:
        Neelakantan et al., "Adding Gradient Noise Improves Learning for Very Deep Networks", 2015. optax's
        ``optax.add_noise`` (0.2.8), whose semantics these are.
    """
    check_non_negative("eta", eta)
    if seed is not None:
        warnings.warn('"seed" is deprecated, use "key"', DeprecationWarning, stacklevel=2)
        if key is not None:
            raise ValueError("Only one of seed or key can be specified.")
        key = seed
    if key is None:
        warnings.warn("add_noise without a key: the noise is seeded with 0", stacklevel=2)
        key = 0
    first_key = int(key)

    def init(params: PyTree) -> AddNoiseState:
        return AddNoiseState(zero_count(), torch.tensor(first_key, dtype=torch.int64))

    def update(
        updates: PyTree, state: AddNoiseState, params: PyTree | None = None, **_: object
    ) -> tuple[PyTree, AddNoiseState]:
        check_state(state, AddNoiseState, "add_noise")
        if torch._C._functorch.maybe_current_level() is not None:
            # the key is read on the host to seed a torch.Generator, which torch.func cannot batch or differentiate
            raise ValueError("add_noise cannot run under torch.func (vmap, grad): its key seeds a torch.Generator")
        steps = safe_increment(state.count)
        standard_deviation = torch.sqrt(eta / steps.to(torch.float64) ** gamma)
        generator = torch.Generator().manual_seed(int(state.rng_key))
        next_key = torch.randint(_KEY_RANGE, (), generator=generator, dtype=torch.int64)
        leaves, spec = tree_flatten(updates)
        noisy = []
        for u in leaves:
            leaf_seed = int(torch.randint(_KEY_RANGE, (), generator=generator, dtype=torch.int64))
            if u is None:
                noisy.append(None)
                continue
            leaf_generator = torch.Generator(device=u.device).manual_seed(leaf_seed)
            noise = torch.randn(u.shape, generator=leaf_generator, dtype=u.dtype, device=u.device)
            noisy.append(u + noise * standard_deviation.to(u.device, u.real.dtype))
        return spec.unflatten(noisy), AddNoiseState(steps, next_key)

    return GradientTransformation(init, update)
