"""MARS (variance-reduced gradients): ``scale_by_mars``, its AdamW form, and ``mars`` with the authors' defaults (MARS
for matrices, AdamW for the other params)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import EmptyState, GradientTransformation, ScalarOrSchedule
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree, tree_map
from fadam.combinators._chain import chain
from fadam.combinators._masking import partition
from fadam.transforms._adam import scale_by_adam
from fadam.transforms._decay import add_decayed_weights
from fadam.transforms._scaling import scale_by_learning_rate
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByMarsState(NamedTuple):
    last_grad: PyTree  # the previous step's gradient (zeros before the first)


def _mars_correction(b1: float, gamma: float) -> GradientTransformation:
    """``g + gamma b1 / (1 - b1) (g - g_prev)``, keeping ``g`` as the next step's ``g_prev``."""

    def body(o: Any, s: Any, g: Any, p: Any, last_grad: Any) -> tuple:
        g = o.cast(g, last_grad)
        return (g - last_grad) * s.coef + g, g

    def prologue(count: None) -> dict[str, float]:
        return {"coef": gamma * b1 / (1 - b1)}

    return elementwise(Elementwise("scale_by_mars", ScaleByMarsState, (Slot("last_grad"),), False, prologue, body))


def _clip_by_leaf_norm(max_norm: float) -> GradientTransformation:
    """Rescales each leaf whose L2 norm exceeds ``max_norm`` to that norm (MARS's clipping of the corrected
    gradient)."""

    def reduce_leaf(u: torch.Tensor, p: torch.Tensor | None) -> dict[str, torch.Tensor]:
        norm = torch.linalg.vector_norm(u)
        return {"divisor": torch.clamp(norm / max_norm, min=1.0).to(u.real.dtype)}

    def body(o: Any, s: Any, g: Any, p: Any) -> tuple:
        return (g / s.divisor,)

    return elementwise(
        Elementwise("clip_by_leaf_norm", EmptyState, (), False, lambda count: {}, body, reduce_leaf=reduce_leaf)
    )


