"""Aliases with torch.optim's signatures and numbers: ``adadelta``, ``asgd``, ``rprop``, ``adafactor_torch``
(torch.optim.Adafactor; ``fadam.adafactor`` is optax's) and ``sparse_adam`` (torch.optim.SparseAdam)."""

from __future__ import annotations

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam.aliases import _check_lr, _head, _tail
from fadam.combinators._chain import chain
from fadam.transforms._adadelta import check_adadelta_args, scale_by_adadelta
from fadam.transforms._adafactor_torch import check_adafactor_torch_args, scale_by_adafactor_torch
from fadam.transforms._asgd import scale_by_asgd
from fadam.transforms._rprop import check_rprop_args, scale_by_rprop
from fadam.transforms._scaling import scale, scale_by_learning_rate
from fadam.transforms._sparse_adam import scale_by_sparse_adam


def _check_weight_decay(weight_decay: float | torch.Tensor) -> None:
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def adadelta(
    lr: ScalarOrSchedule = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float | torch.Tensor = 0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Adadelta exactly as ``torch.optim.Adadelta`` (see ``scale_by_adadelta``).

    .. math::
        p_t = p_{t-1} - \eta\, \Delta_t, \quad\text{with } g_t \leftarrow \pm g_t + \lambda p_{t-1}

    ``chain([scale(-1)], [add_decayed_weights], scale_by_adadelta, scale_by_learning_rate)``; torch.optim's
    ``foreach``, ``capturable`` and ``differentiable`` are ``fadam.Optimizer``'s flags.

    Args:
        lr: the learning rate :math:`\eta` scaling :math:`\Delta_t` (a float, a 0-d tensor or a schedule).
        rho: decay of the running averages of squared gradients and steps, in [0, 1].
        eps: added inside both square roots.
        weight_decay: L2 penalty :math:`\lambda` added to the gradient.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adadelta(lr=1.0, rho=0.0, eps=1.0)
        >>> params = [torch.zeros(1)]
        >>> tx.update([torch.tensor([3.0])], tx.init(params), params)[0]
        [tensor([-0.9487])]

    References:
        Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012.
    """
    _check_lr(lr)
    check_adadelta_args(rho, eps)
    _check_weight_decay(weight_decay)
    return chain(*_head(maximize, weight_decay), scale_by_adadelta(rho, eps), scale_by_learning_rate(lr))


def asgd(
    lr: ScalarOrSchedule = 1e-2,
    lambd: float = 1e-4,
    alpha: float = 0.75,
    t0: float = 1e6,
    weight_decay: float | torch.Tensor = 0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Averaged SGD exactly as ``torch.optim.ASGD`` (see ``scale_by_asgd``).

    .. math::
        p_t = p_{t-1}(1 - \lambda\eta_t) - \eta_t g_t,\quad \bar p_t = \bar p_{t-1} + \mu_t (p_t - \bar p_{t-1}),
        \quad\text{with } g_t \leftarrow \pm g_t + \omega p_{t-1}

    ``chain([scale(-1)], [add_decayed_weights], scale_by_asgd)``: the update is the whole step to :math:`p_t`. The
    averaged params :math:`\bar p_t` (torch's ``state["ax"]``, which it also never applies) are the last state's
    ``ax``: ``state[-1].ax``.

    Args:
        lr: the learning rate :math:`\eta` (a float, a 0-d tensor or a schedule).
        lambd: the decay term :math:`\lambda` of the learning rate and the params.
        alpha: the power of the learning-rate decay.
        t0: the step at which averaging starts.
        weight_decay: L2 penalty :math:`\omega` added to the gradient.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.asgd(lr=0.5, lambd=0.0, t0=0.0)
        >>> params = [torch.zeros(1)]
        >>> state = tx.init(params)
        >>> for g in (2.0, 4.0):
        ...     updates, state = tx.update([torch.tensor([g])], state, params)
        ...     params = fadam.apply_updates(params, updates)
        >>> params, state[-1].ax
        ([tensor([-3.])], [tensor([-3.])])

    References:
        Polyak & Juditsky, "Acceleration of Stochastic Approximation by Averaging", 1992.
    """
    _check_lr(lr)
    _check_weight_decay(weight_decay)
    return chain(*_head(maximize, weight_decay), scale_by_asgd(lr, lambd, alpha, t0))


def rprop(
    lr: ScalarOrSchedule = 1e-2,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50),
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Rprop exactly as ``torch.optim.Rprop`` (see ``scale_by_rprop``).

    .. math::
        p_t = p_{t-1} - \operatorname{sign}(g_t)\, \delta_t, \quad\text{with } g_t \leftarrow \pm g_t

    ``chain([scale(-1)], scale_by_rprop, scale(-1))``. The step sizes start from ``lr`` (a schedule's value at step
    0) and then follow the signs only, as torch's do.

    Args:
        lr: the initial step size.
        etas: the factors :math:`(\eta_-, \eta_+)` that shrink and grow the step sizes, :math:`0 < \eta_- < 1 < \eta_+`.
        step_sizes: the bounds of the step sizes.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.rprop(lr=0.1)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([2.0, -1.0])], tx.init(params), params)[0]
        [tensor([-0.1000,  0.1000])]

    References:
        Riedmiller & Braun, "A Direct Adaptive Method for Faster Backpropagation Learning: The RPROP Algorithm",
        1993.
    """
    _check_lr(lr)
    check_rprop_args(etas, step_sizes)
    return chain(*_head(maximize, 0.0), scale_by_rprop(lr, etas, step_sizes), scale(-1.0))


def adafactor_torch(
    lr: ScalarOrSchedule = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Adafactor exactly as ``torch.optim.Adafactor`` (see ``scale_by_adafactor_torch``); ``fadam.adafactor`` is
    optax's, with its arguments and its order of transforms.

    .. math::
        p_t = (1 - \eta\lambda)\, p_{t-1} - \frac{\alpha_t}{\max(1, \operatorname{rms}(U_t)/d)}\, U_t,
        \quad\text{with } g_t \leftarrow \pm g_t

    ``chain([scale(-1)], scale_by_adafactor_torch, [add_decoupled_weight_decay])``: the decay is decoupled, and the
    relative step :math:`\alpha_t` reads the params before it, as torch's. Complex params are refused, as torch's.

    Args:
        lr: the learning rate :math:`\eta`, which bounds the relative step :math:`\min(\eta, t^{-1/2})`.
        beta2_decay: the exponent :math:`c \le 0` of the second moment's averaging weight :math:`t^c`.
        eps: :math:`(\epsilon_1, \epsilon_2)`: the floor of the second moment (``None``: the dtype's machine epsilon)
            and of the params' RMS in the relative step.
        d: the clipping threshold of the update's RMS, at least 1.
        weight_decay: decoupled decay :math:`\lambda`.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adafactor_torch(lr=0.1, weight_decay=0.5)
        >>> params = [torch.full((2,), 2.0)]
        >>> updates, _ = tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)
        >>> fadam.apply_updates(params, updates)
        [tensor([1.7000, 2.1000])]

    References:
        Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018.
    """
    check_adafactor_torch_args(lr, beta2_decay, eps, d, weight_decay)
    return chain(
        *_head(maximize, 0.0),
        scale_by_adafactor_torch(lr, beta2_decay, eps, d),
        *_tail(lr, weight_decay, decoupled=True),
    )


