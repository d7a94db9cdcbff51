"""Ready-made optimizers with torch.optim's signatures and semantics, each a ``chain`` of transforms.

``fadam.step`` runs them with torch's fused kernels where the inputs allow it; ``tx.update`` always runs the chain.
"""

from __future__ import annotations

import torch

from fadam._base import FusibleUpdate, GradientTransformation, ScalarOrSchedule
from fadam._fused import fused_adam_step, fused_sgd_step
from fadam.combinators._chain import chain
from fadam.transforms._adam import scale_by_adam
from fadam.transforms._decay import add_decayed_weights, add_decoupled_weight_decay
from fadam.transforms._momentum import trace
from fadam.transforms._scaling import scale, scale_by_learning_rate
from fadam.transforms._validation import known_value


def _value(x: float | torch.Tensor) -> float:
    """A hyperparameter's value for the checks below; a tensor's inside torch.func transforms is unknown (taken 0)."""
    return known_value(x, 0.0)


def _check_lr(lr: ScalarOrSchedule) -> None:
    if callable(lr):
        return
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not _value(lr) >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")


def _check_adam_args(
    lr: ScalarOrSchedule,
    betas: tuple[float | torch.Tensor, float | torch.Tensor],
    eps: float,
    weight_decay: ScalarOrSchedule,
) -> None:
    _check_lr(lr)
    if not _value(eps) >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for index, beta in enumerate(betas):
        if not 0.0 <= _value(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    if not callable(weight_decay) and not _value(weight_decay) >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _has_decay(weight_decay: ScalarOrSchedule) -> bool:
    return isinstance(weight_decay, torch.Tensor) or callable(weight_decay) or weight_decay != 0


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    moment_requires_grad: bool = False,
) -> GradientTransformation:
    r"""Adam exactly as ``torch.optim.Adam``, including its coupled L2 weight decay.

    .. math::
        g_t \leftarrow \pm g_t + \lambda p_{t-1},\quad
        p_t = p_{t-1} - \eta_t \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    ``chain([scale(-1)], [add_decayed_weights(weight_decay)], scale_by_adam(...), scale_by_learning_rate(lr))``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decays of the first and second moments.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient (torch.optim.Adam's ``weight_decay``); may be a schedule.
        amsgrad: torch.optim's AMSGrad (running maximum of the raw second moment).
        maximize: maximize the objective (the gradient is negated before weight decay, as in torch.optim).
        moment_requires_grad: create the moments requiring grad (meta-gradients into the initial state).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -0.5])}, state, params)
        >>> fadam.apply_updates(params, updates)["w"]
        tensor([ 0.9000, -0.9000])

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015.
    """
    _check_adam_args(lr, betas, eps, weight_decay)
    head = [scale(-1.0)] if maximize else []
    if _has_decay(weight_decay):
        head.append(add_decayed_weights(weight_decay))
    adam_tx = scale_by_adam(betas[0], betas[1], eps, amsgrad=amsgrad, moment_requires_grad=moment_requires_grad)
    tx = chain(*head, adam_tx, scale_by_learning_rate(lr))
    fused = fused_adam_step(
        adam_index=len(head),
        lr=lr,
        b1=betas[0],
        b2=betas[1],
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        decoupled=False,
    )
    return GradientTransformation(tx.init, FusibleUpdate(tx.update, fused))


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    moment_requires_grad: bool = False,
) -> GradientTransformation:
    r"""AdamW exactly as ``torch.optim.AdamW``: weight decay decoupled from the gradient and scaled by the lr.

    .. math::
        p_t = p_{t-1} - \eta_t \left(\lambda p_{t-1}
              + \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}\right)

    ``chain([scale(-1)], scale_by_adam(...), scale_by_learning_rate(lr), add_decoupled_weight_decay(lr, weight_decay))``
    (optax's ``adamw`` puts ``add_decayed_weights`` before the learning rate; the result is the same up to rounding,
    and this order rounds like torch.optim.AdamW).

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decays of the first and second moments.
        eps: added to the denominator.
        weight_decay: decoupled weight decay :math:`\lambda` (default 1e-2, as torch.optim.AdamW); may be a schedule.
        amsgrad: torch.optim's AMSGrad.
        maximize: maximize the objective.
        moment_requires_grad: create the moments requiring grad (meta-gradients into the initial state).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adamw(lr=0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([2.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([1.0])}, tx.init(params), params)
        >>> fadam.apply_updates(params, updates)["w"]
        tensor([1.8000])

    References:
        Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019.
    """
    _check_adam_args(lr, betas, eps, weight_decay)
    head = [scale(-1.0)] if maximize else []
    tail = [add_decoupled_weight_decay(lr, weight_decay)] if _has_decay(weight_decay) else []
    adam_tx = scale_by_adam(betas[0], betas[1], eps, amsgrad=amsgrad, moment_requires_grad=moment_requires_grad)
    tx = chain(*head, adam_tx, scale_by_learning_rate(lr), *tail)
    fused = fused_adam_step(
        adam_index=len(head),
        lr=lr,
        b1=betas[0],
        b2=betas[1],
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        decoupled=True,
    )
    return GradientTransformation(tx.init, FusibleUpdate(tx.update, fused))


def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float | torch.Tensor = 0.0,
    dampening: float | torch.Tensor = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    moment_requires_grad: bool = False,
) -> GradientTransformation:
    r"""Stochastic gradient descent exactly as ``torch.optim.SGD``.

    .. math::
        g_t \leftarrow \pm g_t + \lambda p_{t-1},\quad b_1 = g_1,\ b_t = \mu b_{t-1} + (1-d) g_t,\quad
        p_t = p_{t-1} - \eta_t \cdot (\text{nesterov} ? g_t + \mu b_t : b_t)

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        momentum: momentum factor :math:`\mu` (0 disables the buffer; no state is kept).
        dampening: dampening :math:`d` of the momentum.
        weight_decay: L2 penalty added to the gradient; may be a schedule.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening = 0).
        maximize: maximize the objective.
        moment_requires_grad: create the momentum buffer requiring grad (meta-gradients into the initial state).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.sgd(lr=0.1, momentum=0.9)
        >>> params = [torch.zeros(1)]
        >>> updates, state = tx.update([torch.ones(1)], tx.init(params), params)
        >>> updates
        [tensor([-0.1000])]
    """
    _check_lr(lr)
    if not _value(momentum) >= 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if not callable(weight_decay) and not _value(weight_decay) >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and not (known_value(momentum, 1.0) > 0 and known_value(dampening, 0.0) == 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    transforms = [scale(-1.0)] if maximize else []
    if _has_decay(weight_decay):
        transforms.append(add_decayed_weights(weight_decay))
    trace_index = None
    if isinstance(momentum, torch.Tensor) or momentum != 0:  # a tensor momentum may be learned away from 0
        trace_index = len(transforms)
        transforms.append(trace(momentum, nesterov, dampening=dampening, moment_requires_grad=moment_requires_grad))
    tx = chain(*transforms, scale_by_learning_rate(lr))
    fused = fused_sgd_step(
        trace_index=trace_index,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
    )
    return GradientTransformation(tx.init, FusibleUpdate(tx.update, fused))
