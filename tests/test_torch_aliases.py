"""fadam.adadelta, asgd, rprop and adafactor_torch against torch.optim's for-loop implementations: 300 float64 steps
on both backends, params and state, their signatures and checks, and fadam.Optimizer built from them."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import fadam

STEPS = 300
# (name, alias, torch.optim class, kwargs, whether a complex leaf is in the tree)
CASES = [
    ("adadelta", fadam.adadelta, torch.optim.Adadelta, {}, True),
    (
        "adadelta-wd-max",
        fadam.adadelta,
        torch.optim.Adadelta,
        {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.1, "maximize": True},
        True,
    ),
    ("asgd", fadam.asgd, torch.optim.ASGD, {}, True),
    (
        "asgd-averaging-wd-max",
        fadam.asgd,
        torch.optim.ASGD,
        {"lr": 0.05, "lambd": 1e-3, "alpha": 0.6, "t0": 20.0, "weight_decay": 0.1, "maximize": True},
        True,
    ),
    ("rprop", fadam.rprop, torch.optim.Rprop, {}, True),
    (
        "rprop-etas-max",
        fadam.rprop,
        torch.optim.Rprop,
        {"lr": 0.05, "etas": (0.3, 1.5), "step_sizes": (1e-3, 0.2), "maximize": True},
        True,
    ),
    ("adafactor-torch", fadam.adafactor_torch, torch.optim.Adafactor, {}, False),
    (
        "adafactor-torch-wd-max",
        fadam.adafactor_torch,
        torch.optim.Adafactor,
        {"lr": 0.05, "beta2_decay": -0.5, "eps": (1e-20, 1e-2), "d": 1.5, "weight_decay": 0.1, "maximize": True},
        False,
    ),
]
STATE_TYPES = (fadam.ScaleByAdadeltaState, fadam.ScaleByAsgdState, fadam.ScaleByRpropState)
ADAFACTOR_PARTS = ("row_var", "col_var", "variance")


def _params(complex_leaf: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4, 3, generator=gen, dtype=torch.float64),
        "t": torch.randn(2, 3, 2, generator=gen, dtype=torch.float64),  # batched factored statistics (Adafactor)
        "b": torch.randn(3, generator=gen, dtype=torch.float64),
        "s": torch.tensor(2.0, dtype=torch.float64),
    }
    if complex_leaf:
        params["z"] = torch.randn(5, generator=gen, dtype=torch.complex128)
    return params


def _own_state(state: tuple) -> Any:
    """The alias's transform's state in its chain's state."""
    types = (*STATE_TYPES, fadam.ScaleByAdafactorTorchState)
    return next(s for s in state if isinstance(s, types))


def _state_errors(ours: Any, opt: torch.optim.Optimizer, refs: list[torch.Tensor], keys: list[str]) -> float:
    """The largest difference between the per-element state and torch's (Adafactor's placeholders aside)."""
    worst = 0.0
    for field in ours._fields:
        if field == "count":
            continue
        for key, ref in zip(keys, refs):
            torch_state = opt.state[ref]
            if field not in torch_state:  # a placeholder where torch keeps no such statistic
                continue
            mine = getattr(ours, field)[key]
            worst = max(worst, (mine - torch_state[field]).abs().max().item())
    return worst


@pytest.mark.parametrize("backend", ["eager", "kernel"])
@pytest.mark.parametrize(("name", "make", "cls", "kwargs", "complex_leaf"), CASES, ids=[c[0] for c in CASES])
def test_300_float64_steps_equal_torch(name, make, cls, kwargs, complex_leaf, backend):
    params = _params(complex_leaf)
    keys = list(params)
    refs = [params[k].clone() for k in keys]
    opt = cls(refs, foreach=False, **kwargs)
    tx = make(**kwargs)
    runs = {"update": (params, tx.init(params)), "step": (params, tx.init(params))}
    gen = torch.Generator().manual_seed(1)
    worst = {"update": 0.0, "step": 0.0, "state": 0.0}
    with fadam.backend(backend):
        for _ in range(STEPS):
            grads = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
            for ref, key in zip(refs, keys):
                ref.grad = grads[key].clone()
            opt.step()
            p, s = runs["update"]
            updates, s = tx.update(grads, s, p)
            runs["update"] = (fadam.apply_updates(p, updates), s)
            p, s = runs["step"]
            runs["step"] = fadam.step(tx, p, grads, s)
            for mode, (p, _) in runs.items():
                worst[mode] = max(worst[mode], *((p[k] - ref).abs().max().item() for k, ref in zip(keys, refs)))
            worst["state"] = max(worst["state"], _state_errors(_own_state(runs["step"][1]), opt, refs, keys))
    assert max(worst.values()) <= 1e-12, worst
    moved = max((runs["step"][0][k] - params[k]).abs().max().item() for k in keys)
    assert moved > 1e-3  # the trajectories went somewhere


