"""Tree math on optree (``fadam/_tree.py``): values by hand, ``None`` leaves kept in place, path-aware checks."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import fadam
from fadam._tree import check_leaves, path_str, tree_flatten


class Pair(NamedTuple):
    first: torch.Tensor
    second: list


def _tree():
    return {"a": torch.tensor([1.0, -2.0]), "b": Pair(torch.tensor(3.0), [torch.tensor([[4.0]]), None])}


def test_arithmetic_by_hand():
    x, y = _tree(), _tree()
    added = fadam.tree_add(x, y, alpha=0.5)
    assert added["a"].tolist() == [1.5, -3.0] and float(added["b"].first) == 4.5
    assert added["b"].second[1] is None and isinstance(added["b"], Pair)
    assert fadam.tree_add(x, y)["b"].second[0].tolist() == [[8.0]]
    assert fadam.tree_sub(x, y)["a"].tolist() == [0.0, 0.0]
    assert fadam.tree_scale(x, -2.0)["a"].tolist() == [-2.0, 4.0]
    assert fadam.tree_scale(x, torch.tensor(0.5))["b"].second[0].tolist() == [[2.0]]


def test_zeros_like_and_cast():
    tree = {"f": torch.ones(2), "i": torch.ones(2, dtype=torch.int64), "z": torch.ones(2, dtype=torch.complex64)}
    zeros = fadam.tree_zeros_like(tree, dtype=torch.float64)
    assert zeros["f"].dtype == torch.float64 and zeros["z"].dtype == torch.complex128  # complex stays complex
    assert not zeros["f"].any()
    cast = fadam.tree_cast(tree, torch.bfloat16)
    assert cast["f"].dtype == torch.bfloat16
    assert cast["i"].dtype == torch.int64  # integers are left alone
    assert cast["z"].dtype == torch.complex64  # bf16 has no complex type: the nearest wider one
    assert fadam.tree_cast(tree, None) is tree
    z = fadam.tree_cast({"z": torch.tensor([1 + 2j], dtype=torch.complex64)}, torch.float64)["z"]
    assert z.dtype == torch.complex128 and z.imag.item() == 2.0


def test_global_norm_by_hand():
    assert float(fadam.tree_global_norm(_tree())) == pytest.approx((1 + 4 + 9 + 16) ** 0.5)
    assert float(fadam.global_norm([torch.tensor([3 + 4j]), torch.tensor([12.0])])) == pytest.approx(13.0)
    assert float(fadam.tree_global_norm([None, None])) == 0.0
    assert float(fadam.tree_global_norm({})) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_global_norm_is_torchs_total_norm_bit_for_bit(dtype: torch.dtype):
    torch.manual_seed(0)
    leaves = [torch.randn(n, dtype=dtype) for n in (10, 1000, 84_000, 3, 1 << 20)]
    expected = torch.nn.utils.get_total_norm(leaves, foreach=True)
    assert torch.equal(fadam.tree_global_norm(leaves), expected)
    assert torch.equal(fadam.tree_global_norm([None, *leaves[:2], None, *leaves[2:]]), expected)


def test_tree_map_keeps_none_leaves_and_paths_name_them():
    tree = _tree()
    seen = []
    fadam.tree_map(lambda leaf: seen.append(leaf is None), tree)
    assert seen == [False, False, False, True]
    assert fadam.tree_paths(tree) == ["['a']", "['b'][0]", "['b'][1][0]", "['b'][1][1]"]
    assert path_str(()) == "<root>"
    leaves, spec = tree_flatten(tree)
    assert len(leaves) == 4 and spec.unflatten(leaves)["b"].second[1] is None


def test_check_leaves_accepts_matching_trees():
    updates, like = _tree(), _tree()
    leaves, like_leaves, spec = check_leaves(updates, like)
    assert leaves[3] is None and like_leaves[0] is like["a"]
    assert spec == tree_flatten(like)[1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.update(a=torch.ones(3)),
            r"updates leaf at \['a'\]: shape \(3,\) does not match expected \(2,\) in params",
        ),
        (
            lambda t: t.update(a=[1.0, 2.0]),
            r"no leaf at \['a'\] in updates, but params has one; extra leaf at \['a'\]\[0\] in updates",
        ),
        (lambda t: t.update(a="x"), r"updates leaf at \['a'\]: expected a torch.Tensor or None, got str"),
        (
            lambda t: t.update(a=torch.ones(2, device="meta")),
            r"\['a'\]: device meta does not match expected cpu in params",
        ),
        (lambda t: t.update(a=torch.ones(2).to_sparse()), r"\['a'\]: sparse or non-strided"),
        (
            lambda t: t.pop("a"),
            r"updates do not match params: no leaf at \['a'\] in updates, but params has one \(3 leaves vs 4\)",
        ),
    ],
    ids=["shape", "structure", "non-tensor", "device", "sparse", "missing"],
)
def test_check_leaves_errors_name_the_path(change, message):
    updates = _tree()
    change(updates)
    with pytest.raises(ValueError, match=message):
        check_leaves(updates, _tree())


def test_mismatch_under_masked_node_is_named():
    """Empty nodes (masked-out leaves) have paths in messages too."""
    tree = {"a": torch.ones(1), "b": [fadam.MaskedNode(), fadam.MaskedNode()]}
    like = {"a": torch.ones(1), "b": [fadam.MaskedNode()]}
    with pytest.raises(ValueError, match=r"extra leaf at \['b'\]\[1\] in updates, not in params"):
        check_leaves(tree, like)
