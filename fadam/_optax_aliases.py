"""Ready-made optimizers with optax's names, arguments and semantics, each a ``chain`` of transforms: NovoGrad,
LARS, Adan, SM3, Fromage, noisy SGD, Polyak SGD, optimistic gradient descent and optimistic Adam (both of optax's
interfaces), AMSGrad and AdamaxW."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fadam._base import EmptyState, GradientTransformation, ScalarOrSchedule
from fadam._program import Elementwise, elementwise
from fadam._tree import PyTree
from fadam.combinators._chain import chain
from fadam.combinators._masking import masked
from fadam.transforms._adam import scale_by_adam
from fadam.transforms._adam_variants import scale_by_adamax
from fadam.transforms._adan import scale_by_adan
from fadam.transforms._amsgrad import scale_by_amsgrad
from fadam.transforms._block_scaling import scale_by_trust_ratio
from fadam.transforms._decay import add_decayed_weights
from fadam.transforms._momentum import trace
from fadam.transforms._noise import add_noise
from fadam.transforms._novograd import scale_by_novograd
from fadam.transforms._optimistic import scale_by_optimistic_gradient
from fadam.transforms._polyak import scale_by_polyak
from fadam.transforms._scaling import ScaleByScheduleState, scale, scale_by_learning_rate
from fadam.transforms._sm3 import scale_by_sm3

Mask = PyTree | Callable[[PyTree], PyTree]


def _decay(weight_decay: ScalarOrSchedule, mask: Mask | None) -> list[GradientTransformation]:
    """optax's ``add_decayed_weights(weight_decay, mask)``; left out where it adds nothing (a decay of 0)."""
    if not callable(weight_decay) and not isinstance(weight_decay, torch.Tensor) and weight_decay == 0.0:
        return []
    return [add_decayed_weights(weight_decay, None if mask is True else mask)]


def novograd(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.25,
    eps: float | torch.Tensor = 1e-6,
    eps_root: float | torch.Tensor = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
) -> GradientTransformation:
    r"""NovoGrad: per-layer second moments of the gradient's norm, momentum of the normalized gradient plus weight
    decay.

    .. math::
        v_t = \beta_2 v_{t-1} + (1-\beta_2)\|g_t\|^2,\quad
        m_t = \beta_1 m_{t-1} + \frac{g_t}{\sqrt{v_t + \epsilon_{root}} + \epsilon} + \lambda p_t,\quad
        p_{t+1} = p_t - \eta_t m_t

    ``chain(scale_by_novograd(...), scale_by_learning_rate(learning_rate))``, optax's ``novograd``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the momentum.
        b2: decay of the per-layer second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (meta-gradients).
        weight_decay: the factor :math:`\lambda` of the params, inside the momentum.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.novograd(0.1, eps=0.0)
        >>> params = [torch.tensor([1.0, 2.0])]
        >>> tx.update([torch.tensor([3.0, 4.0])], tx.init(params), params)[0]
        [tensor([-0.0600, -0.0800])]

    References:
        Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of Deep
        Networks", 2019. optax's ``optax.novograd`` (0.2.8).
    """
    return chain(
        scale_by_novograd(b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay),
        scale_by_learning_rate(learning_rate),
    )


