"""Building blocks in ``fadam/transforms/`` against hand-computed values and optax's definitions, and the generated
kernel against their eager path."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import grad

import fadam

F64 = torch.float64


def _seq(n: int, shape=(5,), dtype=F64, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    source = torch.complex128 if dtype.is_complex else F64
    return [torch.randn(shape, generator=gen, dtype=source).to(dtype) for _ in range(n)]


def _run(tx, grads, params=None):
    """Feeds a list of single-tensor gradients; returns the list of updates and the final state."""
    params = [torch.zeros_like(grads[0])] if params is None else params
    state = tx.init(params)
    out = []
    for g in grads:
        updates, state = tx.update([g], state, params)
        out.append(updates[0])
    return out, state


# ----------------------------------------------------------------------------------------------------- scale_by_adam


def _adam_reference(grads, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, nesterov=False, amsgrad=False):
    """optax's scale_by_adam equations (amsgrad: torch.optim's max over raw second moments), in float64."""
    mu = torch.zeros_like(grads[0])
    nu = torch.zeros_like(grads[0])
    nu_max = torch.zeros_like(grads[0])
    out = []
    for t, g in enumerate(grads, start=1):
        mu = b1 * mu + (1 - b1) * g
        nu = b2 * nu + (1 - b2) * g * g
        nu_max = torch.maximum(nu_max, nu)
        if nesterov:
            mu_hat = b1 * mu / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        else:
            mu_hat = mu / (1 - b1**t)
        nu_hat = (nu_max if amsgrad else nu) / (1 - b2**t)
        out.append(mu_hat / (torch.sqrt(nu_hat + eps_root) + eps))
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"b1": 0.5, "b2": 0.9, "eps": 1e-3},
        {"eps_root": 1e-4},
        {"nesterov": True},
        {"amsgrad": True},
        {"nesterov": True, "amsgrad": True, "eps_root": 1e-6},
        {"b1": 0.0},
    ],
    ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "default",
)
def test_scale_by_adam_matches_optax_equations(kwargs):
    grads = _seq(20)
    grads[3] = grads[3] * 0.01  # a small gradient, so that AMSGrad's maximum differs from nu
    ours, state = _run(fadam.scale_by_adam(**kwargs), grads)
    for step, (a, b) in enumerate(zip(ours, _adam_reference(grads, **kwargs)), start=1):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15, msg=f"step {step}")
    assert int(state.count) == 20 and state.count.dtype == torch.int32
    assert isinstance(state, fadam.ScaleByAmsgradState if kwargs.get("amsgrad") else fadam.ScaleByAdamState)


def test_scale_by_adam_first_step_by_hand():
    """At step 1 the bias corrections cancel: u = g / (|g| + eps) elementwise."""
    tx = fadam.scale_by_adam(eps=0.5)
    updates, state = tx.update([torch.tensor([2.0, -0.5, 0.0], dtype=F64)], tx.init([torch.zeros(3, dtype=F64)]))
    torch.testing.assert_close(updates[0], torch.tensor([2 / 2.5, -0.5 / 1.0, 0.0], dtype=F64))
    torch.testing.assert_close(state.mu[0], torch.tensor([0.2, -0.05, 0.0], dtype=F64))
    torch.testing.assert_close(state.nu[0], torch.tensor([0.004, 0.00025, 0.0], dtype=F64))


def test_scale_by_adam_eps_root_keeps_meta_gradients_finite():
    """d update / d g at g = 0 is finite: exact with eps_root, and without it thanks to the safe square root."""
    state = fadam.scale_by_adam().init([torch.zeros(1, dtype=F64)])

    def update_of(g: torch.Tensor, eps_root: float) -> torch.Tensor:
        return fadam.scale_by_adam(eps_root=eps_root).update([g], state)[0][0].sum()

    zero = torch.zeros(1, dtype=F64)
    # without eps_root: u = g / (|g| + eps), whose derivative at 0 is 1 / eps (a plain sqrt would give NaN)
    torch.testing.assert_close(grad(update_of)(zero, 0.0), torch.tensor([1 / 1e-8], dtype=F64))
    slope = grad(update_of)(zero, 1e-8)
    # u = (g (1-b1)/(1-b1)) / (sqrt(g^2 (1-b2)/(1-b2) + eps_root) + eps) -> du/dg at 0 = 1 / (sqrt(eps_root) + eps)
    torch.testing.assert_close(slope, torch.tensor([1 / (1e-4 + 1e-8)], dtype=F64))


def test_scale_by_adam_state_dtypes():
    grads = _seq(10, dtype=torch.float32)
    tx = fadam.scale_by_adam(mu_dtype=F64, nu_dtype=torch.bfloat16)
    ours, state = _run(tx, grads)
    assert state.mu[0].dtype == F64 and state.nu[0].dtype == torch.bfloat16
    assert all(u.dtype == torch.float32 for u in ours)
    reference = _adam_reference([g.double() for g in grads])
    # nu in bf16 carries ~3 significant digits; the update's relative error follows half of nu's
    torch.testing.assert_close(ours[-1].double(), reference[-1], rtol=1e-2, atol=1e-6)
    precise, _ = _run(fadam.scale_by_adam(mu_dtype=F64, nu_dtype=F64), grads)
    torch.testing.assert_close(precise[-1].double(), reference[-1], rtol=1e-6, atol=1e-7)


def test_scale_by_adam_state_dtype_keeps_complex_params_complex():
    """A real ``mu_dtype`` for a complex param means the complex dtype of that precision (nothing is dropped)."""
    grads = _seq(5, dtype=torch.complex64)
    ours, state = _run(fadam.scale_by_adam(mu_dtype=F64, nu_dtype=F64, amsgrad=True), grads)
    assert state.mu[0].dtype == state.nu[0].dtype == state.nu_max[0].dtype == torch.complex128
    default, _ = _run(fadam.scale_by_adam(amsgrad=True), grads)
    torch.testing.assert_close(ours[-1], default[-1], rtol=1e-5, atol=1e-6)
    assert ours[-1].dtype == torch.complex64 and ours[-1].imag.abs().max() > 0.1


def test_trace_accumulator_dtype_keeps_complex_params_complex():
    grads = _seq(4, dtype=torch.complex64)
    ours, state = _run(fadam.trace(0.9, accumulator_dtype=F64), grads)
    assert state.trace[0].dtype == torch.complex128
    torch.testing.assert_close(ours[-1], _run(fadam.trace(0.9), grads)[0][-1])


def test_scale_by_adam_none_gradient_skips_leaf():
    tx = fadam.scale_by_adam()
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    state = tx.init(params)
    _, state = tx.update({"a": torch.ones(2), "b": torch.ones(2)}, state)
    updates, new_state = tx.update({"a": torch.ones(2), "b": None}, state)
    assert updates["b"] is None
    assert new_state.mu["b"] is state.mu["b"] and new_state.nu["b"] is state.nu["b"]
    assert not torch.equal(new_state.mu["a"], state.mu["a"])


# ------------------------------------------------------------------------------------------------------------ trace


def test_trace_by_hand():
    g1, g2, g3 = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([-1.0])
    ours, state = _run(fadam.trace(0.5), [g1, g2, g3])
    # t1 = 1, t2 = 0.5 + 2 = 2.5, t3 = 1.25 - 1 = 0.25 (optax's trace; torch's buffer on step 1 is g1 too)
    assert [float(u) for u in ours] == [1.0, 2.5, 0.25]
    assert int(state.count) == 3
    nesterov, _ = _run(fadam.trace(0.5, nesterov=True), [g1, g2, g3])
    assert [float(u) for u in nesterov] == [1.5, 3.25, -0.875]  # g + 0.5 t
    damped, _ = _run(fadam.trace(0.5, dampening=0.5), [g1, g2, g3])
    # torch.optim.SGD: the first buffer is g1, undamped; then 0.5 t + 0.5 g
    assert [float(u) for u in damped] == [1.0, 1.5, 0.25]


def test_trace_matches_optax_definition_over_many_steps():
    grads = _seq(30)
    ours, _ = _run(fadam.trace(0.9, nesterov=True), grads)
    t = torch.zeros(5, dtype=F64)
    for g, u in zip(grads, ours):
        t = g + 0.9 * t
        torch.testing.assert_close(u, g + 0.9 * t, rtol=1e-14, atol=1e-15)


# ------------------------------------------------------------------------------------------------------- clipping


def test_clip_by_hand():
    updates, _ = fadam.clip(1.5).update({"a": torch.tensor([-3.0, 1.0, 2.0]), "b": None}, fadam.EmptyState())
    assert updates["a"].tolist() == [-1.5, 1.0, 1.5] and updates["b"] is None
    tensor_bound, _ = fadam.clip(torch.tensor(0.5)).update([torch.tensor([-1.0, 0.25])], fadam.EmptyState())
    assert tensor_bound[0].tolist() == [-0.5, 0.25]


def test_clip_by_global_norm_by_hand():
    tx = fadam.clip_by_global_norm(1.0)
    updates = {"a": torch.tensor([3.0, 4.0], dtype=F64), "b": torch.tensor([[12.0]], dtype=F64), "c": None}
    clipped, _ = tx.update(updates, tx.init(None))  # global norm 13
    torch.testing.assert_close(clipped["a"], torch.tensor([3 / 13, 4 / 13], dtype=F64))
    torch.testing.assert_close(clipped["b"], torch.tensor([[12 / 13]], dtype=F64))
    assert clipped["c"] is None
    kept, _ = fadam.clip_by_global_norm(20.0).update(updates, fadam.EmptyState())
    assert torch.equal(kept["a"], updates["a"]) and torch.equal(kept["b"], updates["b"])


def test_clip_by_global_norm_counts_complex_by_modulus():
    clipped, _ = fadam.clip_by_global_norm(1.0).update([torch.tensor([3 + 4j])], fadam.EmptyState())
    torch.testing.assert_close(clipped[0], torch.tensor([0.6 + 0.8j]))


# ----------------------------------------------------------------------------------------------------------- decay


def test_add_decayed_weights_by_hand():
    params = {"w": torch.tensor([2.0, -4.0]), "b": torch.tensor([1.0])}
    updates = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.5])}
    out, _ = fadam.add_decayed_weights(0.5).update(updates, fadam.EmptyState(), params)
    assert out["w"].tolist() == [2.0, -1.0] and out["b"].tolist() == [1.0]
    out, _ = fadam.add_decayed_weights(torch.tensor(0.5)).update(updates, fadam.EmptyState(), params)
    assert out["w"].tolist() == [2.0, -1.0]


@pytest.mark.parametrize(
    "mask",
    [{"w": True, "b": False}, lambda params: {k: v.ndim > 0 and v.numel() > 1 for k, v in params.items()}],
    ids=["bool-tree", "callable"],
)
def test_add_decayed_weights_with_mask(mask):
    params = {"w": torch.tensor([2.0, -4.0]), "b": torch.tensor([1.0])}
    updates = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.5])}
    tx = fadam.add_decayed_weights(0.5, mask=mask)
    out, _ = tx.update(updates, tx.init(params), params)
    assert out["w"].tolist() == [2.0, -1.0]
    assert out["b"] is updates["b"]  # not selected: passed through untouched


def test_add_decoupled_weight_decay_rounds_like_torch_adamw():
    """p + u == torch's ``p.mul_(1 - lr * wd)`` then ``p.add_(g)``, bit for bit in float32."""
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen) * 1e-3
    out, _ = fadam.add_decoupled_weight_decay(1e-3, 1e-2).update([g], fadam.EmptyState(), [p])
    assert torch.equal(p + out[0], p.clone().mul_(1 - 1e-3 * 1e-2).add_(g))


