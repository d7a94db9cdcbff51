"""The dispatch rules: which tensors the fused, in-place path may take."""

from __future__ import annotations

import copy

import torch

import fadam
from fadam._dispatch import can_fuse, is_plain, plain_on_device, plain_on_fused_devices


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


def test_fused_kernels_take_contiguous_tensors_only():
    """A fused kernel walks each tensor as a flat array: a strided view or a transpose would be read and written in
    the wrong places, so every selector the fused paths ask refuses it."""
    base = torch.zeros(4, 6)
    assert can_fuse([base]) and plain_on_fused_devices([base]) and plain_on_device([base], base, False)
    for strided in (base[:, ::2], base.t(), base[:, :3]):
        assert not can_fuse([base, strided])
        assert not plain_on_fused_devices([base, strided])
        assert not plain_on_device([base, strided], base, False)
    assert can_fuse([base[1:3], base[3]])  # contiguous views of a bigger buffer
