"""SOAP with the official implementation's signature (``soap``) and Shampoo with Meta's DistributedShampoo's
(``shampoo``), each a ``chain`` of transforms."""

from __future__ import annotations

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule, Schedule
from fadam.aliases import _check_lr, _has_decay, _value
from fadam.combinators._chain import chain
from fadam.combinators._conditionality import conditionally_transform
from fadam.transforms._decay import add_decayed_weights, add_decoupled_weight_decay
from fadam.transforms._momentum import trace
from fadam.transforms._scaling import scale_by_learning_rate
from fadam.transforms._shampoo import scale_by_shampoo
from fadam.transforms._soap import scale_by_soap


def _check_weight_decay(weight_decay: ScalarOrSchedule) -> None:
    if not callable(weight_decay) and not _value(weight_decay, "weight_decay") >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _one_step_later(value: ScalarOrSchedule) -> ScalarOrSchedule:
    """A schedule read one count later: a transform that skips the first step counts one step fewer."""
    if not callable(value):
        return value
    schedule: Schedule = value
    return lambda count: schedule(count + 1)


def soap(
    learning_rate: ScalarOrSchedule = 3e-3,
    betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.95, 0.95),
    shampoo_beta: float | torch.Tensor = -1.0,
    eps: float | torch.Tensor = 1e-8,
    weight_decay: ScalarOrSchedule = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    data_format: str = "channels_first",
    correct_bias: bool = True,
) -> GradientTransformation:
    r"""SOAP with the official implementation's signature and defaults (its ``lr`` named ``learning_rate``).

    .. math::
        p_t = (1 - \eta_t\lambda)\, p_{t-1} - \eta_t\, u_t

    with :math:`u_t` of ``scale_by_soap`` (0 at the first step, which only builds the eigenbases; no decay then
    either, as the official implementation). ``chain(scale_by_soap(...), scale_by_learning_rate(learning_rate),
    conditionally_transform(add_decoupled_weight_decay(...), step >= 1))``. The decay is AdamW's (and heavyball's),
    of the params before the step; the official code decays the params after the step,
    :math:`(p_{t-1} - \eta_t u_t)(1 - \eta_t\lambda)`, which differs by :math:`\eta_t^2\lambda u_t`.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        betas: Adam's :math:`(\beta_1, \beta_2)`.
        shampoo_beta: the statistics' decay (-1: :math:`\beta_2`).
        eps: added to :math:`\sqrt{v_t}`.
        weight_decay: decoupled weight decay :math:`\lambda` (a float, a 0-d tensor or a schedule).
        precondition_frequency: the eigenbases move every this many steps.
        max_precond_dim: dims larger than this keep the identity.
        merge_dims: merge small consecutive dims before preconditioning.
        precondition_1d: precondition vectors too.
        normalize_grads: divide the direction by its RMS.
        data_format: ``"channels_first"`` or ``"channels_last"`` (4-d leaves, with ``merge_dims``).
        correct_bias: Adam's bias correction.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.soap(1e-2, weight_decay=0.0)
        >>> params = {"w": torch.zeros(2, 2)}
        >>> target = torch.tensor([[2.0, 0.0], [0.0, -1.0]])
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     params, state = fadam.step(tx, params, {"w": params["w"] - target}, state)
        >>> params["w"]  # the first step only builds the eigenbases; two steps of the lr towards the target
        tensor([[ 0.0200,  0.0000],
                [ 0.0000, -0.0200]])

    References:
        Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam", ICLR 2025 (arXiv:2409.11321), and the
        authors' implementation (nikhilvyas/SOAP).
    """
    _check_lr(learning_rate)
    _check_weight_decay(weight_decay)
    decay = []
    if _has_decay(weight_decay):
        # the decay's own count starts at the first step taken, one after SOAP's and the lr's
        stepped = add_decoupled_weight_decay(_one_step_later(learning_rate), _one_step_later(weight_decay))
        decay = [conditionally_transform(stepped, lambda step: step >= 1)]
    return chain(
        scale_by_soap(
            betas,
            shampoo_beta,
            eps,
            precondition_frequency,
            max_precond_dim,
            merge_dims,
            precondition_1d,
            normalize_grads,
            data_format,
            correct_bias,
        ),
        scale_by_learning_rate(learning_rate),
        *decay,
    )