def test_add_decoupled_weight_decay_schedule_reads_count():
    tx = fadam.add_decoupled_weight_decay(lambda count: 0.1 * (count.to(F64) + 1), 0.5)
    params = [torch.ones(1, dtype=F64)]
    state = tx.init(params)
    out1, state = tx.update([torch.zeros(1, dtype=F64)], state, params)
    out2, state = tx.update([torch.zeros(1, dtype=F64)], state, params)
    torch.testing.assert_close(out1[0], torch.tensor([-0.05], dtype=F64))  # lr 0.1 at count 0
    torch.testing.assert_close(out2[0], torch.tensor([-0.1], dtype=F64))  # lr 0.2 at count 1
    assert int(state.count) == 2


# --------------------------------------------------------------------------------------------------------- scaling


def test_scale_and_schedule():
    assert fadam.scale(-2.0).update([torch.tensor([1.5])], fadam.EmptyState())[0][0].tolist() == [-3.0]
    tx = fadam.scale_by_schedule(lambda count: 1.0 / (count + 1))
    out, state = _run(tx, [torch.ones(1)] * 4)
    torch.testing.assert_close(torch.cat(out), torch.tensor([1.0, 0.5, 1 / 3, 0.25]))
    assert int(state.count) == 4


@pytest.mark.parametrize(
    ("learning_rate", "expected"),
    [
        (0.1, [-0.1, -0.1, -0.1]),
        (torch.tensor(0.1, dtype=F64), [-0.1, -0.1, -0.1]),
        (lambda count: 0.1 * 0.5 ** count.to(F64), [-0.1, -0.05, -0.025]),
    ],
    ids=["float", "tensor", "schedule"],
)
def test_scale_by_learning_rate(learning_rate, expected):
    out, _ = _run(fadam.scale_by_learning_rate(learning_rate), [torch.ones(1, dtype=F64)] * 3)
    torch.testing.assert_close(torch.cat(out), torch.tensor(expected, dtype=F64))
    ascent, _ = _run(fadam.scale_by_learning_rate(learning_rate, flip_sign=False), [torch.ones(1, dtype=F64)] * 3)
    torch.testing.assert_close(torch.cat(ascent), -torch.tensor(expected, dtype=F64))


