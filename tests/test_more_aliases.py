"""nadam, nadamw, radam, rmsprop, adagrad, adamax against torch.optim flag by flag; lion, lamb, adafactor against the
update equations of their papers, written out independently here."""

from __future__ import annotations

import math

import pytest
import torch

import fadam

STEPS = 300


def _problem(dtype: torch.dtype, complex_params: bool) -> tuple[dict, callable]:
    """Params and a gradient function: a noisy quadratic whose noise depends on the step (same for both sides)."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(5, 4, generator=gen, dtype=dtype),
        "b": torch.randn(4, generator=gen, dtype=dtype),
    }
    if complex_params:
        params["z"] = torch.randn(3, generator=gen, dtype=dtype).to(
            torch.complex128 if dtype == torch.float64 else torch.complex64
        ) * (1 + 0.5j)
    scales = {k: torch.rand(v.shape, generator=gen, dtype=dtype) + 0.5 for k, v in params.items()}
    targets = {k: 2 * torch.randn(v.shape, generator=gen, dtype=dtype).to(v.dtype) for k, v in params.items()}

    def grads(step: int, current: dict) -> dict:
        g = torch.Generator().manual_seed(1000 + step)
        out = {}
        for k, p in current.items():
            noise = torch.randn(p.shape, generator=g, dtype=dtype) * 0.1
            out[k] = scales[k] * (p - targets[k]) + noise  # minimum away from 0: errors are relative
        return out

    return params, grads


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _run_both(make, torch_cls, kwargs, dtype, complex_params=True, steps=STEPS, none_at=None):
    params, grads = _problem(dtype, complex_params)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch_cls(list(ref.values()), **kwargs)
    tx = make(**kwargs)
    state = tx.init(params)
    for step in range(steps):
        g = grads(step, params)
        if none_at is not None and step in none_at:
            g["b"] = None
        for k, p in ref.items():
            p.grad = None if g[k] is None else g[k].clone()
        opt.step()
        updates, state = tx.update(g, state, params)
        params = fadam.apply_updates(params, updates)
    return params, {k: v.detach() for k, v in ref.items()}


TORCH_CASES = [
    ("nadam", fadam.nadam, torch.optim.NAdam, {"lr": 1e-2}),
    ("nadam-wd-md", fadam.nadam, torch.optim.NAdam, {"lr": 1e-2, "weight_decay": 0.1, "momentum_decay": 1e-2}),
    (
        "nadam-decoupled-max",
        fadam.nadam,
        torch.optim.NAdam,
        {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True, "betas": (0.8, 0.99)},
    ),
    ("radam", fadam.radam, torch.optim.RAdam, {"lr": 1e-2}),
    ("radam-wd", fadam.radam, torch.optim.RAdam, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}),
    (
        "radam-decoupled-max",
        fadam.radam,
        torch.optim.RAdam,
        {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True, "betas": (0.9, 0.99)},
    ),
    ("rmsprop", fadam.rmsprop, torch.optim.RMSprop, {"lr": 1e-3}),
    ("rmsprop-alpha-wd", fadam.rmsprop, torch.optim.RMSprop, {"lr": 1e-3, "alpha": 0.9, "weight_decay": 0.1}),
    ("rmsprop-centered", fadam.rmsprop, torch.optim.RMSprop, {"lr": 1e-3, "centered": True}),
    ("rmsprop-momentum", fadam.rmsprop, torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9}),
    (
        "rmsprop-all-max",
        fadam.rmsprop,
        torch.optim.RMSprop,
        {"lr": 1e-3, "alpha": 0.95, "centered": True, "momentum": 0.5, "eps": 1e-6, "maximize": True},
    ),
    ("adagrad", fadam.adagrad, torch.optim.Adagrad, {"lr": 1e-1}),
    ("adagrad-lr-decay", fadam.adagrad, torch.optim.Adagrad, {"lr": 1e-1, "lr_decay": 1e-2}),
    (
        "adagrad-init-wd-max",
        fadam.adagrad,
        torch.optim.Adagrad,
        {"lr": 1e-1, "initial_accumulator_value": 0.5, "weight_decay": 0.1, "maximize": True, "eps": 1e-8},
    ),
    ("adamax", fadam.adamax, torch.optim.Adamax, {"lr": 1e-2}),
    (
        "adamax-wd-max",
        fadam.adamax,
        torch.optim.Adamax,
        {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.99), "maximize": True},
    ),
]


@pytest.mark.parametrize(("name", "make", "torch_cls", "kwargs"), TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["f32", "f64"])
def test_matches_torch_over_300_steps(name, make, torch_cls, kwargs, dtype, tol):
    ours, theirs = _run_both(make, torch_cls, kwargs, dtype)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype
        assert _max_rel(ours[key], theirs[key]) < tol, (key, _max_rel(ours[key], theirs[key]))


@pytest.mark.parametrize(
    ("name", "make", "torch_cls", "kwargs"), TORCH_CASES[::3], ids=[c[0] for c in TORCH_CASES[::3]]
)
def test_none_gradient_skips_like_torch(name, make, torch_cls, kwargs):
    """A None gradient at a step leaves the param and its moments alone, as torch.optim does. (fadam's single count
    still advances, so only the first steps are skipped: torch's per-param step would then differ.)"""
    ours, theirs = _run_both(make, torch_cls, kwargs, torch.float64, steps=20, none_at={0})
    # 'b' was skipped at step 0 in both: torch's step count for it lags by one, fadam's does not, so compare the rest
    for key in ("w", "z"):
        assert _max_rel(ours[key], theirs[key]) < 1e-12


def test_nadamw_is_nadam_with_decoupled_decay():
    params, grads = _problem(torch.float64, True)
    a, b = fadam.nadamw(lr=1e-2, weight_decay=0.2), fadam.nadam(lr=1e-2, weight_decay=0.2, decoupled_weight_decay=True)
    sa, sb = a.init(params), b.init(params)
    pa = pb = params
    for step in range(5):
        ua, sa = a.update(grads(step, pa), sa, pa)
        ub, sb = b.update(grads(step, pb), sb, pb)
        pa, pb = fadam.apply_updates(pa, ua), fadam.apply_updates(pb, ub)
    for key in params:
        assert torch.equal(pa[key], pb[key])


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (fadam.nadam, {"momentum_decay": -1.0}, "Invalid momentum_decay value: -1.0"),
        (fadam.nadam, {"betas": (1.0, 0.9)}, "Invalid beta parameter at index 0: 1.0"),
        (fadam.radam, {"eps": -1.0}, "Invalid epsilon value: -1.0"),
        (fadam.radam, {"lr": -0.1}, "Invalid learning rate: -0.1"),
        (fadam.rmsprop, {"alpha": -0.5}, "Invalid alpha value: -0.5"),
        (fadam.rmsprop, {"momentum": -0.5}, "Invalid momentum value: -0.5"),
        (fadam.adagrad, {"lr_decay": -1.0}, "Invalid lr_decay value: -1.0"),
        (fadam.adagrad, {"initial_accumulator_value": -1.0}, "Invalid initial_accumulator_value value: -1.0"),
        (fadam.adamax, {"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
        (fadam.lion, {"betas": (0.9, 1.5)}, "Invalid beta parameter at index 1: 1.5"),
        (fadam.lamb, {"eps": -1.0}, "Invalid epsilon value: -1.0"),
        (fadam.adafactor, {"clipping_threshold": 0.0}, "Invalid clipping_threshold value: 0.0"),
        (fadam.adafactor, {"momentum": 1.0}, "Invalid momentum value: 1.0"),
    ],
)
def test_invalid_hyperparameters_raise_naming_the_value(make, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(**kwargs)
    if make in (fadam.nadam, fadam.radam, fadam.adamax, fadam.adagrad, fadam.rmsprop) and "lr" not in kwargs:
        torch_cls = {
            fadam.nadam: torch.optim.NAdam,
            fadam.radam: torch.optim.RAdam,
            fadam.adamax: torch.optim.Adamax,
            fadam.adagrad: torch.optim.Adagrad,
            fadam.rmsprop: torch.optim.RMSprop,
        }[make]
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            torch_cls([torch.zeros(1, requires_grad=True)], **kwargs)


# --- Paper equations, written out step by step with plain tensors ---------------------------------------------------


def _lion_reference(params, grads, steps, lr, b1, b2, wd):
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    p = {k: v.clone() for k, v in params.items()}
    for t in range(steps):
        g = grads(t, p)
        for k in p:
            c = b1 * m[k] + (1 - b1) * g[k]  # Chen et al. 2023, Algorithm 2
            p[k] = p[k] - lr * (torch.sign(c) + wd * p[k])
            m[k] = b2 * m[k] + (1 - b2) * g[k]
    return p


def _lamb_reference(params, grads, steps, lr, b1, b2, eps, wd):
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v = {k: torch.zeros_like(x) for k, x in params.items()}
    p = {k: x.clone() for k, x in params.items()}
    for t in range(1, steps + 1):
        g = grads(t - 1, p)
        for k in p:  # You et al. 2020, Algorithm 2 with phi = identity
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            r = (m[k] / (1 - b1**t)) / (torch.sqrt(v[k] / (1 - b2**t)) + eps) + wd * p[k]
            ratio = torch.linalg.vector_norm(p[k]) / torch.linalg.vector_norm(r)
            p[k] = p[k] - lr * ratio * r
    return p


def _adafactor_reference(params, grads, steps, lr, d, eps1, c):
    """Shazeer & Stern 2018, Algorithm 4 (matrices, factored) and 2 (vectors), with update clipping and the
    parameter-scale multiplier (relative step): u = lr * max(eps2, RMS(p)) * clip(g / sqrt(V))."""
    state = {}
    p = {k: x.clone() for k, x in params.items()}
    for t in range(1, steps + 1):
        g = grads(t - 1, p)
        beta = 1 - t ** (-c)
        for k in p:
            sq = g[k] ** 2 + eps1
            if p[k].dim() == 2:
                r_prev, c_prev = state.get(k, (torch.zeros(p[k].shape[0]), torch.zeros(p[k].shape[1])))
                if p[k].shape[0] > p[k].shape[1]:  # optax factors over the two largest dims, largest as 'columns'
                    raise AssertionError("test shapes keep rows <= cols")
                r = beta * r_prev + (1 - beta) * sq.mean(dim=1)
                col = beta * c_prev + (1 - beta) * sq.mean(dim=0)
                state[k] = (r, col)
                v_hat = torch.outer(r, col) / r.mean()
            else:
                v_prev = state.get(k, torch.zeros_like(p[k]))
                v_hat = beta * v_prev + (1 - beta) * sq
                state[k] = v_hat
            u = g[k] / torch.sqrt(v_hat)
            rms_u = torch.sqrt((u**2).mean())
            u = u / max(1.0, float(rms_u) / d)
            scale = max(1e-3, float(torch.sqrt((p[k] ** 2).mean())))
            p[k] = p[k] - lr * scale * u
    return p


def _run_fadam(tx, params, grads, steps):
    state = tx.init(params)
    p = params
    for t in range(steps):
        u, state = tx.update(grads(t, p), state, p)
        p = fadam.apply_updates(p, u)
    return p


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_follows_the_paper(wd):
    params, grads = _problem(torch.float64, False)
    ours = _run_fadam(fadam.lion(lr=1e-3, betas=(0.9, 0.99), weight_decay=wd), params, grads, 100)
    ref = _lion_reference(params, grads, 100, 1e-3, 0.9, 0.99, wd)
    for k in ref:
        assert _max_rel(ours[k], ref[k]) < 1e-12


def test_lion_first_step_is_lr_times_sign():
    tx = fadam.lion(lr=0.5, weight_decay=0.0)
    params = [torch.zeros(3)]
    u, _ = tx.update([torch.tensor([1e-6, -3.0, 0.0])], tx.init(params), params)
    assert torch.equal(u[0], torch.tensor([-0.5, 0.5, 0.0]))


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_lamb_follows_the_paper(wd):
    params, grads = _problem(torch.float64, False)
    ours = _run_fadam(fadam.lamb(lr=1e-2, weight_decay=wd), params, grads, 100)
    ref = _lamb_reference(params, grads, 100, 1e-2, 0.9, 0.999, 1e-6, wd)
    for k in ref:
        assert _max_rel(ours[k], ref[k]) < 1e-10


def test_lamb_trust_ratio_is_one_for_zero_params():
    tx = fadam.lamb(lr=0.1)
    params = [torch.zeros(2)]
    u, _ = tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)
    assert torch.allclose(u[0], torch.tensor([-0.1, 0.1]))


def test_adafactor_follows_the_paper():
    gen = torch.Generator().manual_seed(3)
    params = {
        "w": torch.randn(3, 6, generator=gen, dtype=torch.float64),
        "b": torch.randn(6, generator=gen, dtype=torch.float64),
    }

    def grads(step, current):
        g = torch.Generator().manual_seed(step)
        return {k: v * 0.5 + torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in current.items()}

    tx = fadam.adafactor(lr=1e-2, min_dim_size_to_factor=2)
    ours = _run_fadam(tx, params, grads, 50)
    ref = _adafactor_reference(params, grads, 50, 1e-2, 1.0, 1e-30, 0.8)
    for k in ref:
        assert _max_rel(ours[k], ref[k]) < 1e-10, k
    state = tx.init(params)[0]
    assert tuple(state.v_row["w"].shape) == (3,) and tuple(state.v_col["w"].shape) == (6,)
    assert tuple(state.v["w"].shape) == (1,) and tuple(state.v["b"].shape) == (6,)


def test_adafactor_factors_the_two_largest_dims_of_a_3d_leaf():
    tx = fadam.scale_by_factored_rms(min_dim_size_to_factor=4)
    params = {"k": torch.zeros(2, 8, 5)}
    state = tx.init(params)
    assert tuple(state.v_row["k"].shape) == (2, 5) and tuple(state.v_col["k"].shape) == (2, 8)
    g = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(0))
    u, _ = tx.update({"k": g}, state, params)
    sq = g**2 + 1e-30
    row, col = sq.mean(dim=1), sq.mean(dim=2)  # first step: beta = 0
    v_hat = row.unsqueeze(1) * col.unsqueeze(2) / row.mean(dim=-1, keepdim=True).unsqueeze(1)
    assert torch.allclose(u["k"], g / v_hat.sqrt(), rtol=1e-5)