def sparse_adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    maximize: bool = False,
) -> GradientTransformation:
    r"""SparseAdam exactly as ``torch.optim.SparseAdam``: Adam at the elements each sparse gradient stores (see
    ``scale_by_sparse_adam``), for the sparse COO gradients of ``nn.Embedding(sparse=True)``; dense gradients are
    refused, as torch's.

    .. math::
        p_t = p_{t-1} - \eta\,\frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,\frac{m_t}{\sqrt{v_t} + \epsilon}
        \quad\text{at the stored elements, with } g_t \leftarrow \pm g_t

    ``chain([scale(-1)], scale_by_sparse_adam, scale_by_learning_rate)``. torch.optim.SparseAdam's refusal of sparse
    and complex params is ``fadam.SparseAdam``'s, which takes its constructor's arguments.

    Args:
        lr: the learning rate :math:`\eta` (a float, a 0-d tensor or a schedule), above 0.
        betas: the decays :math:`(\beta_1, \beta_2)` of the moments, in [0, 1).
        eps: added to the root of the second moment, above 0.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.sparse_adam(lr=0.1)
        >>> params = [torch.zeros(3)]
        >>> grad = torch.sparse_coo_tensor([[0, 2, 0]], [1.0, -2.0, 1.0], (3,))  # index 0 twice: summed
        >>> updates, state = tx.update([grad], tx.init(params), params)
        >>> fadam.apply_updates(params, updates)
        [tensor([-0.1000,  0.0000,  0.1000])]

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.
    """
    check_sparse_adam_args(lr, betas, eps)
    return chain(*_head(maximize, 0.0), scale_by_sparse_adam(betas[0], betas[1], eps), scale_by_learning_rate(lr))


def check_sparse_adam_args(lr: ScalarOrSchedule, betas: tuple[float, float], eps: float) -> None:
    """torch.optim.SparseAdam's checks of its arguments, with its messages (a schedule is not checked)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not callable(lr) and not lr > 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps > 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