def test_tensor_learning_rate_carries_gradient():
    """A 0-d lr that requires grad stays in the graph: d(update)/d(lr) = -g."""
    lr = torch.tensor(0.1, requires_grad=True)
    out, _ = fadam.scale_by_learning_rate(lr).update([torch.tensor([2.0, 3.0])], fadam.EmptyState())
    out[0].sum().backward()
    assert float(lr.grad) == -5.0


# ------------------------------------------------------------------------------------------------------------ sign


def _sign(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


def test_scale_by_sign_and_signum_follow_their_equations():
    """20 float64 steps: ``scale_by_sign`` gives sign(g) (0 for a zero); ``signum`` keeps m = beta m + (1 - beta) g
    and steps p - lr sign(m), optax's order (the average is taken before the sign)."""
    grads = _seq(20)
    for g in grads[::3]:
        g[1] = 0.0
    signs, state = _run(fadam.scale_by_sign(), grads)
    assert state == fadam.EmptyState()
    for step, (u, g) in enumerate(zip(signs, grads), start=1):
        assert u.dtype == F64 and torch.equal(u, _sign(g)), f"step {step}"

    lr, beta = 0.05, 0.8
    tx = fadam.signum(lr, beta=beta)
    params = [torch.linspace(-1.0, 1.0, 5, dtype=F64)]
    state = tx.init(params)
    p, m = params[0].clone(), torch.zeros(5, dtype=F64)
    for step, g in enumerate(grads, start=1):
        updates, state = tx.update([g], state, params)
        params = fadam.apply_updates(params, updates)
        m = beta * m + (1 - beta) * g
        p = p - lr * _sign(m)
        torch.testing.assert_close(state[0].ema[0], m, rtol=1e-14, atol=1e-16, msg=f"step {step}")
        torch.testing.assert_close(params[0], p, rtol=1e-15, atol=0.0, msg=f"step {step}")
    assert int(state[0].count) == 20


def test_sign_of_a_complex_leaf_is_taken_per_component():
    g = torch.tensor([complex(-0.5, 2.0), complex(0.0, 0.0), complex(3.0, -1e-30)])
    u, _ = fadam.scale_by_sign().update([g], fadam.EmptyState())
    assert torch.equal(u[0], torch.tensor([complex(-1.0, 1.0), complex(0.0, 0.0), complex(1.0, -1.0)]))


def test_sign_sgd_is_lr_times_the_sign():
    params = {"w": torch.tensor([1.0, 2.0, 3.0])}
    tx = fadam.sign_sgd(0.5)
    u, _ = tx.update({"w": torch.tensor([1e-6, -3.0, 2.0])}, tx.init(params), params)
    assert torch.equal(u["w"], torch.tensor([-0.5, 0.5, -0.5]))


# ---------------------------------------------------------------------------------------------- generated kernel

_lr = fadam.scale_by_learning_rate

# declared transforms and the aliases built from them; fadam.backend("kernel") keeps torch's fused adagrad out
KERNEL_PROGRAMS = {
    "scale_by_sign": lambda: fadam.chain(fadam.scale_by_sign(), _lr(1e-2)),
    "sign_sgd": lambda: fadam.sign_sgd(1e-2),
    "signum": lambda: fadam.signum(1e-2),
    "ema": lambda: fadam.chain(fadam.ema(0.9), _lr(1e-2)),
    "rmsprop": lambda: fadam.rmsprop(1e-2),
    "rmsprop-centered-momentum": lambda: fadam.rmsprop(1e-3, centered=True, momentum=0.9, weight_decay=0.1),
    "adagrad": lambda: fadam.adagrad(1e-1, lr_decay=1e-3, initial_accumulator_value=0.1),
    "adamax": lambda: fadam.adamax(1e-2, weight_decay=0.1),
    "radam": lambda: fadam.radam(1e-2),
    # rho_t crosses 4.5 at step 5: the steps before are plain momentum, the steps after rectified
    "radam-rectifying": lambda: fadam.chain(fadam.scale_by_radam(b2=0.9, threshold=4.5), _lr(1e-2)),
}


def _kernel_params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    complex_dtype = torch.complex64 if dtype == torch.float32 else torch.complex128
    return {
        "big": torch.randn(70_001, generator=gen, dtype=dtype),  # vector and chunk tails
        "matrix": torch.randn(3, 5, generator=gen, dtype=dtype),
        "complex": torch.randn(17, generator=gen, dtype=complex_dtype),
    }


_EDGES = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40, -1e-300, 1e30]


