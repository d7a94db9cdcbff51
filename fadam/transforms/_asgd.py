"""Averaged SGD: ``scale_by_asgd`` (torch.optim.ASGD's decayed step and its running average of the params)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._numerics import host_number
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative


class ScaleByAsgdState(NamedTuple):
    count: torch.Tensor  # 0-d int32: steps taken (torch.optim.ASGD's ``step``; its ``eta`` and ``mu`` follow from it)
    ax: PyTree  # the averaged params (its ``ax``)


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim.ASGD keeps ``eta`` and ``mu`` in: float64 under a float64 default dtype, else float32."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _rates(
    lr: float | torch.Tensor, lambd: float, alpha: float, t0: float, count: torch.Tensor, dtype: torch.dtype
) -> tuple[Any, Any]:
    """``eta`` and ``mu`` for the step after ``count`` steps, rounded to ``dtype`` as torch.optim.ASGD stores them:
    ``eta = lr / (1 + lambd lr n) ** alpha`` and ``mu = 1 / max(1, n - t0)`` of the ``n = count`` steps taken, and
    the initial ``eta = lr``, ``mu = 1`` before the first step."""
    n = host_number(count)
    if isinstance(n, int) and not isinstance(lr, torch.Tensor):  # Python doubles, as torch.optim computes them
        eta = lr / ((1 + lambd * lr * n) ** alpha)
        mu = 1.0 if n == 0 else 1 / max(1, n - t0)
        return (torch.tensor(eta, dtype=dtype).item(), torch.tensor(mu, dtype=dtype).item())
    steps = count.to(torch.float64)
    eta = lr / (1 + lambd * lr * steps) ** alpha
    mu = torch.where(steps == 0, 1.0, 1 / torch.clamp(steps - t0, min=1.0))
    return eta.to(dtype).to(torch.float64), mu.to(dtype).to(torch.float64)


def scale_by_asgd(
    lr: ScalarOrSchedule = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6
) -> GradientTransformation:
    r"""Averaged SGD's step, as torch.optim.ASGD takes it, and the running average of the params it keeps.

    .. math::
        \eta_t = \frac{\eta}{(1 + \lambda \eta (t-1))^{\alpha}},\quad
        \mu_t = \frac{1}{\max(1, t - 1 - t_0)}\ (\mu_1 = 1),\quad
        p_t = p_{t-1}(1 - \lambda\eta_t) - \eta_t g_t,\quad
        \bar p_t = \bar p_{t-1} + \mu_t (p_t - \bar p_{t-1}),\quad u_t = p_t - p_{t-1}

    The update is the whole step (learning rate and decay included), so ``apply_updates`` gives :math:`p_t`; the
    averaged params :math:`\bar p_t` are the state's ``ax`` (torch's ``state["ax"]``): ``state.ax`` here,
    ``state[-1].ax`` of ``fadam.asgd``'s chain. Where :math:`\mu_t = 1` (every step up to :math:`t_0 + 2`)
    :math:`\bar p_t` is :math:`p_t` exactly, as torch copies it. :math:`\eta_t` and :math:`\mu_t` are rounded to
    float32 (float64 under a float64 default dtype when the transform is built), as torch stores them.

    Args:
        lr: the learning rate :math:`\eta` (a float, a 0-d tensor or a schedule of the step count).
        lambd: the decay term :math:`\lambda`.
        alpha: the power :math:`\alpha` of the learning-rate decay.
        t0: the step :math:`t_0` at which averaging starts.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_asgd(lr=0.5, lambd=0.0)
        >>> params = [torch.ones(1)]
        >>> updates, state = tx.update([torch.tensor([1.0])], tx.init(params), params)
        >>> updates, state.ax
        ([tensor([-0.5000])], [tensor([0.5000])])

    References:
        Polyak & Juditsky, "Acceleration of Stochastic Approximation by Averaging", 1992.
    """
    if not callable(lr):
        check_non_negative("lr", lr)
    dtype = _scalar_dtype()

    def prologue(count: torch.Tensor) -> dict[str, Any]:
        rate = lr(count) if callable(lr) else lr
        eta, mu = _rates(rate, lambd, alpha, t0, count, dtype)
        # keep = 0 where mu is 1: the average becomes the new param exactly (torch copies it there)
        keep = float(mu != 1) if isinstance(mu, float) else (mu != 1).to(torch.float64)
        return {"decay": 1 - lambd * eta, "neg_eta": -eta, "mu": mu, "keep": keep}

    def body(o: Any, s: Any, g: Any, p: Any, ax: Any) -> tuple:
        g = o.cast(g, p)
        new_p = o.add_scaled(p * s.decay, g, s.neg_eta)  # torch's param.mul_(1 - lambd eta).add_(grad, alpha=-eta)
        kept = ax * s.keep
        return new_p - p, kept + (new_p - kept) * s.mu

    decl = Elementwise("scale_by_asgd", ScaleByAsgdState, (Slot("ax"),), True, prologue, body, uses_params=True)
    return elementwise(decl)
