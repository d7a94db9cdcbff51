"""Optimizers with quantized state, named as in bitsandbytes: each is its fadam alias with ``quantize_state`` around
the stateful transform. Signatures follow torch.optim (``adam8bit`` keeps torch.optim.Adam's coupled L2 weight decay;
use ``adamw8bit`` for decoupled decay, which is what bitsandbytes' ``Adam8bit`` silently applies)."""

from __future__ import annotations

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam.aliases import _check_adam_args, _check_lion_args, _check_lr, _head, _tail
from fadam.combinators._chain import chain
from fadam.quantization._wrapper import quantize_state
from fadam.transforms._adam import scale_by_adam
from fadam.transforms._ademamix import scale_by_ademamix
from fadam.transforms._lion import scale_by_lion
from fadam.transforms._momentum import trace
from fadam.transforms._scaling import scale_by_learning_rate

__all__ = ["adam4bit", "adam8bit", "adamw4bit", "adamw8bit", "ademamix8bit", "lion8bit", "sgd8bit"]


def _quantized_adam(
    bits: int,
    decoupled: bool,
    lr: ScalarOrSchedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float | torch.Tensor,
    amsgrad: bool,
    maximize: bool,
    block_size: int | None,
    min_size: int,
) -> GradientTransformation:
    _check_adam_args(lr, betas, eps, weight_decay)
    head, tail = _head(maximize, weight_decay, decoupled), _tail(lr, weight_decay, decoupled)
    adam_tx = scale_by_adam(betas[0], betas[1], eps, amsgrad=amsgrad)
    members = [
        *head,
        quantize_state(adam_tx, bits=bits, block_size=block_size, min_size=min_size),
        scale_by_learning_rate(lr),
        *tail,
    ]
    return chain(*members)


def adam8bit(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    block_size: int | None = None,
    min_size: int = 4096,
) -> GradientTransformation:
    r"""``fadam.adam`` with its moments stored in 8 bits (blocks of 256, dynamic-exponent maps).

    .. math::
        p_t = p_{t-1} - \eta_t \frac{\hat m_t/(1-\beta_1^t)}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t} + \epsilon},\quad
        \hat m_t, \hat v_t \text{ computed from the dequantized } m_{t-1}, v_{t-1}

    Args:
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``fadam.adam`` (coupled L2 weight decay).
        block_size: elements per quantization block (default 256).
        min_size: params with fewer elements keep float32 moments (float64 for float64 params; bitsandbytes'
            ``min_8bit_size``).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adam8bit(lr=0.1, min_size=8)
        >>> params = {"w": torch.ones(8)}
        >>> updates, state = tx.update({"w": torch.ones(8)}, tx.init(params), params)
        >>> fadam.apply_updates(params, updates)["w"][:2]
        tensor([0.9000, 0.9000])

    References:
        Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022.
    """
    return _quantized_adam(8, False, lr, betas, eps, weight_decay, amsgrad, maximize, block_size, min_size)


def adamw8bit(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    block_size: int | None = None,
    min_size: int = 4096,
) -> GradientTransformation:
    r"""``fadam.adamw`` (decoupled weight decay) with its moments stored in 8 bits.

    .. math::
        p_t = p_{t-1} - \eta_t \left(\lambda p_{t-1} + \frac{\hat m_t/(1-\beta_1^t)}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t}
        + \epsilon}\right)

    Args:
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``fadam.adamw``.
        block_size: elements per quantization block (default 256).
        min_size: params with fewer elements keep float32 moments (float64 for float64 params).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adamw8bit(lr=0.1, weight_decay=0.0, min_size=8)
        >>> params = [torch.zeros(8)]
        >>> tx.update([torch.ones(8)], tx.init(params), params)[0][0][:2]
        tensor([-0.1000, -0.1000])

    References:
        Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022.
    """
    return _quantized_adam(8, True, lr, betas, eps, weight_decay, amsgrad, maximize, block_size, min_size)


def adam4bit(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    block_size: int | None = None,
    min_size: int = 4096,
) -> GradientTransformation:
    r"""``fadam.adam`` with its moments stored in 4 bits (blocks of 128; signed dynamic map for m, zero-free linear
    map for v).

    .. math::
        p_t = p_{t-1} - \eta_t \frac{\hat m_t/(1-\beta_1^t)}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    Args:
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``fadam.adam``.
        block_size: elements per quantization block (default 128).
        min_size: params with fewer elements keep float32 moments (float64 for float64 params).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adam4bit(lr=0.1, min_size=8)
        >>> params = [torch.zeros(8)]
        >>> tx.update([torch.ones(8)], tx.init(params), params)[0][0][:2]
        tensor([-0.1000, -0.1000])

    References:
        Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023.
    """
    return _quantized_adam(4, False, lr, betas, eps, weight_decay, amsgrad, maximize, block_size, min_size)


def adamw4bit(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    block_size: int | None = None,
    min_size: int = 4096,
) -> GradientTransformation:
    r"""``fadam.adamw`` with its moments stored in 4 bits (blocks of 128).

    .. math::
        p_t = p_{t-1} - \eta_t \left(\lambda p_{t-1} + \frac{\hat m_t/(1-\beta_1^t)}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t}
        + \epsilon}\right)

    Args:
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``fadam.adamw``.
        block_size: elements per quantization block (default 128).
        min_size: params with fewer elements keep float32 moments (float64 for float64 params).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adamw4bit(lr=0.1, weight_decay=0.0, min_size=8)
        >>> params = [torch.zeros(8)]
        >>> tx.update([-torch.ones(8)], tx.init(params), params)[0][0][:2]
        tensor([0.1000, 0.1000])

    References:
        Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023.
    """
    return _quantized_adam(4, True, lr, betas, eps, weight_decay, amsgrad, maximize, block_size, min_size)