def _kernel_grads(params: dict, step: int, edges: bool) -> dict:
    """Magnitudes from 1e-6 to 1e3 with zeros; with ``edges``, infinities, NaN, signed zeros and subnormals."""
    gen = torch.Generator().manual_seed(step)

    def leaf(p: torch.Tensor) -> torch.Tensor:
        real = torch.view_as_real(p) if p.is_complex() else p
        g = torch.randn(real.shape, generator=gen, dtype=real.dtype)
        g = g * 10.0 ** torch.randint(-6, 4, real.shape, generator=gen).to(real.dtype)
        flat = g.view(-1)
        flat[step % 7 :: 7] = 0.0
        if edges:
            for k, value in enumerate(_EDGES):
                flat[k :: len(_EDGES) + 2] = value
        return torch.view_as_complex(g) if p.is_complex() else g

    return {k: leaf(p) for k, p in params.items()}


def _bit_mismatches(a, b) -> list:
    """The paths of the leaves whose dtypes or bits differ (a zero's sign counts; every NaN is one NaN)."""
    integers = {torch.float32: torch.int32, torch.float64: torch.int64}

    def bits(t: torch.Tensor) -> torch.Tensor:
        t = torch.view_as_real(t) if t.is_complex() else t
        if t.dtype not in integers:
            return t
        return torch.where(t.isnan(), float("nan"), t).view(integers[t.dtype])

    assert fadam.tree_paths(a) == fadam.tree_paths(b)
    return [
        path
        for path, x, y in zip(fadam.tree_paths(a), fadam._tree.tree_leaves(a), fadam._tree.tree_leaves(b))
        if x.dtype != y.dtype or not torch.equal(bits(x), bits(y))
    ]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(KERNEL_PROGRAMS))