def test_asgd_average_is_torchs_ax_and_differs_from_the_params():
    """With t0 = 3 the average starts moving on its own on step 5; before that it is the params exactly."""
    w = torch.randn(6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = w.clone()
    opt = torch.optim.ASGD([ref], foreach=False, lr=0.1, t0=3.0)
    tx = fadam.asgd(lr=0.1, t0=3.0)
    params, state = [w], tx.init([w])
    gen = torch.Generator().manual_seed(1)
    for index in range(1, 21):
        g = torch.randn(6, generator=gen, dtype=torch.float64)
        ref.grad = g.clone()
        opt.step()
        updates, state = tx.update([g], state, params)
        params = fadam.apply_updates(params, updates)
        ax = state[-1].ax[0]
        assert (ax - opt.state[ref]["ax"]).abs().max().item() <= 1e-15
        if index <= 4:
            assert torch.equal(ax, params[0])
    assert (state[-1].ax[0] - params[0]).abs().max().item() > 1e-2


def test_asgd_rounds_eta_and_mu_as_torch_stores_them():
    """torch keeps eta in float32 under the float32 default dtype: a float64 eta would differ from the 9th digit."""
    tx = fadam.scale_by_asgd(lr=0.1, lambd=0.0)
    params = [torch.ones(1, dtype=torch.float64)]
    updates, _ = tx.update([torch.ones(1, dtype=torch.float64)], tx.init(params), params)
    assert updates[0].item() == -torch.tensor(0.1, dtype=torch.float32).item()


def test_rprop_step_sizes_grow_shrink_and_clamp():
    tx = fadam.scale_by_rprop(lr=0.1, etas=(0.5, 2.0), step_sizes=(0.04, 0.3))
    state = tx.init([torch.zeros(3)])
    for g in ([1.0, 1.0, 1.0], [1.0, -1.0, 0.0], [1.0, -1.0, 1.0], [1.0, 1.0, 1.0]):
        updates, state = tx.update([torch.tensor(g)], state)
    # element 0 kept its sign: 0.1 -> 0.2 -> 0.3 (clamped) -> 0.3. Element 1 flipped: 0.1 -> 0.05, its gradient
    # zeroed, so the next comparison meets 0: 0.05; flipped again: 0.025, clamped to 0.04, and no step. Element 2 met
    # a zero gradient: 0.1 -> 0.1 -> 0.1 -> 0.2
    torch.testing.assert_close(state.step_size[0], torch.tensor([0.3, 0.04, 0.2]), rtol=0, atol=1e-7)
    torch.testing.assert_close(updates[0], torch.tensor([0.3, 0.0, 0.2]), rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("make", "cls"),
    [
        (fadam.adadelta, torch.optim.Adadelta),
        (fadam.asgd, torch.optim.ASGD),
        (fadam.rprop, torch.optim.Rprop),
        (fadam.adafactor_torch, torch.optim.Adafactor),
    ],
)
def test_signature_is_torchs_without_implementation_flags(make, cls):
    flags = {"params", "foreach", "capturable", "differentiable"}
    theirs = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if n not in flags | {"self"}}
    ours = {n: p.default for n, p in inspect.signature(make).parameters.items()}
    assert ours == theirs
    assert inspect.signature(make).parameters["maximize"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (fadam.adadelta, {"lr": -1.0}, "Invalid learning rate: -1.0"),
        (fadam.adadelta, {"rho": 1.5}, "Invalid rho value: 1.5"),
        (fadam.adadelta, {"eps": -1e-6}, "Invalid epsilon value: -1e-06"),
        (fadam.adadelta, {"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
        (fadam.asgd, {"lr": -0.1}, "Invalid learning rate: -0.1"),
        (fadam.asgd, {"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
        (fadam.rprop, {"etas": (1.5, 1.2)}, "Invalid eta values: 1.5, 1.2"),
        (fadam.rprop, {"step_sizes": (1.0, 0.5)}, "Invalid step_sizes values: 1.0, 0.5"),
        (fadam.adafactor_torch, {"lr": -1.0}, "Learning rate should be >= 0 but is: -1.0"),
        (fadam.adafactor_torch, {"beta2_decay": 0.5}, "beta2_decay should be <= 0 but is: 0.5"),
        (fadam.adafactor_torch, {"eps": (-1.0, 1e-3)}, "epsilon1 should be >= 0 but is: -1.0"),
        (fadam.adafactor_torch, {"d": 0.5}, "Clipping threshold d should be >= 1 but is: 0.5"),
        (fadam.adafactor_torch, {"weight_decay": -1.0}, "weight_decay should be >= 0 but is: -1.0"),
    ],
)
def test_bad_arguments_get_torchs_messages(make, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(**kwargs)


def test_adafactor_torch_refuses_complex_params():
    with pytest.raises(ValueError, match="Adafactor does not support complex parameters"):
        fadam.adafactor_torch().init([torch.zeros(2, dtype=torch.complex64)])


@pytest.mark.parametrize(
    ("make", "cls", "options"),
    [
        (fadam.adadelta, torch.optim.Adadelta, {"rho": 0.8, "weight_decay": 0.1}),
        (fadam.asgd, torch.optim.ASGD, {"t0": 2.0, "lambd": 1e-3}),
        (fadam.rprop, torch.optim.Rprop, {"etas": (0.4, 1.3), "maximize": True}),
        (fadam.adafactor_torch, torch.optim.Adafactor, {"eps": (None, 1e-2), "weight_decay": 0.1}),
    ],
)
def test_optimizer_built_from_the_alias_steps_as_torch(make, cls, options):
    """fadam.Optimizer reads the alias's options from its signature (tuples and a None inside one included)."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(3, 2, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)]
    ours_params = [torch.nn.Parameter(t.clone()) for t in start]
    ref_params = [torch.nn.Parameter(t.clone()) for t in start]
    ours = fadam.Optimizer(ours_params, make, lr=0.05, **options)
    ref = cls(ref_params, lr=0.05, foreach=False, **options)
    for _ in range(20):
        for a, b in zip(ours_params, ref_params):
            g = torch.randn(a.shape, generator=gen, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for a, b in zip(ours_params, ref_params):
        assert (a - b).abs().max().item() <= 1e-12
    assert ours.param_groups[0]["maximize"] is options.get("maximize", False)
