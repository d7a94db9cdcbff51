"""The dispatch rules: which tensors the fused, in-place path may take."""

from __future__ import annotations

import copy

import pytest
import torch

import fadam
from fadam._dispatch import first_overlap, is_plain
from fadam._execute import torch_ready


def test_parameters_are_plain_only_when_autograd_does_not_track_them():
    p = torch.nn.Parameter(torch.ones(2))
    assert not is_plain(p)  # requires grad, grad mode on
    assert not torch_ready(p, torch.ones(2), [], torch.is_grad_enabled())
    with torch.no_grad():
        assert is_plain(p) and torch_ready(p, torch.ones(2), [], torch.is_grad_enabled())
    assert not is_plain(torch.ones(2).to_sparse())


def test_donating_step_updates_module_parameters_in_place_like_torch_optim():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2, fused=True)
    params = dict(model.named_parameters())
    tx = fadam.adam(lr=1e-2)
    state = tx.init(params)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(5):
        for net in (model, reference):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        with torch.no_grad():
            new_params, state = fadam.step(tx, params, {k: p.grad for k, p in params.items()}, state, donate=True)
        assert all(new_params[k] is params[k] for k in params)  # written into the module's own parameters
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name  # the same fused kernel, bit for bit


def test_fused_kernels_take_contiguous_tensors_only():
    """A fused kernel walks each tensor as a flat array: a strided view or a transpose would be read and written in
    the wrong places, so the selector refuses it, as param, gradient or state."""
    base = torch.zeros(4, 6)
    assert torch_ready(base, torch.zeros(4, 6), [torch.zeros(4, 6)], True)
    for strided in (base[:, ::2], base.t(), base[:, :3]):
        like = torch.zeros(strided.shape)
        assert not torch_ready(strided, like, [like.clone()], True)
        assert not torch_ready(like, strided, [like.clone()], True)
        assert not torch_ready(like, like.clone(), [strided], True)
    assert torch_ready(base[1:3], torch.zeros(2, 6), [base[3:]], True)  # contiguous views of a bigger buffer


@pytest.mark.parametrize(
    "case",
    [
        "one tensor at two params",
        "two tensors on one storage",
        "overlapping slices",
        "interleaved columns",
        "a gradient that is a param",
        "a state leaf that is a param",
        "a state leaf at two places",
    ],
)
def test_first_overlap_names_two_leaves_sharing_memory_where_one_is_written(case):
    w, g = torch.zeros(4, 6), torch.zeros(4, 6)
    params, grads, state = {"a": w, "b": torch.zeros(4, 6)}, {"a": g, "b": g.clone()}, {"a": torch.zeros(4, 6)}
    expected = ((0, 0), (0, 1))
    if case == "one tensor at two params":
        params["b"] = w
    elif case == "two tensors on one storage":
        params["b"] = w.detach()
    elif case == "overlapping slices":
        big = torch.zeros(6, 6)
        params = {"a": big[:4], "b": big[2:]}
    elif case == "interleaved columns":  # disjoint elements, but ranges that meet: taken as overlapping
        big = torch.zeros(4, 12)
        params = {"a": big[:, ::2], "b": big[:, 1::2]}
    elif case == "a gradient that is a param":
        grads["b"] = params["a"]
        expected = ((0, 0), (1, 1))
    elif case == "a state leaf that is a param":
        state["a"] = params["b"]
        expected = ((0, 1), (2, 0))
    else:
        state = {"a": state["a"], "b": state["a"]}
        expected = ((2, 0), (2, 1))
    assert first_overlap(params, grads, state) == expected


def test_first_overlap_allows_disjoint_views_shared_gradients_and_tensors_without_memory():
    flat = torch.zeros(100)
    params = {"a": flat[:40].view(4, 10), "b": flat[40:80].view(4, 10), "c": None, "d": 3.0}
    grads = {"a": torch.ones(40).view(4, 10)}
    grads["b"] = grads["a"]  # gradients are only read
    state = ({"a": torch.empty(4, 10, device="meta"), "b": torch.empty(4, 10, device="meta")}, flat[80:80], flat[80:])
    assert first_overlap(params, grads, state) is None


def test_first_overlap_counts_none_leaves_in_its_indices():
    w = torch.zeros(3)
    assert first_overlap({"a": None, "b": w, "c": w}, {}, ()) == ((0, 1), (0, 2))