def test_the_generated_kernel_equals_the_eager_path_bit_for_bit(name, dtype, monkeypatch):
    """8 donated steps on the generated kernel against the eager path (``fadam.backend("eager")``), params and state
    compared bit for bit after every step; the last step's gradients hold infinities, NaN and signed zeros."""
    from fadam import _cpu_kernel

    runs = []
    run = _cpu_kernel.Kernel.run
    monkeypatch.setattr(
        _cpu_kernel.Kernel, "run", lambda self, leaves, *rest: runs.append(len(leaves)) or run(self, leaves, *rest)
    )
    tx = KERNEL_PROGRAMS[name]()
    params = _kernel_params(dtype)
    with fadam.backend("kernel"):  # the generated kernel, also for a chain of torch's fused kernels (adagrad)
        assert (
            fadam.explain(tx, params)
            .splitlines()[-1]
            .endswith("generated CPU kernel: ['big'], ['complex'], ['matrix']")
        )
    eager = (params, tx.init(params))
    kernel = fadam.tree_map(torch.clone, eager)
    steps = 8
    for step in range(steps):
        grads = _kernel_grads(params, step, edges=step == steps - 1)
        with fadam.backend("eager"):
            updates, state = tx.update(grads, eager[1], eager[0])
        eager = (fadam.apply_updates(eager[0], updates), state)
        with fadam.backend("kernel"):
            kernel = fadam.step(tx, kernel[0], grads, kernel[1], donate=True)
        assert _bit_mismatches(kernel, eager) == [], f"step {step}"
    assert runs == [3] * steps  # every step ran the kernel on the three leaves
    nan = any(t.isnan().any() for t in fadam._tree.tree_leaves(eager))
    assert nan != name.startswith(("scale_by_sign", "sign_sgd"))  # the sign of NaN is 0: the others carry NaN on


