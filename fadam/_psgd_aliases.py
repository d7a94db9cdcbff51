"""PSGD Kron with kron_torch's signature (``psgd_kron``), a ``chain`` of transforms."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._soap_aliases import _check_weight_decay
from fadam._tree import PyTree, tree_map
from fadam.aliases import _check_lr, _has_decay
from fadam.combinators._chain import chain
from fadam.transforms._decay import add_decayed_weights
from fadam.transforms._psgd_kron import scale_by_psgd_kron
from fadam.transforms._scaling import scale_by_learning_rate


def _matrices(params: PyTree) -> PyTree:
    """kron_torch decays the params of two dims or more only."""
    return tree_map(lambda p: p is not None and p.dim() >= 2, params)


def psgd_kron(
    learning_rate: ScalarOrSchedule = 0.001,
    b1: float | torch.Tensor = 0.9,
    weight_decay: ScalarOrSchedule = 0.0,
    preconditioner_update_probability: float | torch.Tensor | Callable[[torch.Tensor], Any] | None = None,
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    precond_lr: float | torch.Tensor = 0.1,
    precond_init_scale: float | torch.Tensor = 1.0,
    merge_dims: bool = True,
    partition_grads: bool = False,
    block_size: int = 1024,
    clip_update_rms: bool = True,
    max_skew_triangular: float | torch.Tensor = math.inf,
    *,
    key: int = 0,
    precond_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""PSGD Kron with the arguments of kron_torch's ``Kron`` (its ``lr`` named ``learning_rate``, psgd_jax's default).

    .. math::
        p_t = p_{t-1} - \eta_t\,(u_t + \lambda\, p_{t-1})

    with :math:`u_t` of ``scale_by_psgd_kron`` and the decay :math:`\lambda` of params of two dims or more only, as
    kron_torch (added after the RMS clipping). ``chain(scale_by_psgd_kron(...), add_decayed_weights(weight_decay,
    mask=<params of 2 dims or more>), scale_by_learning_rate(learning_rate))``. The default learning rate is
    psgd_jax's ``kron`` (0.001; kron_torch's is 0.0003).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: the momentum's decay.
        weight_decay: :math:`\lambda`, coupled decay of the matrices (a float, a 0-d tensor or a schedule).
        preconditioner_update_probability: a float in (0, 1], a schedule, or ``None`` (kron_torch's annealing).
        max_size_triangular: dims larger than this get a diagonal factor.
        min_ndim_triangular: leaves with fewer dims get diagonal factors only.
        memory_save_mode: ``None``, ``"smart_one_diag"``, ``"one_diag"`` or ``"all_diag"``.
        momentum_into_precond_update: fit the factors to the momentum (else to the gradient).
        precond_lr: the factors' step size.
        precond_init_scale: the initial scale of :math:`Q`.
        merge_dims: view leaves of three dims or more as matrices.
        partition_grads: give blocks of large triangular dims their own factors.
        block_size: the blocks' size along a split dim.
        clip_update_rms: clip the preconditioned update's RMS at 1.1.
        max_skew_triangular: dims above this many times the second largest get a diagonal factor.
        key: the seed of the random draws.
        precond_dtype: dtype of the state and its math (float32 or float64).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.psgd_kron(0.1)
        >>> params = {"w": torch.zeros(2, 3)}
        >>> grads = {"w": torch.full((2, 3), 4.0)}
        >>> updates, state = tx.update(grads, tx.init(params), params)
        >>> updates["w"].square().mean().sqrt()  # -lr times an update of RMS 1.1
        tensor(0.1100)

    References:
        Li, "Preconditioned Stochastic Gradient Descent", IEEE TNNLS 2018 (arXiv:1512.04202).
        Li, "Black Box Lie Group Preconditioners for SGD", 2022 (arXiv:2211.04422); psgd_torch.
        Evan Walters' kron_torch (``Kron``) and psgd_jax (``kron``).
    """
    _check_lr(learning_rate)
    _check_weight_decay(weight_decay)
    direction = scale_by_psgd_kron(
        b1,
        preconditioner_update_probability,
        max_size_triangular,
        min_ndim_triangular,
        memory_save_mode,
        momentum_into_precond_update,
        precond_lr,
        precond_init_scale,
        merge_dims,
        partition_grads,
        block_size,
        clip_update_rms,
        max_skew_triangular,
        key=key,
        precond_dtype=precond_dtype,
    )
    decay = [add_decayed_weights(weight_decay, mask=_matrices)] if _has_decay(weight_decay) else []
    return chain(direction, *decay, scale_by_learning_rate(learning_rate))