def lars(
    learning_rate: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Mask = True,
    trust_coefficient: float | torch.Tensor = 0.001,
    eps: float | torch.Tensor = 0.0,
    trust_ratio_mask: Mask = True,
    momentum: float | torch.Tensor = 0.9,
    nesterov: bool = False,
) -> GradientTransformation:
    r"""LARS: SGD with momentum whose step is rescaled per layer by the ratio of the param's norm to the update's.

    .. math::
        r_t = g_t + \lambda p_t,\quad
        \tilde r_t = c\,\frac{\|p_t\|}{\|r_t\| + \epsilon}\, r_t,\quad
        m_t = \mu m_{t-1} - \eta_t \tilde r_t,\quad p_{t+1} = p_t + m_t

    (the ratio is 1 where either norm is zero; with ``nesterov`` the update is :math:`-\eta_t\tilde r_t + \mu m_t`).
    ``chain(add_decayed_weights(weight_decay, weight_decay_mask), masked(scale_by_trust_ratio(trust_coefficient,
    eps), trust_ratio_mask), scale_by_learning_rate(learning_rate), trace(momentum, nesterov))``, optax's ``lars``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        weight_decay: the factor :math:`\lambda` (a float, a 0-d tensor or a schedule).
        weight_decay_mask: a bool tree (or prefix, or callable ``params -> tree``) of the leaves to decay.
        trust_coefficient: the factor :math:`c` of the trust ratio.
        eps: added to the update's norm in the trust ratio.
        trust_ratio_mask: a bool tree (or prefix, or callable) of the leaves whose update is rescaled (commonly all
            but biases and norm scales).
        momentum: the momentum :math:`\mu`.
        nesterov: Nesterov momentum.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.lars(1.0, trust_coefficient=0.1)
        >>> params = [torch.tensor([0.0, 10.0])]
        >>> tx.update([torch.tensor([3.0, 4.0])], tx.init(params), params)[0]  # 0.1 * 10 / 5 * g
        [tensor([-0.6000, -0.8000])]

    References:
        You et al., "Large Batch Training of Convolutional Networks", 2017. optax's ``optax.lars`` (0.2.8).
    """
    ratio = scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)
    return chain(
        *_decay(weight_decay, weight_decay_mask),
        ratio if trust_ratio_mask is True else masked(ratio, trust_ratio_mask),
        scale_by_learning_rate(learning_rate),
        trace(decay=momentum, nesterov=nesterov),
    )


