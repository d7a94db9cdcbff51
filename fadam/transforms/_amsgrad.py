"""optax's AMSGrad scaling: ``scale_by_amsgrad``, the running maximum taken on the bias-corrected second moment
(``scale_by_adam(amsgrad=True)`` takes it on the raw moment, as torch.optim)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, safe_increment
from fadam._program import Elementwise, Slot, elementwise
from fadam._tree import PyTree
from fadam.transforms._validation import check_non_negative, check_unit_interval


class ScaleByAmsgradCorrectedState(NamedTuple):
    """optax's AMSGrad state. Its own type, not ``ScaleByAmsgradState``: that one's ``nu_max`` is the maximum of the
    raw moment, which ``state_to_torch`` writes as torch.optim's ``max_exp_avg_sq``; this one's is not."""

    count: torch.Tensor  # 0-d int32: steps taken
    mu: PyTree  # first moment
    nu: PyTree  # second moment
    nu_max: PyTree  # running maximum of the bias-corrected second moment


def scale_by_amsgrad(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    r"""Rescales updates by AMSGrad: Adam with the running maximum of the (bias-corrected) second moment.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
        \hat v^{max}_t = \max\left(\hat v^{max}_{t-1}, \frac{v_t}{1-\beta_2^t}\right),\quad
        u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{\hat v^{max}_t + \epsilon_{root}} + \epsilon}

    (without ``bias_correction_mu`` or ``bias_correction_nu`` the matching correction is 1, the paper's
    algorithm). The state is ``ScaleByAmsgradCorrectedState(count, mu, nu, nu_max)``, ``nu_max`` the maximum
    above. Complex leaves are treated as pairs of reals, as torch.optim does (optax takes the modulus's square).

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (meta-gradients).
        mu_dtype: dtype of the first moment (default: the param's).
        bias_correction_mu: divide the first moment by :math:`1-\beta_1^t`.
        bias_correction_nu: divide the second moment by :math:`1-\beta_2^t` before the maximum.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_amsgrad(eps=0.0)
        >>> params = [torch.zeros(2)]
        >>> u, state = tx.update([torch.tensor([2.0, -0.5])], tx.init(params))
        >>> u, state.nu_max  # the sign; the square, bias-corrected
        ([tensor([ 1., -1.])], [tensor([4.0000, 0.2500])])

    References:
        Reddi et al., "On the Convergence of Adam and Beyond", ICLR 2018. optax's ``optax.scale_by_amsgrad``
        (0.2.8), whose semantics these are.
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)

    def prologue(count: torch.Tensor) -> dict[str, float | torch.Tensor]:
        count = safe_increment(count)
        scalars = {
            "one_minus_b1": 1 - b1,
            "b2": b2,
            "one_minus_b2": 1 - b2,
            "bc1": bias_correction(b1, count) if bias_correction_mu else 1.0,
            "bc2": bias_correction(b2, count) if bias_correction_nu else 1.0,
            "eps": eps,
            "eps_root": eps_root,
        }
        return {name: host_number(value) for name, value in scalars.items()}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any, nu_max: Any) -> tuple:
        g_mu, g_nu = o.cast(g, mu), o.cast(g, nu)
        mu = o.lerp(mu, g_mu, s.one_minus_b1)
        nu = o.addcmul(nu * s.b2, g_nu, g_nu, s.one_minus_b2)
        nu_max = o.maximum(nu_max, nu / s.bc2)
        return (mu / s.bc1 / (o.sqrt(nu_max + s.eps_root) + s.eps), mu, nu, nu_max)

    slots = (Slot("mu", mu_dtype), Slot("nu", nonnegative=True), Slot("nu_max", nonnegative=True))
    return elementwise(Elementwise("scale_by_amsgrad", ScaleByAmsgradCorrectedState, slots, True, prologue, body))
