"""Shared test helpers: tree snapshots for purity checks and a normwise relative error for parity checks."""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from fadam._tree import tree_paths


def tensor_leaves(tree: Any) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor leaf holding data (``None``, non-tensor leaves and the meta tensors that
    record a layout, as paged state has, are left out)."""
    leaves = optree.tree_leaves(tree, none_is_leaf=True)
    return [
        (path, leaf)
        for path, leaf in zip(tree_paths(tree), leaves)
        if isinstance(leaf, torch.Tensor) and not leaf.is_meta
    ]


def snapshot(tree: Any) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """A record of every tensor leaf: its path, the tensor itself, a clone of its value and its version counter."""
    return [(path, t, t.detach().clone(), t._version) for path, t in tensor_leaves(tree)]


def assert_unchanged(snap: list[tuple[str, torch.Tensor, torch.Tensor, int]], what: str) -> None:
    """Every tensor recorded by ``snapshot`` is bit-identical (NaNs included) and was never written in place."""
    for path, tensor, copy, version in snap:
        assert tensor._version == version, f"{what}{path} was written in place (version {version} -> {tensor._version})"
        floating = tensor.is_floating_point() or tensor.is_complex()
        same = torch.equal(tensor, copy) or (floating and torch.allclose(tensor, copy, rtol=0, atol=0, equal_nan=True))
        assert same, f"{what}{path} changed"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Normwise relative error ``max|a - b| / max|b|`` (infinity norm), computed in float64.

    Why normwise and not elementwise: rounding errors of an optimizer step scale with the magnitudes in the step
    (the param, lr * update), not with one element's value, so an element that passes through zero has an unbounded
    elementwise relative error for any two correct implementations (torch's own fused and for-loop Adam differ by
    1e-3 elementwise on such elements, and by ~1e-7 normwise). The infinity norm is the strictest normwise measure:
    no element may be off by more than ``tol`` times the tensor's largest magnitude.
    """
    a = torch.view_as_real(actual) if actual.is_complex() else actual
    b = torch.view_as_real(expected) if expected.is_complex() else expected
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((a - b).abs().max() / scale)


def max_rel_err(actual: Any, expected: Any) -> tuple[float, str]:
    """The largest ``rel_err`` over matching tensor leaves of two trees, and the path where it occurs."""
    worst, where = 0.0, ""
    for (path, a), (_, b) in zip(tensor_leaves(actual), tensor_leaves(expected), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{path}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        err = rel_err(a, b)
        if err > worst or math.isnan(err):
            worst, where = err, path
    return worst, where


def assert_no_shared_memory(tree: Any, what: str) -> None:
    """No two non-empty tensor leaves of ``tree`` share a storage: donation writes each one in place, and a buffer
    behind two leaves would end up holding only the last value written."""
    owners: dict[int, str] = {}
    for path, t in tensor_leaves(tree):
        if t.numel():
            pointer = t.untyped_storage().data_ptr()
            assert pointer not in owners, f"{what}: {path} shares memory with {owners[pointer]}"
            owners[pointer] = path