def test_adafactor_weight_decay_and_momentum_follow_optax_order():
    params = [torch.full((2,), 2.0, dtype=torch.float64)]
    g = [torch.tensor([1.0, -1.0], dtype=torch.float64)]
    tx = fadam.adafactor(lr=0.1, momentum=0.5, weight_decay_rate=0.01)
    u, _ = tx.update(g, tx.init(params), params)
    # factored rms -> [1, -1]; lr -> 0.1; param rms 2 -> 0.2; ema(0.5, no debias) -> 0.1; + 0.01 * p; negate
    assert torch.allclose(u[0], -(torch.tensor([0.1, -0.1], dtype=torch.float64) + 0.02))


def test_radam_switches_to_the_rectified_step_after_rho_exceeds_5():
    tx = fadam.scale_by_radam()
    params = [torch.zeros(1, dtype=torch.float64)]
    state = tx.init(params)
    rho_inf = 2 / (1 - 0.999) - 1
    for t in range(1, 8):
        u, state = tx.update([torch.ones(1, dtype=torch.float64)], state)
        rho_t = rho_inf - 2 * t * 0.999**t / (1 - 0.999**t)
        if rho_t <= 5:
            assert torch.allclose(u[0], torch.ones(1, dtype=torch.float64))  # plain bias-corrected momentum
        else:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            assert torch.allclose(u[0], torch.full((1,), rect / (1 + 1e-8), dtype=torch.float64), rtol=1e-6)