def sgd8bit(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.9,
    dampening: float = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    block_size: int | None = None,
    min_size: int = 4096,
) -> GradientTransformation:
    r"""``fadam.sgd`` with momentum, its buffer stored in 8 bits (bitsandbytes' ``SGD8bit``, which needs momentum).

    .. math::
        b_1 = g_1,\ b_t = \mu \hat b_{t-1} + (1-d) g_t,\quad
        p_t = p_{t-1} - \eta_t (\text{nesterov} ? g_t + \mu b_t : b_t)

    Args:
        lr, momentum, dampening, weight_decay, nesterov, maximize: as ``fadam.sgd`` (momentum must be > 0).
        block_size: elements per quantization block (default 256).
        min_size: params with fewer elements keep a float32 buffer (float64 for float64 params).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.sgd8bit(lr=0.1, momentum=0.9, min_size=8)
        >>> params = [torch.zeros(8)]
        >>> tx.update([torch.ones(8)], tx.init(params), params)[0][0][:2]
        tensor([-0.1000, -0.1000])
    """
    _check_lr(lr)
    if not momentum > 0.0:
        raise ValueError(f"sgd8bit needs a momentum > 0 (there is no state to quantize otherwise), got {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    head = _head(maximize, weight_decay)
    momentum_tx = trace(momentum, nesterov, dampening=dampening)
    return chain(
        *head,
        quantize_state(momentum_tx, bits=8, block_size=block_size, min_size=min_size),
        scale_by_learning_rate(lr),
    )


def lion8bit(
    lr: ScalarOrSchedule = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
    block_size: int | None = None,
    min_size: int = 4096,
) -> GradientTransformation:
    r"""Lion with its momentum stored in 8 bits and decoupled weight decay (bitsandbytes' ``Lion8bit``).

    .. math::
        p_t = p_{t-1}(1 - \eta_t\lambda) - \eta_t\,\mathrm{sign}(\beta_1 \hat m_{t-1} + (1-\beta_1) g_t),\quad
        m_t = \beta_2 \hat m_{t-1} + (1-\beta_2) g_t

    Args:
        lr: learning rate (Lion's is typically 3-10x smaller than Adam's).
        betas: ``(b1, b2)`` of ``scale_by_lion``.
        weight_decay: decoupled weight decay.
        maximize: maximize the objective.
        block_size: elements per quantization block (default 256).
        min_size: params with fewer elements keep a float32 momentum (float64 for float64 params).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.lion8bit(lr=0.1, min_size=8)
        >>> params = [torch.zeros(8)]
        >>> tx.update([torch.ones(8)], tx.init(params), params)[0][0][:2]
        tensor([-0.1000, -0.1000])

    References:
        Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.
    """
    _check_lion_args(lr, betas, weight_decay)
    head, tail = _head(maximize, weight_decay, decoupled=True), _tail(lr, weight_decay, decoupled=True)
    lion_tx = scale_by_lion(betas[0], betas[1])
    return chain(
        *head,
        quantize_state(lion_tx, bits=8, block_size=block_size, min_size=min_size),
        scale_by_learning_rate(lr),
        *tail,
    )


def ademamix8bit(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float, ScalarOrSchedule] = (0.9, 0.999, 0.9999),
    alpha: ScalarOrSchedule = 5.0,
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    *,
    maximize: bool = False,
    block_size: int | None = None,
    min_size: int = 4096,
) -> GradientTransformation:
    r"""AdEMAMix with its three moments stored in 8 bits and decoupled weight decay (bitsandbytes' ``AdEMAMix8bit``).

    .. math::
        p_t = p_{t-1}(1 - \eta_t\lambda) - \eta_t\frac{\hat m^{(1)}_t/(1-\beta_1^t) + \alpha\, \hat m^{(2)}_t}
        {\sqrt{\hat v_t/(1-\beta_2^t)} + \epsilon},\quad
        \hat m^{(1)}, \hat m^{(2)}, \hat v \text{ computed from the dequantized state}

    ``chain([scale(-1)], quantize_state(scale_by_ademamix), scale_by_learning_rate, add_decoupled_weight_decay)``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: ``(b1, b2, b3)`` of ``scale_by_ademamix`` (``b3`` may be a schedule).
        alpha: weight of the slow momentum (a number or a schedule).
        eps: added to the denominator.
        weight_decay: decoupled weight decay, scaled by the learning rate (torch.optim.AdamW's).
        maximize: maximize the objective.
        block_size: elements per quantization block (default 256).
        min_size: params with fewer elements keep float32 moments (float64 for float64 params).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.ademamix8bit(lr=0.1, weight_decay=0.0, min_size=8)
        >>> params = [torch.zeros(8)]
        >>> tx.update([torch.ones(8)], tx.init(params), params)[0][0][:2]
        tensor([-0.1000, -0.1000])

    References:
        Pagliardini et al., "The AdEMAMix Optimizer: Better, Faster, Older", 2024.
        Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022.
        bitsandbytes' ``bnb.optim.AdEMAMix8bit``, whose name and arguments these are (its ``t_alpha``/``t_beta3``
        warm-ups are schedules given as ``alpha`` and ``betas[2]`` here).
    """
    _check_adam_args(lr, betas[:2], eps, weight_decay)
    head, tail = _head(maximize, weight_decay, decoupled=True), _tail(lr, weight_decay, decoupled=True)
    ademamix_tx = scale_by_ademamix(betas[0], betas[1], betas[2], alpha, eps)
    return chain(
        *head,
        quantize_state(ademamix_tx, bits=8, block_size=block_size, min_size=min_size),
        scale_by_learning_rate(lr),
        *tail,
    )