def adan(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.98,
    b2: float | torch.Tensor = 0.92,
    b3: float | torch.Tensor = 0.99,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Mask | None = None,
) -> GradientTransformation:
    r"""Adan: Adam-style moments of the gradient, of its differences and of their Nesterov combination squared.

    .. math::
        u_t = \frac{\hat m_t + (1-\beta_2)\hat v_t}{\sqrt{\hat n_t + \epsilon_{root}} + \epsilon} + \lambda p_t,
        \quad p_{t+1} = p_t - \eta_t u_t

    with the moments of ``scale_by_adan``. ``chain(scale_by_adan(...), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, optax's ``adan`` (its weight decay is added to the update, not the
    paper's proximal division by :math:`1 + \lambda\eta`).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the gradients' moment.
        b2: decay of the differences' moment.
        b3: decay of the squared combination's moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root.
        weight_decay: the factor :math:`\lambda` (a float, a 0-d tensor or a schedule).
        mask: a bool tree (or prefix, or callable ``params -> tree``) of the leaves to decay.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adan(0.1, eps=0.0, eps_root=0.0)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([2.0, -0.5])], tx.init(params), params)[0]
        [tensor([-0.1000,  0.1000])]

    References:
        Xie et al., "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models", 2022. optax's
        ``optax.adan`` (0.2.8).
    """
    return chain(
        scale_by_adan(b1=b1, b2=b2, b3=b3, eps=eps, eps_root=eps_root),
        *_decay(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def sm3(learning_rate: float | torch.Tensor, momentum: float | torch.Tensor = 0.9) -> GradientTransformation:
    r"""SM3: Adagrad with its accumulator kept as one vector per axis of each param, with momentum.

    .. math::
        p_{t+1} = p_t - \eta\, m_t

    with :math:`m_t` of ``scale_by_sm3(b1=momentum)``. ``chain(scale_by_sm3(momentum), scale(-learning_rate))``,
    optax's ``sm3`` (a fixed learning rate; real params only).

    Args:
        learning_rate: the step size :math:`\eta` (a float or a 0-d tensor).
        momentum: decay of the momentum.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.sm3(0.1, momentum=0.0)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([2.0, -0.5])], tx.init(params), params)[0]  # -0.1 g / |g|
        [tensor([-0.1000,  0.1000])]

    References:
        Anil et al., "Memory-Efficient Adaptive Optimization", NeurIPS 2019. optax's ``optax.sm3`` (0.2.8).
    """
    return chain(scale_by_sm3(momentum), scale(-learning_rate))


def _scaled_params_added(factor: ScalarOrSchedule) -> GradientTransformation:
    """``u + factor * p``: optax's ``add_decayed_weights`` with a factor of any sign (Fromage's is negative)."""
    schedule = factor if callable(factor) else None

    def prologue(count: torch.Tensor | None) -> dict[str, float | torch.Tensor]:
        return {"factor": schedule(count) if schedule else factor}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (o.add_scaled(g, o.cast(p, g), s.factor),)

    state_type = ScaleByScheduleState if schedule else EmptyState
    return elementwise(
        Elementwise("fromage_shrink", state_type, (), schedule is not None, prologue, body, uses_params=True)
    )


def fromage(learning_rate: ScalarOrSchedule, min_norm: float | torch.Tensor = 1e-6) -> GradientTransformation:
    r"""Fromage: a step of relative size :math:`\eta` per layer, then a shrink that keeps the params' norms from
    growing.

    .. math::
        p_{t+1} = \frac{1}{\sqrt{1+\eta_t^2}}\left(p_t - \eta_t \frac{\|p_t\|}{\|g_t\|} g_t\right)

    (norms per leaf, at least ``min_norm``; the ratio is 1 where either is zero).
    ``chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(learning_rate * m), add_decayed_weights(m - 1))``
    with :math:`m = 1/\sqrt{1+\eta_t^2}`, optax's ``fromage``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        min_norm: the smallest norm of the update and of the param in the trust ratio.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.fromage(0.75)
        >>> params = [torch.tensor([0.0, 10.0])]
        >>> u = tx.update([torch.tensor([3.0, 4.0])], tx.init(params), params)[0]
        >>> fadam.apply_updates(params, u)  # (p - 0.75 * 2 g) / 1.25
        [tensor([-3.6000,  3.2000])]

    References:
        Bernstein et al., "On the distance between two neural networks and the stability of learning", NeurIPS
        2020. optax's ``optax.fromage`` (0.2.8).
    """
    if callable(learning_rate):

        def multiplier(count: torch.Tensor) -> Any:
            return 1 / (1 + learning_rate(count) ** 2) ** 0.5

        rate: ScalarOrSchedule = lambda count: multiplier(count) * learning_rate(count)  # noqa: E731
        shrink: ScalarOrSchedule = lambda count: multiplier(count) - 1  # noqa: E731
    else:
        m = 1 / (1 + learning_rate**2) ** 0.5
        rate, shrink = learning_rate * m, m - 1
    return chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(rate), _scaled_params_added(shrink))


def noisy_sgd(
    learning_rate: ScalarOrSchedule,
    eta: float | torch.Tensor = 0.01,
    gamma: float | torch.Tensor = 0.55,
    key: int | torch.Tensor | None = None,
    *,
    seed: int | None = None,
) -> GradientTransformation:
    r"""SGD with Gaussian noise of annealed variance added to the gradients.

    .. math::
        p_{t+1} = p_t - \eta_t\left(g_t + \mathcal N\!\left(0, \tfrac{\eta}{t^{\gamma}}\right)\right)

    ``chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate))``, optax's ``noisy_sgd`` (fadam's
    noise is drawn by torch's generators, see ``add_noise``).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        eta: the noise's initial variance.
        gamma: the exponent of its annealing.
        key: the seed of the noise (default 0, with a warning, as optax).
        seed: the deprecated name of ``key``.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.noisy_sgd(0.1, eta=0.0, key=0)  # no noise: SGD
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([1.0, -2.0])], tx.init(params), params)[0]
        [tensor([-0.1000,  0.2000])]

    References:
        Neelakantan et al., "Adding Gradient Noise Improves Learning for Very Deep Networks", 2015. optax's
        ``optax.noisy_sgd`` (0.2.8).
    """
    return chain(add_noise(eta, gamma, key, seed=seed), scale_by_learning_rate(learning_rate))


def polyak_sgd(
    max_learning_rate: float | torch.Tensor = 1.0,
    scaling: ScalarOrSchedule = 1.0,
    f_min: float | torch.Tensor = 0.0,
    eps: float | torch.Tensor = 0.0,
    variant: str = "sps",
) -> GradientTransformation:
    r"""SGD with the Polyak step size, from the loss's value passed to ``update(..., value=loss)``.

    .. math::
        p_{t+1} = p_t - \min\left\{\frac{f(p_t) - f^\star}{s_t^2\|g_t\|^2 + \epsilon}, \gamma_{max}\right\} s_t g_t

    ``chain(scale_by_learning_rate(scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant))``, optax's
    ``polyak_sgd`` (its ``sgd(scaling)`` first: the step is computed on the scaled gradient).

    Args:
        max_learning_rate: the largest step :math:`\gamma_{max}`.
        scaling: the factor :math:`s_t` (a float, a 0-d tensor or a schedule).
        f_min: a lower bound :math:`f^\star` of the loss.
        eps: added to the squared norm.
        variant: ``"sps"``, or ``"sps+"`` for the positive part of the gap.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.polyak_sgd()
        >>> params = [torch.tensor([1.0, 1.0])]  # f = |p|^2 / 2 = 1, g = p: the step 1 / 2
        >>> tx.update([torch.tensor([1.0, 1.0])], tx.init(params), params, value=torch.tensor(1.0))[0]
        [tensor([-0.5000, -0.5000])]

    References:
        Loizou et al., "Stochastic Polyak Step-size for SGD: An Adaptive Learning Rate for Fast Convergence",
        AISTATS 2021. optax's ``optax.polyak_sgd`` (0.2.8).
    """
    return chain(
        scale_by_learning_rate(scaling),
        scale_by_polyak(f_min=f_min, max_learning_rate=max_learning_rate, eps=eps, variant=variant),
    )


def optimistic_gradient_descent(
    learning_rate: ScalarOrSchedule, alpha: float | torch.Tensor = 1.0, beta: float | torch.Tensor = 1.0
) -> GradientTransformation:
    r"""Optimistic gradient descent: a step along the gradient extrapolated by its last change (min-max games).

    .. math::
        p_{t+1} = p_t - \eta_t\left((\alpha + \beta) g_t - \beta g_{t-1}\right)

    ``chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))``, optax's
    ``optimistic_gradient_descent``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        alpha: the gradient's coefficient.
        beta: the coefficient of its change.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.optimistic_gradient_descent(0.1)
        >>> params = [torch.zeros(1)]
        >>> u, state = tx.update([torch.ones(1)], tx.init(params), params)
        >>> tx.update([torch.full((1,), 3.0)], state, params)[0]  # -0.1 (2 * 3 - 1)
        [tensor([-0.5000])]

    References:
        Mokhtari et al., "A Unified Analysis of Extra-gradient and Optimistic Gradient Methods for Saddle Point
        Problems: Proximal Point Approach", AISTATS 2020. optax's ``optax.optimistic_gradient_descent`` (0.2.8).
    """
    return chain(scale_by_optimistic_gradient(alpha=alpha, beta=beta), scale_by_learning_rate(learning_rate))


def optimistic_adam(
    learning_rate: float | torch.Tensor,
    optimism: float | torch.Tensor | None = None,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
) -> GradientTransformation:
    r"""Optimistic Adam: Adam's direction :math:`r_t`, extrapolated by its last change.

    .. math::
        p_{t+1} = p_t - \alpha r_t - o\,(r_t - r_{t-1}),\qquad r_0 = r_1

    with :math:`r_t` ``scale_by_adam``'s (Nesterov's by default). ``chain(scale_by_adam(b1, b2, eps, eps_root,
    mu_dtype=mu_dtype, nesterov=nesterov), scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
    scale_by_learning_rate(1.0))``, optax 0.2.8's ``optimistic_adam`` (a fixed learning rate, as there).

    Args:
        learning_rate: the rate :math:`\alpha` (a float or a 0-d tensor; schedules are refused, as optax).
        optimism: the optimism :math:`o` (default: the learning rate, as in the paper).
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root.
        mu_dtype: dtype of the first moment (default: the param's).
        nesterov: Nesterov momentum in Adam's direction.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.optimistic_adam(0.1, eps=0.0, nesterov=False)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([2.0, -0.5])], tx.init(params), params)[0]  # the first step: -0.1 sign(g)
        [tensor([-0.1000,  0.1000])]

    References:
        Daskalakis et al., "Training GANs with Optimism", ICLR 2018. optax's ``optax.optimistic_adam`` (0.2.8).
    """
    if callable(learning_rate):
        raise ValueError("optimistic_adam does not support learning rate schedules (optax's optimistic_adam_v2 does)")
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
        scale_by_optimistic_gradient(alpha=learning_rate, beta=learning_rate if optimism is None else optimism),
        scale_by_learning_rate(1.0),
    )