def shampoo(
    learning_rate: ScalarOrSchedule = 1e-2,
    betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 1.0),
    epsilon: float | torch.Tensor = 1e-12,
    momentum: float | torch.Tensor = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    max_preconditioner_dim: int = 1024,
    precondition_frequency: int = 1,
    start_preconditioning_step: int = -1,
    inv_root_override: int = 0,
    use_nesterov: bool = False,
    use_bias_correction: bool = True,
    use_decoupled_weight_decay: bool = True,
    grafting: str | None = None,
    grafting_beta2: float | torch.Tensor = 0.999,
    grafting_epsilon: float | torch.Tensor = 1e-10,
    precondition_1d: bool = False,
) -> GradientTransformation:
    r"""Shampoo with Meta's DistributedShampoo's arguments and defaults (``grafting`` a name, not a config object).

    .. math::
        p_t = (1 - \eta_t\lambda)\, p_{t-1} - \eta_t\, b_t,\qquad b_t = \mu b_{t-1} + u_t\ \
        (\text{Nesterov: } u_t + \mu b_t)

    with :math:`u_t` of ``scale_by_shampoo`` and :math:`b_t` its momentum (``momentum`` :math:`\mu`, none at 0).
    ``chain(scale_by_shampoo(...), trace(momentum), scale_by_learning_rate(learning_rate),
    add_decoupled_weight_decay(learning_rate, weight_decay))``; with ``use_decoupled_weight_decay=False`` the decay
    is L2 instead, :math:`\lambda p` added to the gradient before everything (``add_decayed_weights``), as Meta's.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        betas: :math:`(\beta_1, \beta_2)`: the gradients' EMA and the statistics' decay (1: a sum).
        epsilon: added to the statistics' eigenvalues.
        momentum: momentum on the preconditioned direction.
        weight_decay: the decay :math:`\lambda` (a float, a 0-d tensor or a schedule).
        max_preconditioner_dim: dims larger than this keep the identity.
        precondition_frequency: the preconditioners are recomputed every this many steps.
        start_preconditioning_step: the first Shampoo step (-1: ``precondition_frequency``).
        inv_root_override: the root (0: twice the leaf's order).
        use_nesterov: Nesterov momentum.
        use_bias_correction: bias-correct the EMAs and the statistics.
        use_decoupled_weight_decay: AdamW's decay; else L2.
        grafting: ``None``, ``"adagrad"`` or ``"adam"``.
        grafting_beta2: Adam grafting's second-moment decay.
        grafting_epsilon: the grafted method's epsilon.
        precondition_1d: give vectors a preconditioner too.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.shampoo(0.1, betas=(0.0, 1.0))
        >>> params = {"w": torch.zeros(2, 2)}
        >>> g = {"w": torch.tensor([[4.0, 0.0], [0.0, 1.0]])}
        >>> tx.update(g, tx.init(params), params)[0]["w"]  # -lr g / |g| on this diagonal gradient
        tensor([[-0.1000, -0.0000],
                [-0.0000, -0.1000]])

    References:
        Gupta, Koren & Singer, "Shampoo: Preconditioned Stochastic Tensor Optimization", ICML 2018.
        Shi et al., "A Distributed Data-Parallel PyTorch Implementation of the Distributed Shampoo Optimizer for
        Training Neural Networks At-Scale", 2023 (facebookresearch/optimizers).
    """
    _check_lr(learning_rate)
    _check_weight_decay(weight_decay)
    b1, b2 = betas
    direction = scale_by_shampoo(
        b1,
        b2,
        epsilon,
        max_preconditioner_dim,
        precondition_frequency,
        start_preconditioning_step,
        inv_root_override,
        use_bias_correction,
        grafting,
        grafting_beta2,
        grafting_epsilon,
        precondition_1d,
    )
    has_momentum = isinstance(momentum, torch.Tensor) or momentum != 0
    steps = [trace(momentum, use_nesterov)] if has_momentum else []
    if not _has_decay(weight_decay):
        return chain(direction, *steps, scale_by_learning_rate(learning_rate))
    if use_decoupled_weight_decay:
        return chain(
            direction,
            *steps,
            scale_by_learning_rate(learning_rate),
            add_decoupled_weight_decay(learning_rate, weight_decay),
        )
    return chain(add_decayed_weights(weight_decay), direction, *steps, scale_by_learning_rate(learning_rate))