def scale_by_mars(
    b1: float = 0.95,
    b2: float = 0.99,
    eps: float = 1e-8,
    gamma: float = 0.025,
    max_norm: float = 1.0,
    *,
    amsgrad: bool = False,
) -> GradientTransformation:
    r"""Rescales updates by MARS-AdamW: Adam over a variance-reduced gradient, clipped per leaf.

    .. math::
        c_t = g_t + \gamma \frac{\beta_1}{1-\beta_1} (g_t - g_{t-1}),\quad
        \tilde c_t = \frac{c_t}{\max(1, \|c_t\|_2 / C)},\\
        m_t = \beta_1 m_{t-1} + (1-\beta_1)\tilde c_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2)\tilde c_t^2,\quad
        u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}

    with :math:`g_0 = 0` and :math:`C` the ``max_norm`` (1 in the paper), the norm taken over each leaf on its own.
    This is the approximate form of the authors' code (``is_approx=True``: the previous gradient stands in for the
    gradient of the previous batch at the current params). ``chain(_correction, _clip per leaf, scale_by_adam)``:
    the state is ``(ScaleByMarsState, EmptyState, ScaleByAdamState)``, and each stage runs elementwise (the generated
    CPU kernel where the leaves allow it). With ``amsgrad``, the running maximum of :math:`v` as in torch.optim.

    Args:
        b1: decay of the first moment, which also sets the weight of the correction.
        b2: decay of the second moment.
        eps: added to the denominator.
        gamma: :math:`\gamma`, the scale of the gradient correction.
        max_norm: :math:`C`, the largest L2 norm of a leaf's corrected gradient.
        amsgrad: AMSGrad's running maximum of the second moment.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_mars(eps=0.0)
        >>> g = [torch.tensor([0.3, -0.4])]  # norm 0.5 * (1 + 0.025 * 19) < 1: not clipped
        >>> tx.update(g, tx.init(g))[0]  # Adam's first step: the sign
        [tensor([ 1., -1.])]

    References:
        Yuan et al., "MARS: Unleashing the Power of Variance Reduction for Training Large Models", 2024 (Algorithm 2,
        MARS-AdamW). The authors' ``MARS`` optimizer (github.com/AGI-Arena/MARS, ``mars_type="mars-adamw"``).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("gamma", gamma)
    if not max_norm > 0:
        raise ValueError(f"Invalid max_norm: {max_norm} (expected > 0)")
    return chain(_mars_correction(b1, gamma), _clip_by_leaf_norm(max_norm), scale_by_adam(b1, b2, eps, amsgrad=amsgrad))


def _matrix_labels(params: PyTree) -> PyTree:
    return tree_map(lambda p: "mars" if p is None or p.ndim == 2 else "adamw", params)


def mars(
    lr: ScalarOrSchedule = 3e-3,
    betas: tuple[float, float] = (0.95, 0.99),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    gamma: float = 0.025,
    optimize_1d: bool = False,
    lr_1d: ScalarOrSchedule = 3e-3,
    betas_1d: tuple[float, float] = (0.9, 0.95),
    weight_decay_1d: float = 0.1,
) -> GradientTransformation:
    r"""MARS-AdamW with the authors' arguments and defaults: MARS on matrices, AdamW on the other params.

    .. math::
        x_{t+1} = x_t - \eta\,(u_t + \lambda x_t)

    with :math:`u_t` the update of ``scale_by_mars(*betas, eps, gamma)`` for a 2-D param and of Adam
    (``betas_1d``, rate ``lr_1d``, decay ``weight_decay_1d``) for any other, as the authors' ``MARS`` does
    unless ``optimize_1d`` (then MARS for every param, with ``lr`` and ``weight_decay``). The decay is decoupled
    (AdamW's) and scaled by the rate only.

    Args:
        lr: :math:`\eta` of the MARS params: a number or a schedule.
        betas: MARS's decays of the moments (:math:`\beta_1` also weighs the correction).
        eps: added to the denominators.
        weight_decay: :math:`\lambda` of the MARS params.
        amsgrad: AMSGrad's running maximum of the second moments.
        gamma: the scale of MARS's gradient correction.
        optimize_1d: MARS for the params that are not matrices too.
        lr_1d: the rate of the AdamW params (the authors give it as ``lr_1d`` and scale it with ``lr``'s schedule;
            here a number or a schedule of its own).
        betas_1d: the AdamW params' decays.
        weight_decay_1d: the AdamW params' decoupled decay.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.mars(lr=0.1, lr_1d=0.01)
        >>> params = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
        >>> updates, state = tx.update({"w": torch.full((2, 2), 0.1), "b": torch.ones(2)}, tx.init(params), params)
        >>> updates["w"][0], updates["b"]  # MARS on the matrix, AdamW on the vector: signs first
        (tensor([-0.1000, -0.1000]), tensor([-0.0100, -0.0100]))

    References:
        Yuan et al., "MARS: Unleashing the Power of Variance Reduction for Training Large Models", 2024.
        The authors' ``MARS`` optimizer (github.com/AGI-Arena/MARS, ``mars_type="mars-adamw"``, ``is_approx=True``).
    """
    if not callable(lr):
        check_non_negative("lr", lr)
    check_non_negative("weight_decay", weight_decay)
    decay = [add_decayed_weights(weight_decay)] if weight_decay else []
    matrices = chain(scale_by_mars(*betas, eps, gamma, amsgrad=amsgrad), *decay, scale_by_learning_rate(lr))
    if optimize_1d:
        return matrices
    if not callable(lr_1d):
        check_non_negative("lr_1d", lr_1d)
    check_non_negative("weight_decay_1d", weight_decay_1d)
    decay_1d = [add_decayed_weights(weight_decay_1d)] if weight_decay_1d else []
    others = chain(scale_by_adam(*betas_1d, eps, amsgrad=amsgrad), *decay_1d, scale_by_learning_rate(lr_1d))
    return partition({"mars": matrices, "adamw": others}, _matrix_labels)