def optimistic_adam_v2(
    learning_rate: ScalarOrSchedule,
    *,
    alpha: float | torch.Tensor = 1.0,
    beta: float | torch.Tensor = 1.0,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    nesterov: bool = True,
) -> GradientTransformation:
    r"""Optimistic Adam with a learning rate (a schedule too) apart from the optimism: Adam's direction :math:`r_t`,
    extrapolated by its last change, then scaled.

    .. math::
        p_{t+1} = p_t - \eta_t\left(\alpha r_t + \beta (r_t - r_{t-1})\right),\qquad r_0 = r_1

    with :math:`r_t` ``scale_by_adam``'s (Nesterov's by default). ``chain(scale_by_adam(b1, b2, eps, eps_root,
    mu_dtype=mu_dtype, nesterov=nesterov), scale_by_optimistic_gradient(alpha, beta),
    scale_by_learning_rate(learning_rate))``, optax's ``optimistic_adam_v2``: ``optimistic_adam(lr, o)`` is
    ``optimistic_adam_v2(1.0, alpha=lr, beta=o)``.

    Args:
        learning_rate: the rate :math:`\eta_t` (a float, a 0-d tensor or a schedule).
        alpha: the coefficient of Adam's direction.
        beta: the coefficient of its change (the optimism).
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root.
        mu_dtype: dtype of the first moment (default: the param's).
        nesterov: Nesterov momentum in Adam's direction.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.optimistic_adam_v2(0.1, alpha=0.5, eps=0.0, nesterov=False)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([2.0, -0.5])], tx.init(params), params)[0]  # the first step: -0.1 * 0.5 sign(g)
        [tensor([-0.0500,  0.0500])]

    References:
        Daskalakis et al., "Training GANs with Optimism", ICLR 2018. optax's ``optax.optimistic_adam_v2`` (0.2.8).
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
        scale_by_optimistic_gradient(alpha=alpha, beta=beta),
        scale_by_learning_rate(learning_rate),
    )


def amsgrad(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    r"""AMSGrad: Adam with the running maximum of the bias-corrected second moment in the denominator.

    .. math::
        p_{t+1} = p_t - \eta_t \frac{\hat m_t}{\sqrt{\hat v^{max}_t + \epsilon_{root}} + \epsilon}

    with the moments of ``scale_by_amsgrad``. ``chain(scale_by_amsgrad(...), scale_by_learning_rate(learning_rate))``,
    optax's ``amsgrad`` (``fadam.adam(amsgrad=True)`` is torch.optim's, the maximum of the raw moment).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root.
        mu_dtype: dtype of the first moment (default: the param's).
        bias_correction_mu: divide the first moment by :math:`1-\beta_1^t`.
        bias_correction_nu: divide the second moment by :math:`1-\beta_2^t` before the maximum.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.amsgrad(0.1, eps=0.0)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([2.0, -0.5])], tx.init(params), params)[0]  # the first step: -0.1 sign(g)
        [tensor([-0.1000,  0.1000])]

    References:
        Reddi et al., "On the Convergence of Adam and Beyond", ICLR 2018. optax's ``optax.amsgrad`` (0.2.8).
    """
    return chain(
        scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu),
        scale_by_learning_rate(learning_rate),
    )


def adamaxw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Mask | None = None,
) -> GradientTransformation:
    r"""AdamaxW: Adamax with decoupled weight decay, scaled by the learning rate.

    .. math::
        p_{t+1} = p_t - \eta_t\left(\frac{m_t}{(1-\beta_1^t)\, u^\infty_t} + \lambda p_t\right)

    with the moments of ``scale_by_adamax``. ``chain(scale_by_adamax(b1, b2, eps), add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate(learning_rate))``, optax's ``adamaxw``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: decay of the infinity norm.
        eps: added to :math:`|g_t|` inside the maximum.
        weight_decay: the factor :math:`\lambda` (a float, a 0-d tensor or a schedule), multiplied by the learning
            rate as torch.optim.AdamW does.
        mask: a bool tree (or prefix, or callable ``params -> tree``) of the leaves to decay.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adamaxw(0.1, weight_decay=0.5)
        >>> params = [torch.tensor([1.0])]
        >>> tx.update([torch.tensor([-4.0])], tx.init(params), params)[0]  # -0.1 (-1 + 0.5)
        [tensor([0.0500])]

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015, section 7.1. Loshchilov & Hutter,
        "Decoupled Weight Decay Regularization", ICLR 2019. optax's ``optax.adamaxw`` (0.2.8).
    """
    return chain(
        scale_by_adamax(b1, b2, eps),
        *_decay(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