def test_every_new_alias_runs_under_vmap_like_a_loop():
    import tests.conformance.table  # noqa: F401  (the table collects the rows files)
    from tests.conformance.rows_aliases import ROWS

    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, 3, generator=gen), "b": torch.randn(3, 3, generator=gen)}
    grads = {"w": torch.randn(3, 4, 3, generator=gen), "b": torch.randn(3, 3, generator=gen)}
    for row in ROWS:
        tx = row.build()

        def run(p, g, tx=tx):
            state = tx.init(p)
            for _ in range(3):
                u, state = tx.update(g, state, p)
                p = fadam.apply_updates(p, u)
            return p

        batched = torch.func.vmap(run)(params, grads)
        for i in range(3):
            single = run({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in grads.items()})
            for k in params:
                torch.testing.assert_close(batched[k][i], single[k], rtol=1e-6, atol=1e-7, msg=row.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_and_update_dtypes_are_stable_including_0d_params(dtype):
    import optree

    import tests.conformance.table  # noqa: F401
    from tests.conformance.rows_aliases import ROWS

    params = {"s": torch.tensor(1.5, dtype=dtype), "w": torch.randn(3, 2).to(dtype)}
    for row in ROWS:
        tx = row.build()
        state = first = tx.init(params)
        p = params
        for _ in range(3):
            u, state = tx.update({k: torch.ones_like(v) for k, v in p.items()}, state, p)
            p = fadam.apply_updates(p, u)
        layout = [(x.dtype, x.shape) for x in optree.tree_leaves(first, none_is_leaf=True)]
        assert layout == [(x.dtype, x.shape) for x in optree.tree_leaves(state, none_is_leaf=True)], row.name
        assert all(v.dtype == dtype for v in (*u.values(), *p.values())), row.name


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.1},
        {"lr": 0.1, "lr_decay": 1e-2, "weight_decay": 0.1, "initial_accumulator_value": 0.3, "maximize": True},
    ],
    ids=["plain", "all-flags"],
)
def test_adagrad_fused_step_is_torchs_fused_kernel_bit_for_bit(kwargs):
    params, grads = _problem(torch.float32, False)
    ref = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = torch.optim.Adagrad(ref, fused=True, **kwargs)
    tx = fadam.adagrad(**kwargs)
    state = tx.init(params)
    for step in range(50):
        g = grads(step, params)
        for p, gv in zip(ref, g.values()):
            p.grad = gv.clone()
        opt.step()
        frozen = {k: v.clone() for k, v in params.items()}
        new_params, state = fadam.step(tx, params, g, state)
        assert all(torch.equal(params[k], frozen[k]) for k in params)  # donate=False: inputs untouched
        params = new_params
    for p, ours in zip(ref, params.values()):
        assert torch.equal(ours, p.detach())
    if kwargs.get("lr_decay"):
        assert int(state[-1].count) == 50  # the lr schedule's count advanced with the fused step


def test_adagrad_step_on_complex_params_takes_the_general_path():
    params, grads = _problem(torch.float64, True)
    tx = fadam.adagrad(lr=0.1)
    ref = torch.optim.Adagrad([torch.nn.Parameter(v.clone()) for v in params.values()], lr=0.1)
    state = tx.init(params)
    for step in range(20):
        g = grads(step, params)
        for p, gv in zip(ref.param_groups[0]["params"], g.values()):
            p.grad = gv.clone()
        ref.step()
        params, state = fadam.step(tx, params, g, state, donate=True)
    for p, ours in zip(ref.param_groups[0]["params"], params.values()):
        assert _max_rel(ours, p.detach()) < 1e-12