# ------------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("factory", "named"),
    [
        (lambda: fadam.scale_by_adam(b1=1.0), "b1"),
        (lambda: fadam.scale_by_adam(b2=-0.1), "b2"),
        (lambda: fadam.scale_by_adam(eps=-1e-8), "eps"),
        (lambda: fadam.scale_by_adam(eps_root=-1.0), "eps_root"),
        (lambda: fadam.scale_by_adam(b1=math.nan), "b1"),
        (lambda: fadam.trace(-0.5), "momentum: -0.5"),
        (lambda: fadam.trace(0.0, nesterov=True), "Nesterov"),
        (lambda: fadam.trace(0.9, dampening=-1.0), "dampening"),
        (lambda: fadam.clip(-1.0), "max_delta"),
        (lambda: fadam.clip_by_global_norm(-1.0), "max_norm"),
        (lambda: fadam.add_decayed_weights(-0.1), "weight_decay"),
        (lambda: fadam.add_decayed_weights(torch.tensor([0.1, 0.2])), "1-element"),
        (lambda: fadam.add_decoupled_weight_decay(0.1, -1.0), "weight_decay"),
        (lambda: fadam.scale_by_learning_rate(-0.1), "learning rate: -0.1"),
        (lambda: fadam.sign_sgd(-0.1), "Invalid learning rate: -0.1"),
        (lambda: fadam.signum(0.1, beta=1.0), "beta: 1.0"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(factory, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        factory()
