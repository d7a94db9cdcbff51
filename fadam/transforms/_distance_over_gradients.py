"""DoG's step size, layer-wise: ``scale_by_distance_over_gradients`` (the largest distance travelled from the initial
params over the root of the summed squared gradient norms, per leaf)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fadam._base import GradientTransformation
from fadam._numerics import dtype_for
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._validation import check_non_negative, check_state


class ScaleByDistanceOverGradientsState(NamedTuple):
    max_dist: PyTree  # per leaf, 0-d (the leaf's real dtype): the largest distance from the initial params so far
    grad_sum_of_squares: PyTree  # per leaf, 0-d: the sum of the squared norms of its gradients
    init_params: PyTree  # the initial params, in ``param_dtype``


def scale_by_distance_over_gradients(
    reps_rel: float = 1e-6,
    eps: float = 1e-8,
    param_dtype: torch.dtype | None = torch.float32,
    global_scale: float = 1.0,
) -> GradientTransformation:
    r"""Scales each leaf's update by DoG's step size: the largest distance from the initial params over the root of
    the summed squared gradient norms (Layer-wise DoG).

    Per leaf, with :math:`x_0` the initial params:

    .. math::
        \bar r_t = \max\left(\bar r_{t-1}, \|x_t - x_0\|\right),\ \bar r_0 = r_\epsilon (1 + \|x_0\|),\quad
        G_t = G_{t-1} + \|g_t\|^2,\quad u_t = s\,\frac{\bar r_t}{\sqrt{G_t + \epsilon}}\, g_t

    The update has the gradient's sign: ``global_scale=-1.0`` (or a ``scale(-1.0)`` after it) descends. The state
    keeps one copy of the params and two 0-d tensors per leaf (optax keeps the sums as 1-element vectors, which
    give a 0-d leaf a 1-element update; here it keeps its shape).

    Args:
        reps_rel: :math:`r_\epsilon`, the initial distance relative to :math:`1 + \|x_0\|` (the authors advise 1e-4
            with batch normalization, 1e-6 otherwise).
        eps: added under the square root.
        param_dtype: the dtype of the stored initial params (optax's default float32; ``None``: the params').
        global_scale: the factor :math:`s`.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.scale_by_distance_over_gradients(reps_rel=0.1, eps=0.0, global_scale=-1.0)
        >>> params = [torch.tensor([3.0, 4.0])]  # |x0| = 5: the first distance 0.1 (1 + 5)
        >>> tx.update([torch.tensor([3.0, 4.0])], tx.init(params), params)[0]  # -0.6 g / |g|
        [tensor([-0.3600, -0.4800])]

    References:
        Ivgi et al., "DoG is SGD's Best Friend: A Parameter-Free Dynamic Step Size Schedule", ICML 2023. optax's
        ``optax.scale_by_distance_over_gradients`` (0.2.8), whose semantics these are.
    """
    check_non_negative("reps_rel", reps_rel)
    check_non_negative("eps", eps)

    def init(params: PyTree) -> ScaleByDistanceOverGradientsState:
        check_params(params)

        def first_distance(p: torch.Tensor | None) -> torch.Tensor | None:
            return None if p is None else reps_rel * (1 + torch.linalg.vector_norm(p))

        def zero(p: torch.Tensor | None) -> torch.Tensor | None:
            return None if p is None else torch.zeros([], dtype=p.real.dtype, device=p.device)

        def stored(p: torch.Tensor | None) -> torch.Tensor | None:
            return None if p is None else p.to(dtype_for(p, param_dtype), copy=True)

        return ScaleByDistanceOverGradientsState(
            tree_map(first_distance, params), tree_map(zero, params), tree_map(stored, params)
        )

    def update(
        updates: PyTree, state: ScaleByDistanceOverGradientsState, params: PyTree | None = None, **_: object
    ) -> tuple[PyTree, ScaleByDistanceOverGradientsState]:
        check_state(state, ScaleByDistanceOverGradientsState, "scale_by_distance_over_gradients")
        if params is None:
            raise ValueError("scale_by_distance_over_gradients needs params: call update(updates, state, params)")
        grads, param_leaves, spec = check_leaves(updates, params)
        distances, sums, starts = (spec.flatten_up_to(tree) for tree in state)
        new_updates, new_distances, new_sums = [], [], []
        for g, p, distance, total, start in zip(grads, param_leaves, distances, sums, starts):
            if g is None:  # no gradient: the leaf is skipped, its state kept
                new_updates.append(None)
                new_distances.append(distance)
                new_sums.append(total)
                continue
            distance = torch.maximum(distance, torch.linalg.vector_norm(p - start).to(distance.dtype))
            total = total + torch.linalg.vector_norm(g).to(total.dtype) ** 2
            rate = global_scale * (distance / torch.sqrt(total + eps))
            new_updates.append(rate.to(g.real.dtype) * g)
            new_distances.append(distance)
            new_sums.append(total)
        new_state = ScaleByDistanceOverGradientsState(
            spec.unflatten(new_distances), spec.unflatten(new_sums), state.init_params
        )
        return spec.unflatten(new_updates), new_state

    return GradientTransformation(init, update)
