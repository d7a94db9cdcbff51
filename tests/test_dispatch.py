"""The dispatch rules: which tensors the fused, in-place path may take."""

from __future__ import annotations

import copy

import torch

import fadam
from fadam._dispatch import can_fuse, is_plain


def test_parameters_are_plain_only_when_autograd_does_not_track_them():
    p = torch.nn.Parameter(torch.ones(2))
    assert not is_plain(p)  # requires grad, grad mode on
    with torch.no_grad():
        assert is_plain(p) and can_fuse([p])
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
