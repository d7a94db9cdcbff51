"""Layouts of the tensors a transform runs on: ``flatten`` (every leaf concatenated into one vector)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from fadam._base import GradientTransformation
from fadam._tree import PyTree, check_leaves, check_params, tree_flatten


def _concatenated(leaves: list[Any], what: str) -> torch.Tensor:
    """The leaves raveled and concatenated in order: one vector in their promoted dtype."""
    pieces = [leaf.reshape(-1) for leaf in leaves if leaf is not None]
    if not pieces:
        raise ValueError(f"flatten: the {what} have no tensor leaves to concatenate")
    devices = {piece.device for piece in pieces}
    if len(devices) > 1:
        raise ValueError(f"flatten: the {what} are on several devices ({sorted(map(str, devices))}), expected one")
    return torch.cat(pieces)


def _filled(updates: PyTree, params: PyTree | None) -> tuple[list[Any], list[Any], optree.PyTreeSpec]:
    """The leaves of ``updates`` (checked against ``params`` where given), a ``None`` update of a param as zeros of
    its shape; with the original leaves and the tree spec."""
    if params is None:
        leaves, spec = tree_flatten(updates)
        if any(leaf is None for leaf in leaves):
            raise ValueError(
                "flatten: an update is None (a param without a gradient): pass the params to update, "
                "whose zeros take its place in the vector"
            )
        check_leaves(updates, updates)
        return leaves, leaves, spec
    leaves, param_leaves, spec = check_leaves(updates, params)
    filled = [torch.zeros_like(p) if u is None and p is not None else u for u, p in zip(leaves, param_leaves)]
    return filled, leaves, spec


def _split(flat: torch.Tensor, leaves: list[Any], like: list[Any], spec: optree.PyTreeSpec) -> PyTree:
    """``flat`` cut into pieces of the sizes of ``leaves``, each in its leaf's shape and dtype; ``None`` where ``like``
    has ``None``."""
    out, offset = [], 0
    for leaf, kept in zip(leaves, like):
        if leaf is None:
            out.append(None)
            continue
        piece = flat[offset : offset + leaf.numel()].reshape(leaf.shape)
        offset += leaf.numel()
        if piece.is_complex() and not leaf.is_complex():  # a real leaf among complex ones: its imaginary part is 0
            piece = piece.real
        out.append(None if kept is None else piece.to(leaf.dtype))
    return spec.unflatten(out)


def flatten(inner: GradientTransformation) -> GradientTransformation:
    r"""Runs ``inner`` on one vector: the concatenation of every leaf of the params and the updates.

    .. math::
        v_t = \operatorname{concat}_i \operatorname{vec}(g_t^{(i)}),\qquad
        (w_t, S_t) = \text{inner.update}(v_t, S_{t-1}, \operatorname{concat}_i \operatorname{vec}(p_t^{(i)})),
        \qquad u_t^{(i)} = \operatorname{reshape}(w_t[o_i : o_i + n_i], \operatorname{shape}(g_t^{(i)}))

    with :math:`o_i` and :math:`n_i` the offset and size of leaf :math:`i`: many small leaves become one tensor
    (fewer per-leaf operations), and any per-leaf rule of ``inner`` (a norm, a trust ratio) sees the whole model as
    one leaf. The state is ``inner``'s state of that vector, as optax's ``flatten``.

    For PyTorch: leaves of several dtypes are concatenated in their promoted dtype (as optax) and each update comes
    back in its gradient's dtype (optax returns the promoted one). A ``None`` update (a param without a gradient)
    enters the vector as zeros, as jax differentiates an unused param, when ``update`` is given the params; its
    update stays ``None`` (the param is left as it is), while ``inner``'s state moves as for a zero gradient.

    Args:
        inner: the transform run on the flat vector.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.flatten(fadam.scale_by_trust_ratio())  # one trust ratio for the whole model
        >>> params = {"a": torch.tensor([3.0]), "b": torch.tensor([0.0, 4.0])}  # |p| = 5
        >>> grads = {"a": torch.tensor([0.0]), "b": torch.tensor([0.0, 10.0])}  # |g| = 10
        >>> tx.update(grads, tx.init(params), params)[0]
        {'a': tensor([0.]), 'b': tensor([0., 5.])}

    References:
        optax's ``optax.flatten`` (0.2.8), whose semantics these are.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"flatten: inner is a {type(inner).__name__}, expected a GradientTransformation")

    def init(params: PyTree) -> PyTree:
        return inner.init(_concatenated(check_params(params), "params"))

    def update(updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args: Any) -> tuple:
        leaves, given, spec = _filled(updates, params)
        flat_params = None if params is None else _concatenated(spec.flatten_up_to(params), "params")
        flat_updates, new_state = inner.update(_concatenated(leaves, "updates"), state, flat_params, **extra_args)
        return _split(flat_updates, leaves, given, spec), new_state

    return GradientTransformation(init, update)
