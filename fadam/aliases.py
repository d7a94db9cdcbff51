"""Ready-made optimizers with torch.optim's signatures and semantics, each a ``chain`` of transforms (``sign_sgd``
and ``signum``, which torch.optim lacks, with optax's).

``fadam.step`` runs them with torch's fused kernels where the inputs allow it; ``tx.update`` always runs the chain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._tree import PyTree
from fadam.combinators._chain import chain
from fadam.transforms._adam import scale_by_adam
from fadam.transforms._adam_variants import scale_by_adamax, scale_by_nadam, scale_by_radam
from fadam.transforms._ademamix import scale_by_ademamix
from fadam.transforms._adopt import scale_by_adopt
from fadam.transforms._belief import scale_by_belief
from fadam.transforms._block_scaling import scale_by_param_block_rms, scale_by_trust_ratio
from fadam.transforms._clipping import clip_by_block_rms
from fadam.transforms._decay import add_decayed_weights, add_decoupled_weight_decay
from fadam.transforms._factorized import scale_by_factored_rms
from fadam.transforms._lion import scale_by_lion
from fadam.transforms._momentum import ema, trace
from fadam.transforms._rms import scale_by_rms, scale_by_rss, scale_by_stddev
from fadam.transforms._scaling import scale, scale_by_learning_rate
from fadam.transforms._sign import scale_by_sign
from fadam.transforms._validation import check_unit_interval, known_value
from fadam.transforms._yogi import scale_by_yogi


def _value(x: float | torch.Tensor, name: str) -> float:
    """A hyperparameter's value for the checks below; a tensor's inside torch.func transforms is unknown (taken 0)."""
    return known_value(x, 0.0, name)


def _check_lr(lr: ScalarOrSchedule) -> None:
    if callable(lr):
        return
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not _value(lr, "lr") >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")


def _check_lion_args(lr: ScalarOrSchedule, betas: tuple[float, float], weight_decay: float | torch.Tensor) -> None:
    _check_lr(lr)
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _check_adam_args(
    lr: ScalarOrSchedule,
    betas: tuple[float | torch.Tensor, float | torch.Tensor],
    eps: float,
    weight_decay: ScalarOrSchedule,
) -> None:
    _check_lr(lr)
    if not _value(eps, "eps") >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for index, beta in enumerate(betas):
        if not 0.0 <= _value(beta, f"betas[{index}]") < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    if not callable(weight_decay) and not _value(weight_decay, "weight_decay") >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _check_betas_types(betas: tuple[float | torch.Tensor, float | torch.Tensor]) -> None:
    """torch.optim.Adam's rule, checked after the values: its kernels take two numbers or two tensors."""
    pair = (betas[0], betas[1])
    if not (all(isinstance(beta, float) for beta in pair) or all(isinstance(beta, torch.Tensor) for beta in pair)):
        raise ValueError("betas must be either both floats or both Tensors (to learn one, give both as 0-d tensors)")


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
        betas: decays of the first and second moments: two floats or two 0-d tensors.
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
    _check_betas_types(betas)
    head = _head(maximize, weight_decay)
    adam_tx = scale_by_adam(betas[0], betas[1], eps, amsgrad=amsgrad, moment_requires_grad=moment_requires_grad)
    members = [*head, adam_tx, scale_by_learning_rate(lr)]
    tx = chain(*members)
    return tx


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
        betas: decays of the first and second moments: two floats or two 0-d tensors.
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
    _check_betas_types(betas)
    head = _head(maximize, weight_decay, decoupled=True)
    adam_tx = scale_by_adam(betas[0], betas[1], eps, amsgrad=amsgrad, moment_requires_grad=moment_requires_grad)
    members = [*head, adam_tx, scale_by_learning_rate(lr), *_tail(lr, weight_decay, decoupled=True)]
    tx = chain(*members)
    return tx


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

    Sparse COO gradients (``nn.Embedding(sparse=True)``'s) step as torch's do: without momentum the update is sparse
    and changes the stored elements only; the momentum buffer is dense, with the values of torch's sparse one; a
    weight decay refuses them, as torch's fails on them.

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
    if not _value(momentum, "momentum") >= 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if not callable(weight_decay) and not _value(weight_decay, "weight_decay") >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and not (known_value(momentum, 1.0, "momentum") > 0 and known_value(dampening, 0.0, "dampening") == 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    transforms = [scale(-1.0)] if maximize else []
    if _has_decay(weight_decay):
        transforms.append(add_decayed_weights(weight_decay))
    if isinstance(momentum, torch.Tensor) or momentum != 0:  # a tensor momentum may be learned away from 0
        transforms.append(trace(momentum, nesterov, dampening=dampening, moment_requires_grad=moment_requires_grad))
    tx = chain(*transforms, scale_by_learning_rate(lr))
    return tx


def _head(maximize: bool, weight_decay: float | torch.Tensor, decoupled: bool = False) -> list[GradientTransformation]:
    """torch.optim's gradient preamble: negate for ``maximize``, then add the coupled L2 penalty."""
    head = [scale(-1.0)] if maximize else []
    if not decoupled and _has_decay(weight_decay):
        head.append(add_decayed_weights(weight_decay))
    return head


def _tail(lr: ScalarOrSchedule, weight_decay: float | torch.Tensor, decoupled: bool) -> list[GradientTransformation]:
    """torch.optim's decoupled decay ``p *= 1 - lr * weight_decay``, placed after the learning rate."""
    return [add_decoupled_weight_decay(lr, weight_decay)] if decoupled and _has_decay(weight_decay) else []


def nadam(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    momentum_decay: float = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""NAdam exactly as ``torch.optim.NAdam`` (see ``scale_by_nadam``).

    .. math::
        p_t = p_{t-1} - \eta_t\, u_t^{\text{NAdam}}, \quad\text{with } g_t \leftarrow \pm g_t + \lambda p_{t-1}
        \text{ or, decoupled, } p_{t-1} \leftarrow (1 - \eta_t\lambda) p_{t-1}

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decays of the first and second moments.
        eps: added to the denominator.
        weight_decay: the decay :math:`\lambda`.
        momentum_decay: decay :math:`\psi` of the momentum schedule.
        decoupled_weight_decay: decay the params as AdamW does (NAdamW) instead of adding an L2 penalty.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.nadam(lr=0.1)
        >>> params = [torch.zeros(1)]
        >>> tx.update([torch.tensor([2.0])], tx.init(params), params)[0][0].round(decimals=4)
        tensor([-0.1056])

    References:
        Dozat, "Incorporating Nesterov Momentum into Adam", 2016.
    """
    _check_adam_args(lr, betas, eps, weight_decay)
    if not momentum_decay >= 0.0:
        raise ValueError(f"Invalid momentum_decay value: {momentum_decay}")
    return chain(
        *_head(maximize, weight_decay, decoupled_weight_decay),
        scale_by_nadam(betas[0], betas[1], eps, momentum_decay),
        scale_by_learning_rate(lr),
        *_tail(lr, weight_decay, decoupled_weight_decay),
    )


def nadamw(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    momentum_decay: float = 4e-3,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""NAdam with decoupled weight decay: ``torch.optim.NAdam(..., decoupled_weight_decay=True)``.

    .. math::
        p_t = (1 - \eta_t\lambda)\, p_{t-1} - \eta_t\, u_t^{\text{NAdam}}

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decays of the first and second moments.
        eps: added to the denominator.
        weight_decay: decoupled decay :math:`\lambda` (default 1e-2, as AdamW).
        momentum_decay: decay of the momentum schedule.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.nadamw(lr=0.1, weight_decay=0.5)
        >>> params = [torch.ones(1)]
        >>> updates, _ = tx.update([torch.zeros(1)], tx.init(params), params)
        >>> fadam.apply_updates(params, updates)[0]
        tensor([0.9500])

    References:
        Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019.
    """
    return nadam(lr, betas, eps, weight_decay, momentum_decay, True, maximize=maximize)


def radam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""RAdam exactly as ``torch.optim.RAdam`` (see ``scale_by_radam``).

    .. math::
        p_t = p_{t-1} - \eta_t\, u_t^{\text{RAdam}}, \quad\text{with } g_t \leftarrow \pm g_t + \lambda p_{t-1}
        \text{ or, decoupled, } p_{t-1} \leftarrow (1 - \eta_t\lambda) p_{t-1}

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decays of the first and second moments.
        eps: added to the denominator.
        weight_decay: the decay :math:`\lambda`.
        decoupled_weight_decay: decay the params as AdamW does instead of adding an L2 penalty.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.radam(lr=0.1)
        >>> params = [torch.zeros(1)]
        >>> tx.update([torch.tensor([2.0])], tx.init(params), params)[0]
        [tensor([-0.2000])]

    References:
        Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", 2020.
    """
    _check_adam_args(lr, betas, eps, weight_decay)
    return chain(
        *_head(maximize, weight_decay, decoupled_weight_decay),
        scale_by_radam(betas[0], betas[1], eps),
        scale_by_learning_rate(lr),
        *_tail(lr, weight_decay, decoupled_weight_decay),
    )


def rmsprop(
    lr: ScalarOrSchedule = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""RMSprop exactly as ``torch.optim.RMSprop``: epsilon outside the square root, optional centering and momentum.

    .. math::
        v_t = \alpha v_{t-1} + (1-\alpha) g_t^2,\quad d_t = \sqrt{v_t - [\bar g_t^2]} + \epsilon,\quad
        b_t = \mu b_{t-1} + g_t / d_t,\quad p_t = p_{t-1} - \eta_t b_t

    ``chain([scale(-1)], [add_decayed_weights], scale_by_rms | scale_by_stddev (eps_in_sqrt=False), [trace],
    scale_by_learning_rate)``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        alpha: decay of the squared-gradient average.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        momentum: momentum :math:`\mu` applied to the scaled gradient (0: none, no buffer kept).
        centered: divide by the estimated standard deviation (subtracting the squared mean gradient :math:`\bar g_t`).
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.rmsprop(lr=0.01, alpha=0.75, eps=0.0)
        >>> params = [torch.zeros(1)]
        >>> tx.update([torch.tensor([3.0])], tx.init(params), params)[0]
        [tensor([-0.0200])]

    References:
        Hinton, "Lecture 6.5: RMSprop", 2012; Graves, "Generating Sequences With Recurrent Neural Networks", 2013.
    """
    _check_lr(lr)
    for name, value in (("epsilon", eps), ("momentum", momentum), ("weight_decay", weight_decay), ("alpha", alpha)):
        if not value >= 0.0:
            raise ValueError(f"Invalid {name} value: {value}")
    scaling = (scale_by_stddev if centered else scale_by_rms)(alpha, eps, eps_in_sqrt=False)
    return chain(
        *_head(maximize, weight_decay),
        scaling,
        *([trace(momentum)] if momentum > 0 else []),
        scale_by_learning_rate(lr),
    )


def _decayed_lr(lr: ScalarOrSchedule, lr_decay: float) -> ScalarOrSchedule:
    """torch.optim.Adagrad's ``lr / (1 + (step - 1) * lr_decay)``, as a schedule of the 0-based count."""
    if lr_decay == 0:
        return lr

    def schedule(count: torch.Tensor) -> torch.Tensor:
        base = lr(count) if callable(lr) else lr
        # a quotient of two tensors: ``float / tensor`` multiplies by the reciprocal, an ulp away from torch's
        return torch.as_tensor(base, dtype=torch.float64, device=count.device) / (
            1 + count.to(torch.float64) * lr_decay
        )

    return schedule


def adagrad(
    lr: ScalarOrSchedule = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Adagrad exactly as ``torch.optim.Adagrad``; ``fadam.step`` runs torch's fused kernel on dense gradients. Sparse
    COO gradients take torch's sparse path: coalesced, they change the sums and the params at their stored elements
    only; a weight decay refuses them, as torch's does.

    .. math::
        s_t = s_{t-1} + g_t^2,\qquad p_t = p_{t-1} - \frac{\eta}{1 + (t-1)\delta}\,\frac{g_t}{\sqrt{s_t} + \epsilon}

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        lr_decay: the decay :math:`\delta` of the learning rate.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: initial value of :math:`s`.
        eps: added to the denominator.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adagrad(lr=0.5, eps=0.0)
        >>> params = [torch.zeros(1)]
        >>> tx.update([torch.tensor([-3.0])], tx.init(params), params)[0]
        [tensor([0.5000])]

    References:
        Duchi et al., "Adaptive Subgradient Methods for Online Learning and Stochastic Optimization", 2011.
    """
    _check_lr(lr)
    if not lr_decay >= 0.0:
        raise ValueError(f"Invalid lr_decay value: {lr_decay}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not initial_accumulator_value >= 0.0:
        raise ValueError(f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    head = _head(maximize, weight_decay)
    tx = chain(
        *head,
        scale_by_rss(initial_accumulator_value, eps, eps_in_sqrt=False),
        scale_by_learning_rate(_decayed_lr(lr, lr_decay)),
    )
    return tx


def adamax(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Adamax exactly as ``torch.optim.Adamax`` (see ``scale_by_adamax``).

    .. math::
        p_t = p_{t-1} - \frac{\eta_t}{1-\beta_1^t} \frac{m_t}{u^\infty_t}

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decays of the first moment and of the infinity norm.
        eps: added to :math:`|g_t|`.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adamax(lr=0.1)
        >>> params = [torch.zeros(1)]
        >>> tx.update([torch.tensor([-4.0])], tx.init(params), params)[0]
        [tensor([0.1000])]

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015, section 7.1.
    """
    _check_adam_args(lr, betas, eps, weight_decay)
    return chain(*_head(maximize, weight_decay), scale_by_adamax(betas[0], betas[1], eps), scale_by_learning_rate(lr))


def lion(
    lr: ScalarOrSchedule = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float | torch.Tensor = 1e-3,
    *,
    maximize: bool = False,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Lion (see ``scale_by_lion``), with decoupled weight decay scaled by the learning rate as in the paper.

    .. math::
        p_t = p_{t-1} - \eta_t\left(\operatorname{sign}(\beta_1 m_{t-1} + (1-\beta_1) g_t) + \lambda p_{t-1}\right)

    ``chain([scale(-1)], scale_by_lion, add_decayed_weights, scale_by_learning_rate)`` (optax's ``lion``, whose
    defaults these are).

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule (typically 3-10x smaller than AdamW's).
        betas: :math:`(\beta_1, \beta_2)`: interpolation weight in the update, decay of the momentum.
        weight_decay: decoupled decay :math:`\lambda`.
        maximize: maximize the objective.
        mu_dtype: dtype of the momentum (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.lion(lr=0.1, weight_decay=0.0)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([0.01, -5.0])], tx.init(params), params)[0]
        [tensor([-0.1000,  0.1000])]

    References:
        Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.
    """
    _check_lion_args(lr, betas, weight_decay)
    decay = [add_decayed_weights(weight_decay)] if _has_decay(weight_decay) else []
    return chain(*_head(maximize, 0.0), scale_by_lion(betas[0], betas[1], mu_dtype), *decay, scale_by_learning_rate(lr))


def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    r"""signSGD: descends along the signs of the gradient's components (optax's ``sign_sgd``).

    .. math::
        p_t = p_{t-1} - \eta_t \operatorname{sign}(g_t)

    ``chain(scale_by_sign, scale_by_learning_rate)``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.sign_sgd(0.1)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([0.01, -5.0])], tx.init(params), params)[0]
        [tensor([-0.1000,  0.1000])]

    References:
        Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", 2018.
    """
    _check_lr(learning_rate)
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


def signum(
    learning_rate: ScalarOrSchedule, beta: float | torch.Tensor = 0.9, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    r"""Signum: descends along the signs of a moving average of the gradients (optax's ``signum``).

    .. math::
        m_t = \beta m_{t-1} + (1-\beta) g_t,\qquad p_t = p_{t-1} - \eta_t \operatorname{sign}(m_t)

    ``chain(ema(beta, debias=False), scale_by_sign, scale_by_learning_rate)``, optax's order and names: the average
    is not debiased, which would not change its sign.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        beta: the decay :math:`\beta` of the average (the paper's momentum).
        accumulator_dtype: dtype of the average (default: the param's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.signum(0.1)
        >>> params = [torch.zeros(2)]
        >>> u, state = tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)
        >>> tx.update([torch.tensor([-2.0, -2.0])], state, params)[0]  # m = (-0.1, -0.28)
        [tensor([0.1000, 0.1000])]

    References:
        Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", 2018.
        Zhao et al., "Deconstructing What Makes a Good Optimizer for Language Models", 2024.
    """
    _check_lr(learning_rate)
    check_unit_interval("beta", beta)
    return chain(
        ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
        scale_by_sign(),
        scale_by_learning_rate(learning_rate),
    )


def lamb(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    eps_root: float = 0.0,
    maximize: bool = False,
) -> GradientTransformation:
    r"""LAMB: Adam's direction plus decoupled weight decay, rescaled per leaf by the trust ratio.

    .. math::
        r_t = \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon} + \lambda p_{t-1},\qquad
        p_t = p_{t-1} - \eta_t \frac{\|p_{t-1}\|}{\|r_t\|} r_t

    ``chain([scale(-1)], scale_by_adam, add_decayed_weights, scale_by_trust_ratio, scale_by_learning_rate)``, optax's
    ``lamb`` (the ratio is 1 where either norm is zero).

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decays of the first and second moments.
        eps: added to the denominator (1e-6 as in the paper and optax).
        weight_decay: decoupled decay :math:`\lambda`, inside the trust ratio.
        eps_root: added inside the square root (meta-gradients).
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.lamb(lr=0.1)
        >>> params = [torch.tensor([3.0, 4.0])]
        >>> tx.update([torch.tensor([1.0, 0.0])], tx.init(params), params)[0][0].round(decimals=4)
        tensor([-0.5000, -0.0000])

    References:
        You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", 2020.
    """
    _check_adam_args(lr, betas, eps, weight_decay)
    decay = [add_decayed_weights(weight_decay)] if _has_decay(weight_decay) else []
    return chain(
        *_head(maximize, 0.0),
        scale_by_adam(betas[0], betas[1], eps, eps_root),
        *decay,
        scale_by_trust_ratio(),
        scale_by_learning_rate(lr),
    )


def adafactor(
    lr: ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    dtype_momentum: torch.dtype | None = None,
    weight_decay_rate: float | None = None,
    eps: float = 1e-30,
    factored: bool = True,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Adafactor with optax's arguments and order of transforms.

    .. math::
        u_t = \text{clip}_d\!\left(\frac{g_t}{\sqrt{\hat V_t}}\right),\qquad
        p_t = p_{t-1} - \left(\eta_t \max(\operatorname{rms}(p_{t-1}), 10^{-3})\, u_t + \lambda p_{t-1}\right)

    where :math:`\hat V_t` is the factored second moment (``scale_by_factored_rms``) and :math:`\text{clip}_d` rescales
    a leaf whose RMS exceeds ``clipping_threshold``. ``chain([scale(-1)], scale_by_factored_rms, [clip_by_block_rms],
    [scale(lr)], [scale_by_param_block_rms], [ema(momentum)], [add_decayed_weights], scale(-1))``.

    Args:
        lr: learning rate (float, 0-d tensor or schedule); ``None`` uses the relative step alone (optax's default).
        min_dim_size_to_factor: factor a matrix's second moment only if its second-largest dim has this size.
        decay_rate: exponent :math:`c` of the decay :math:`1 - t^{-c}` of the second moment.
        decay_offset: step offset of that decay (fine-tuning).
        multiply_by_parameter_scale: scale by the param's RMS (the paper's relative step size).
        clipping_threshold: the update clipping :math:`d` (``None``: no clipping).
        momentum: decay of an optional momentum on the updates (not debiased).
        dtype_momentum: dtype of that momentum (default: the param's; optax keeps it in float32).
        weight_decay_rate: :math:`\lambda`, added after the learning rate as optax does (``None``: no decay).
        eps: :math:`\epsilon_1`, added to the squared gradient.
        factored: factor the second moment of matrices.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adafactor(lr=0.1)
        >>> params = [torch.full((2,), 2.0)]
        >>> tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)[0]
        [tensor([-0.2000,  0.2000])]

    References:
        Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018.
    """
    if lr is not None:
        _check_lr(lr)
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay_rate is not None and not weight_decay_rate >= 0.0:
        raise ValueError(f"Invalid weight_decay_rate value: {weight_decay_rate}")
    if clipping_threshold is not None and not clipping_threshold > 0.0:
        raise ValueError(f"Invalid clipping_threshold value: {clipping_threshold}")
    transforms = _head(maximize, 0.0)
    transforms.append(scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps))
    if clipping_threshold is not None:
        transforms.append(clip_by_block_rms(clipping_threshold))
    if lr is not None:
        transforms.append(scale_by_learning_rate(lr, flip_sign=False))
    if multiply_by_parameter_scale:
        transforms.append(scale_by_param_block_rms())
    if momentum is not None:
        transforms.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        transforms.append(add_decayed_weights(weight_decay_rate))
    transforms.append(scale(-1.0))
    return chain(*transforms)


def adopt(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.9999,
    eps: float | torch.Tensor = 1e-6,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[torch.Tensor], float | torch.Tensor] | None = None,
) -> GradientTransformation:
    r"""ADOPT: Adam normalizing each gradient by the previous second moment, before the momentum (optax's).

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1)\operatorname{clip}_{c_t}\!\left(\frac{g_t}{\max(\sqrt{v_{t-1}},
        \epsilon)}\right),\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad p_t = p_{t-1} - \eta_t m_t

    ``chain(scale_by_adopt, scale_by_learning_rate)``; the first step initialises :math:`v` and leaves the params.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the momentum.
        b2: decay of the second moment (the paper's 0.9999 default works across values, its point).
        eps: lower bound of the square root of the second moment.
        mu_dtype: dtype of the momentum (default: the param's).
        nesterov: Nesterov momentum.
        use_clipping: clip the normalized gradient to :math:`\pm c_t` (recommended from scratch).
        clip_value_fn: :math:`c_t` from the steps taken so far (a 0-d float64 tensor); default
            :math:`t^{1/4}`.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adopt(0.1)
        >>> params = [torch.zeros(2)]
        >>> u, state = tx.update([torch.tensor([2.0, -1.0])], tx.init(params), params)
        >>> tx.update([torch.tensor([1.0, -1.0])], state, params)[0]
        [tensor([-0.0050,  0.0100])]

    References:
        Taniguchi et al., "ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal Rate", NeurIPS 2024.
        optax's ``optax.contrib.adopt`` (0.2.8).
    """
    _check_lr(learning_rate)
    clipping = {} if clip_value_fn is None else {"clip_value_fn": clip_value_fn}
    return chain(
        scale_by_adopt(b1, b2, eps, mu_dtype, nesterov=nesterov, use_clipping=use_clipping, **clipping),
        scale_by_learning_rate(learning_rate),
    )


def ademamix(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float | torch.Tensor = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> GradientTransformation:
    r"""AdEMAMix: AdamW whose momentum is mixed with a slow one (optax's ``contrib.ademamix``).

    .. math::
        p_t = p_{t-1} - \eta_t\left(\frac{m^{(1)}_t/(1-\beta_1^t) + \alpha\, m^{(2)}_t}
        {\sqrt{v_t/(1-\beta_2^t) + \bar\epsilon} + \epsilon} + \lambda p_{t-1}\right)

    ``chain(scale_by_ademamix, add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``, optax's order: the
    decay is scaled by the learning rate.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the fast momentum.
        b2: decay of the second moment.
        b3: decay of the slow momentum (a number or a schedule; the paper warms it up on long runs).
        alpha: weight of the slow momentum (a number or a schedule).
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (meta-gradients).
        mu_dtype: dtype of the moments (default: the param's).
        weight_decay: the decay :math:`\lambda`.
        mask: the params to decay: a bool tree (or prefix) or a callable of the params (``None``: all).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.ademamix(0.1, b3=0.5, alpha=2.0)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([1.0, -4.0])], tx.init(params), params)[0]
        [tensor([-0.2000,  0.2000])]

    References:
        Pagliardini et al., "The AdEMAMix Optimizer: Better, Faster, Older", 2024.
        optax's ``optax.contrib.ademamix`` (0.2.8).
    """
    _check_lr(learning_rate)
    decay = [add_decayed_weights(weight_decay, mask)] if _has_decay(weight_decay) else []
    return chain(
        scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype), *decay, scale_by_learning_rate(learning_rate)
    )


def yogi(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-3,
) -> GradientTransformation:
    r"""Yogi: Adam whose second moment moves additively, so its effective step cannot grow fast (optax's ``yogi``).

    .. math::
        v_t = v_{t-1} - (1-\beta_2)\operatorname{sign}(v_{t-1} - g_t^2)\, g_t^2,\qquad
        p_t = p_{t-1} - \eta_t \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}

    ``chain(scale_by_yogi, scale_by_learning_rate)``; both moments start at 1e-6 as in optax.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: rate of the second moment's update.
        eps: added to the denominator (1e-3, the paper's and optax's).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.yogi(0.1)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([3.0, -0.5])], tx.init(params), params)[0]
        [tensor([-0.1000,  0.0996])]

    References:
        Zaheer et al., "Adaptive Methods for Nonconvex Optimization", NeurIPS 2018.
        optax's ``optax.yogi`` (0.2.8).
    """
    _check_lr(learning_rate)
    return chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))


def adabelief(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-16,
    eps_root: float | torch.Tensor = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    r"""AdaBelief: Adam whose second moment is the gradient's deviation from its average (optax's ``adabelief``).

    .. math::
        s_t = \beta_2 s_{t-1} + (1-\beta_2)(g_t - m_t)^2 + \epsilon_{root},\qquad
        p_t = p_{t-1} - \eta_t \frac{m_t/(1-\beta_1^t)}{\sqrt{s_t/(1-\beta_2^t)} + \epsilon}

    ``chain(scale_by_belief, scale_by_learning_rate)``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: decay of the second moment of the prediction error.
        eps: added to the denominator outside the square root.
        eps_root: added to the second moment at every step.
        nesterov: Nesterov momentum in the numerator.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adabelief(0.1)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([1.0, -2.0])], tx.init(params), params)[0][0].round(decimals=4)
        tensor([-0.1111,  0.1111])

    References:
        Zhuang et al., "AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed Gradients", NeurIPS 2020.
        optax's ``optax.adabelief`` (0.2.8).
    """
    _check_lr(learning_rate)
    return chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), scale_by_learning_rate(learning_rate))
