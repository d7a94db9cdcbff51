"""SparseAdam's scaling: ``scale_by_sparse_adam``, Adam at the elements a sparse gradient stores
(``torch.optim.SparseAdam``)."""

from __future__ import annotations

from typing import Any

from fadam._base import GradientTransformation
from fadam._numerics import bias_correction, host_number, safe_increment
from fadam._program import Elementwise, Slot, SparseRule, elementwise
from fadam.transforms._adam import ScaleByAdamState
from fadam.transforms._validation import check_non_negative, check_unit_interval


def scale_by_sparse_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    r"""Rescales sparse updates by Adam's moments, kept at the elements each update stores (lazy Adam).

    .. math::
        m_t = m_{t-1} + (1-\beta_1)(g_t - m_{t-1}),\quad v_t = v_{t-1} + (1-\beta_2)(g_t^2 - v_{t-1}),\quad
        u_t = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,\frac{m_t}{\sqrt{v_t} + \epsilon}

    at the elements of the sparse COO gradient (its repeated indices summed first); the moments elsewhere are left as
    they are, and the update is sparse, with the gradient's indices. This is ``torch.optim.SparseAdam``, rounded as it
    rounds: :math:`\epsilon` is added to the root of the raw second moment (Adam's :math:`\hat\epsilon`), not of the
    bias-corrected one as in ``scale_by_adam``. The bias corrections follow the transform's step count, which every
    step advances, as SparseAdam advances a param's step at each of its steps. Dense gradients are refused, as
    SparseAdam refuses them. The state is ``ScaleByAdamState``: ``mu`` and ``nu`` are SparseAdam's ``exp_avg`` and
    ``exp_avg_sq``.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the root of the second moment.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_sparse_adam()
        >>> params = [torch.zeros(3, 2)]
        >>> grad = torch.sparse_coo_tensor([[2]], [[1.0, -4.0]], (3, 2))
        >>> updates, state = tx.update([grad], tx.init(params))
        >>> updates[0].to_dense().round(decimals=4)
        tensor([[ 0.,  0.],
                [ 0.,  0.],
                [ 1., -1.]])

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015 (section 2, the last form of the update).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)

    def prologue(count: Any) -> dict[str, float | Any]:
        count = safe_increment(count)
        step_size = bias_correction(b2, count).sqrt() / bias_correction(b1, count)
        return {"one_minus_b1": 1 - b1, "one_minus_b2": 1 - b2, "eps": eps, "step_size": host_number(step_size)}

    def body(o: Any, s: Any, g: Any, p: Any, mu: Any, nu: Any) -> tuple:
        g_mu, g_nu = o.cast(g, mu), o.cast(g, nu)
        # torch.optim.SparseAdam: old + (new - old) * (1 - beta), for both moments
        mu = mu + (g_mu - mu) * s.one_minus_b1
        nu = nu + (g_nu * g_nu - nu) * s.one_minus_b2
        return mu / (o.sqrt(nu) + s.eps) * s.step_size, mu, nu

    slots = (Slot("mu"), Slot("nu", nonnegative=True))
    rule = SparseRule(dense="SparseAdam does not support dense gradients, please consider Adam instead")
    decl = Elementwise("scale_by_sparse_adam", ScaleByAdamState, slots, True, prologue, body, sparse=rule)
    return elementwise(decl)
