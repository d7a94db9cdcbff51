"""``adam``, ``adamw`` and ``sgd`` against torch.optim's for-loop implementation (``foreach=False``).

Every alias and flag combination is fed the same fixed sequence of gradients and compared after every step, through
the three ways of running a step: ``tx.update`` + ``apply_updates``, ``fadam.step`` (fused kernels when the tensors
allow) and ``fadam.step(donate=True)``. Errors are normwise relative errors (see ``tests.tree_checks.rel_err``).
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import fadam
from tests.tree_checks import max_rel_err, rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.complex64: 1e-5, torch.complex128: 1e-12}
STEPS = 300
SHAPES = {"w": (7, 5), "b": (5,), "s": ()}

ADAM_FLAGS = list(itertools.product([False, True], [False, True], [0.0, 0.1]))  # amsgrad, maximize, weight_decay
SGD_FLAGS = [
    (momentum, dampening, nesterov, maximize, weight_decay)
    for momentum, dampening, nesterov, maximize, weight_decay in itertools.product(
        [0.0, 0.9], [0.0, 0.3], [False, True], [False, True], [0.0, 0.1]
    )
    if not (nesterov and (momentum == 0 or dampening != 0))  # torch.optim.SGD rejects these
]


def _cases() -> list:
    cases = []
    for name, make, cls in (("adam", fadam.adam, torch.optim.Adam), ("adamw", fadam.adamw, torch.optim.AdamW)):
        for amsgrad, maximize, wd in ADAM_FLAGS:
            kwargs = {"lr": 1e-2, "amsgrad": amsgrad, "maximize": maximize, "weight_decay": wd}
            cases.append(pytest.param(make, cls, kwargs, id=f"{name}-ams{int(amsgrad)}-max{int(maximize)}-wd{wd}"))
    for momentum, dampening, nesterov, maximize, wd in SGD_FLAGS:
        kwargs = {
            "lr": 1e-2,
            "momentum": momentum,
            "dampening": dampening,
            "nesterov": nesterov,
            "maximize": maximize,
            "weight_decay": wd,
        }
        ident = f"sgd-m{momentum}-d{dampening}-n{int(nesterov)}-max{int(maximize)}-wd{wd}"
        cases.append(pytest.param(fadam.sgd, torch.optim.SGD, kwargs, id=ident))
    return cases


def _problem(dtype: torch.dtype, maximize: bool, steps: int = STEPS) -> tuple[dict, list[dict]]:
    """Initial params and a fixed gradient sequence.

    The 0-d leaf gets gradients with a mean of -3 (+3 when maximizing) so that it drifts away from zero: a single
    element has no norm to be relative to, and near zero any two correct implementations differ relatively.
    """
    gen = torch.Generator().manual_seed(1234)
    params = {k: torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for k, shape in SHAPES.items()}
    params["s"] = torch.tensor(10.0, dtype=dtype)
    drift = 3.0 if maximize else -3.0
    grads = []
    for _ in range(steps):
        g = {k: torch.randn(shape, generator=gen, dtype=torch.float64) for k, shape in SHAPES.items()}
        g["s"] = g["s"] + drift
        grads.append({k: v.to(dtype) for k, v in g.items()})
    return params, grads


def _trajectory_errors(trajectory: list[dict], reference: list[dict]) -> tuple[float, int, str]:
    """Worst normwise relative error over all steps and leaves, with the step and leaf where it occurs."""
    worst, at, where = 0.0, -1, ""
    for key in reference[0]:
        a = torch.stack([p[key].reshape(-1) for p in trajectory]).double()
        b = torch.stack([p[key].reshape(-1) for p in reference]).double()
        errors = (a - b).abs().amax(dim=1) / b.abs().amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        step = int(errors.argmax())
        if not float(errors[step]) <= worst:
            worst, at, where = float(errors[step]), step + 1, key
    return worst, at, where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), _cases())
def test_parity_with_torch_every_step(make, torch_cls, kwargs, dtype):
    params, grads = _problem(dtype, kwargs["maximize"])
    torch_params = {k: v.clone() for k, v in params.items()}
    opt = torch_cls(list(torch_params.values()), foreach=False, **kwargs)
    tx = make(**kwargs)
    p_update, s_update = params, tx.init(params)
    p_step, s_step = params, tx.init(params)
    p_donate = {k: v.clone() for k, v in params.items()}
    s_donate = tx.init(p_donate)
    runs: dict[str, list[dict]] = {"torch": [], "update": [], "step": [], "step-donate": []}
    for g in grads:
        for k, p in torch_params.items():
            p.grad = g[k].clone()
        opt.step()
        updates, s_update = tx.update(g, s_update, p_update)
        p_update = fadam.apply_updates(p_update, updates)
        p_step, s_step = fadam.step(tx, p_step, g, s_step)
        p_donate, s_donate = fadam.step(tx, p_donate, g, s_donate, donate=True)
        runs["torch"].append({k: v.detach().clone() for k, v in torch_params.items()})
        runs["update"].append(p_update)
        runs["step"].append(p_step)
        runs["step-donate"].append({k: v.clone() for k, v in p_donate.items()})
    for path in ("update", "step", "step-donate"):
        err, at, where = _trajectory_errors(runs[path], runs["torch"])
        assert err <= TOL[dtype], f"{path}: relative error {err:.2e} at step {at}, leaf {where!r}"
        assert all(p[k].dtype == dtype for p in runs[path][-1:] for k in p)
    # the run moved the params far beyond the tolerance, so agreeing is not trivially true
    assert rel_err(runs["torch"][-1]["w"], params["w"]) > 1e3 * TOL[dtype]


def test_parity_metric_is_strict():
    """The tolerance catches a subtle deviation from torch's formula: bias corrections one step ahead."""
    params, grads = _problem(torch.float32, maximize=False, steps=STEPS)
    tx = fadam.adam(lr=1e-2)
    ref = {k: v.clone() for k, v in params.items()}
    opt = torch.optim.Adam(list(ref.values()), lr=1e-2, foreach=False)
    adam_state, lr_state = tx.init(params)
    state = (adam_state._replace(count=torch.ones([], dtype=torch.int32)), lr_state)
    worst = 0.0
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
        updates, state = tx.update(g, state, params)
        params = fadam.apply_updates(params, updates)
        worst = max(worst, max_rel_err(params, ref)[0])
    assert worst > 100 * TOL[torch.float32]


# ----------------------------------------------------------------------------------------------------- real models


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


MODEL_ALIASES = [
    pytest.param(fadam.adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}, id="adam"),
    pytest.param(fadam.adamw, torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}, id="adamw-amsgrad"),
    pytest.param(fadam.sgd, torch.optim.SGD, {"lr": 2e-2, "momentum": 0.9, "nesterov": True}, id="sgd-nesterov"),
]


@pytest.mark.parametrize(("model_cls", "x_shape"), [(_MLP, (32, 6)), (_ConvNet, (16, 1, 8, 8))], ids=["mlp", "conv"])
@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), MODEL_ALIASES)
def test_training_real_model_matches_torch(model_cls, x_shape, make, torch_cls, kwargs):
    torch.manual_seed(0)
    model = model_cls().double()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(x_shape, generator=gen, dtype=torch.float64)
    y = torch.sin(x.flatten(1).sum(1, keepdim=True))

    def loss_fn(params: dict) -> torch.Tensor:
        return F.mse_loss(functional_call(model, params, (x,)), y)

    grad_fn = torch.func.grad(loss_fn)
    opt = torch_cls(reference.parameters(), foreach=False, **kwargs)
    tx = make(**kwargs)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    first_loss = float(loss_fn(params))
    for step in range(200):
        opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        opt.step()
        updates, state = tx.update(grad_fn(params), state, params)
        params = fadam.apply_updates(params, updates)
        err, where = max_rel_err(params, dict(reference.named_parameters()))
        assert err <= 1e-12, f"step {step + 1}: relative error {err:.2e} at {where}"
    assert float(loss_fn(params)) < 0.5 * first_loss  # it trained


# ------------------------------------------------------------------------------------------- complex, dtypes, lr


COMPLEX_ALIASES = [
    pytest.param(fadam.adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}, id="adam"),
    pytest.param(fadam.adamw, torch.optim.AdamW, {"lr": 1e-2, "maximize": True}, id="adamw"),
    pytest.param(fadam.sgd, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}, id="sgd"),
]


def _run_against_torch(make, torch_cls, kwargs, params, grads, tol, foreach=False):
    """Runs all three fadam paths and torch.optim on the same gradients; asserts ``tol`` after every step."""
    ref = {k: v.clone() for k, v in params.items()}
    opt = torch_cls(list(ref.values()), foreach=foreach, **kwargs)
    tx = make(**kwargs)
    paths = {"update": (params, tx.init(params)), "step": (params, tx.init(params))}
    donated = {k: v.clone() for k, v in params.items()}
    paths["step-donate"] = (donated, tx.init(donated))
    for index, g in enumerate(grads):
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
        p, s = paths["update"]
        updates, s = tx.update(g, s, p)
        paths["update"] = (fadam.apply_updates(p, updates), s)
        p, s = paths["step"]
        paths["step"] = fadam.step(tx, p, g, s)
        p, s = paths["step-donate"]
        paths["step-donate"] = fadam.step(tx, p, g, s, donate=True)
        for path, (p, _) in paths.items():
            for k in ref:
                assert p[k].dtype == ref[k].dtype, f"{path} {k}: dtype {p[k].dtype}"
                err = rel_err(p[k], ref[k])
                assert err <= tol(k), f"{path}, step {index + 1}, leaf {k!r}: relative error {err:.2e}"
    return {path: p for path, (p, _) in paths.items()}, ref


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=["c64", "c128"])
@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), COMPLEX_ALIASES)
def test_complex_params_match_torch(make, torch_cls, kwargs, dtype):
    """torch.optim treats a complex param as ``view_as_real`` pairs: moments per real and imaginary component."""
    gen = torch.Generator().manual_seed(3)
    real_dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    params = {"z": torch.randn(4, 3, generator=gen, dtype=dtype), "r": torch.randn(6, generator=gen).to(real_dtype)}
    grads = [
        {"z": torch.randn(4, 3, generator=gen, dtype=dtype), "r": torch.randn(6, generator=gen).to(real_dtype)}
        for _ in range(100)
    ]
    final, _ = _run_against_torch(make, torch_cls, kwargs, params, grads, lambda k: TOL[dtype])
    assert final["update"]["z"].dtype == dtype


def test_complex_adam_keeps_moments_per_component():
    """Not |g|^2 per complex element: the second moment of 3+4j is (9, 16) per component, as torch.optim keeps it."""
    tx = fadam.scale_by_adam(b1=0.0, b2=0.0)
    state = tx.init([torch.zeros(1, dtype=torch.complex64)])
    updates, state = tx.update([torch.tensor([3 + 4j], dtype=torch.complex64)], state)
    torch.testing.assert_close(state.nu[0], torch.tensor([9 + 16j], dtype=torch.complex64))
    torch.testing.assert_close(updates[0], torch.tensor([1 + 1j], dtype=torch.complex64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("make", "torch_cls", "kwargs"),
    [
        pytest.param(fadam.adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}, id="adam"),
        pytest.param(fadam.adamw, torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}, id="adamw"),
        pytest.param(fadam.sgd, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1}, id="sgd"),
    ],
)
def test_low_precision_params_match_torch(make, torch_cls, kwargs, dtype):
    """bf16/f16 params, state in the param's dtype, as torch.optim keeps it.

    The pure path rounds every intermediate to the low dtype, like torch's for-loop, in a slightly different order of
    operations. Tolerance: two units in the last place at the largest param's magnitude (``2 * eps`` normwise) after
    100 steps. For scale, torch's own fused kernel (fp32 math, one rounding) drifts from its for-loop by 2.7e-3
    (Adam, bf16) up to 0.25 (SGD with momentum, bf16: updates near half an ulp of the param round either way);
    the pure path stays within 7.4e-3 (bf16) and 6.6e-4 (f16) of the for-loop. ``fadam.step`` runs torch's fused
    kernel and must equal ``torch.optim(fused=True)`` bit for bit.
    """
    gen = torch.Generator().manual_seed(5)
    params = {"w": (torch.randn(64, generator=gen) + 3).to(dtype), "b": (torch.randn(8, generator=gen) - 3).to(dtype)}
    grads = [{k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()} for _ in range(100)]
    loop = {k: v.clone() for k, v in params.items()}
    fused = {k: v.clone() for k, v in params.items()}
    opt_loop = torch_cls(list(loop.values()), foreach=False, **kwargs)
    opt_fused = torch_cls(list(fused.values()), fused=True, **kwargs)
    tx = make(**kwargs)
    pure, pure_state = params, tx.init(params)
    stepped, step_state = params, tx.init(params)
    worst = 0.0
    for g in grads:
        for k in params:
            loop[k].grad, fused[k].grad = g[k].clone(), g[k].clone()
        opt_loop.step()
        opt_fused.step()
        updates, pure_state = tx.update(g, pure_state, pure)
        pure = fadam.apply_updates(pure, updates)
        stepped, step_state = fadam.step(tx, stepped, g, step_state)
        for k in params:
            assert torch.equal(stepped[k], fused[k]), f"fused step differs from torch fused at {k!r}"
            assert pure[k].dtype == dtype
        worst = max(worst, max_rel_err(pure, loop)[0])
    assert worst <= 2 * torch.finfo(dtype).eps, f"pure path {worst:.2e} from torch's for-loop"


@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), COMPLEX_ALIASES)
def test_tree_mixing_dtypes_matches_torch(make, torch_cls, kwargs):
    gen = torch.Generator().manual_seed(11)
    shapes = {"f32": ((5, 3), torch.float32), "f64": ((4,), torch.float64), "c128": ((3,), torch.complex128)}
    params = {k: torch.randn(shape, generator=gen, dtype=dtype) + 2 for k, (shape, dtype) in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=d) for k, (s, d) in shapes.items()} for _ in range(100)]
    tol = {"f32": TOL[torch.float32], "f64": TOL[torch.float64], "c128": TOL[torch.complex128]}
    _run_against_torch(make, torch_cls, kwargs, params, grads, tol.__getitem__)


LR_ALIASES = [
    pytest.param(fadam.adam, torch.optim.Adam, {"amsgrad": True}, id="adam"),
    pytest.param(fadam.adamw, torch.optim.AdamW, {"weight_decay": 0.1}, id="adamw"),
    pytest.param(fadam.sgd, torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}, id="sgd"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), LR_ALIASES)
def test_tensor_learning_rate_matches_torch(make, torch_cls, kwargs, dtype):
    params, grads = _problem(dtype, maximize=False, steps=100)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    _run_against_torch(make, torch_cls, {**kwargs, "lr": lr}, params, grads, lambda k: TOL[dtype])
    assert float(lr) == 1e-2  # the tensor lr itself is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), LR_ALIASES)
def test_schedule_learning_rate_matches_torch_with_lr_set_each_step(make, torch_cls, kwargs, dtype):
    """A schedule is read at the step count before the step (0, 1, 2, ...): torch with ``group['lr']`` set likewise."""

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return 2e-2 * 0.99 ** count.to(torch.float64)

    params, grads = _problem(dtype, maximize=False, steps=100)
    ref = {k: v.clone() for k, v in params.items()}
    opt = torch_cls(list(ref.values()), lr=1.0, foreach=False, **kwargs)
    tx = make(lr=schedule, **kwargs)
    state = tx.init(params)
    stepped, step_state = params, tx.init(params)
    for index, g in enumerate(grads):
        opt.param_groups[0]["lr"] = float(schedule(torch.tensor(index, dtype=torch.int32)))
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
        updates, state = tx.update(g, state, params)
        params = fadam.apply_updates(params, updates)
        stepped, step_state = fadam.step(tx, stepped, g, step_state)
        for run in (params, stepped):
            err, where = max_rel_err(run, ref)
            assert err <= TOL[dtype], f"step {index + 1}: {err:.2e} at {where}"


# ------------------------------------------------------------------------------------------ invalid hyperparameters


T = torch.tensor
# every check in the eight torch.optim constructors fadam mirrors, one case each, and cases where two arguments are
# bad, which torch reports in its order. Not covered: Adam's and AdamW's checks on foreach/capturable (fadam's
# aliases have no such arguments) and their "Tensor betas[i] must be 1-element", which torch never reaches (its range
# check on a multi-element tensor raises "Boolean value of Tensor ... is ambiguous" first; fadam raises a
# RuntimeError there too). fadam refuses a NaN lr, momentum or weight_decay for SGD as well, which torch accepts.
LR_CHECKS = [{"lr": T([1e-3, 1e-3])}, {"lr": T([[1e-3]]) - 1}, {"lr": -1e-3}, {"lr": T(-0.1)}]
NAN_LR = [{"lr": math.nan}]
BETAS_CHECKS = [
    {"eps": -1e-8},
    {"eps": T(-1.0)},
    {"lr": -1.0, "eps": -1.0},
    {"betas": (1.0, 0.999)},
    {"betas": (-0.1, 0.999)},
    {"betas": (0.9, 1.0)},
    {"betas": (0.9, math.nan)},
    {"eps": -1.0, "betas": (2.0, 0.9)},
    {"weight_decay": -0.1},
    {"betas": (2.0, 0.9), "weight_decay": -1.0},
]
MIXED_BETAS = [
    {"betas": (0.9, T(0.99))},
    {"betas": (T(0.9), 0.99)},
    {"betas": (0, 0.999)},
    {"betas": (0.9, T(1.5))},
    {"betas": (T(0.9), 0.99), "weight_decay": -1.0},
]
SGD_CHECKS = [
    {"momentum": -0.9},
    {"lr": -1.0, "momentum": -1.0},
    {"weight_decay": -0.2},
    {"weight_decay": T(-0.2)},
    {"momentum": -1.0, "weight_decay": -1.0},
    {"nesterov": True},
    {"nesterov": True, "momentum": 0.9, "dampening": 0.1},
    {"nesterov": True, "momentum": -0.1},
    {"nesterov": True, "weight_decay": -1.0},
]
RMSPROP_CHECKS = [
    {"eps": -1e-8},
    {"lr": -1.0, "eps": -1.0},
    {"momentum": -0.5},
    {"eps": -1.0, "momentum": -1.0},
    {"weight_decay": -0.1},
    {"momentum": -1.0, "weight_decay": -1.0},
    {"alpha": -0.5},
    {"weight_decay": -1.0, "alpha": -1.0},
]
ADAGRAD_CHECKS = [
    {"lr_decay": -0.1},
    {"lr": -1.0, "lr_decay": -1.0},
    {"weight_decay": -0.1},
    {"lr_decay": -1.0, "weight_decay": -1.0},
    {"initial_accumulator_value": -0.1},
    {"weight_decay": -1.0, "initial_accumulator_value": -1.0},
    {"eps": -1e-10},
    {"initial_accumulator_value": -1.0, "eps": -1.0},
]
NADAM_CHECKS = [{"momentum_decay": -1e-3}, {"weight_decay": -1.0, "momentum_decay": -1.0}]
TORCH_CHECKS = {
    "adam": (fadam.adam, torch.optim.Adam, [*LR_CHECKS, *NAN_LR, *BETAS_CHECKS, *MIXED_BETAS]),
    "adamw": (fadam.adamw, torch.optim.AdamW, [*LR_CHECKS, *NAN_LR, *BETAS_CHECKS, *MIXED_BETAS]),
    "sgd": (fadam.sgd, torch.optim.SGD, [*LR_CHECKS, *SGD_CHECKS]),
    "nadam": (fadam.nadam, torch.optim.NAdam, [*LR_CHECKS, *NAN_LR, *BETAS_CHECKS, *NADAM_CHECKS]),
    "radam": (fadam.radam, torch.optim.RAdam, [*LR_CHECKS, *NAN_LR, *BETAS_CHECKS]),
    "adamax": (fadam.adamax, torch.optim.Adamax, [*LR_CHECKS, *NAN_LR, *BETAS_CHECKS]),
    "rmsprop": (fadam.rmsprop, torch.optim.RMSprop, [*LR_CHECKS, *NAN_LR, *RMSPROP_CHECKS]),
    "adagrad": (fadam.adagrad, torch.optim.Adagrad, [*LR_CHECKS, *NAN_LR, *ADAGRAD_CHECKS]),
}


def _invalid_cases() -> list:
    return [
        pytest.param(make, torch_cls, kwargs, id=f"{name}-{'+'.join(kwargs)}-{index}")
        for name, (make, torch_cls, cases) in TORCH_CHECKS.items()
        for index, kwargs in enumerate(cases)
    ]


@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), _invalid_cases())
def test_invalid_hyperparameters_raise_like_torch(make, torch_cls, kwargs):
    """The alias raises what the torch.optim class of the same name raises for the same arguments: the same type,
    with torch's message in its own."""
    with pytest.raises(Exception) as theirs:
        torch_cls([torch.zeros(1, requires_grad=True)], **kwargs)
    with pytest.raises(theirs.type) as ours:
        make(**kwargs)
    assert str(theirs.value) in str(ours.value)


@pytest.mark.parametrize("make", [fadam.adam, fadam.adamw])
def test_adam_takes_betas_as_two_floats_or_two_tensors_with_the_same_steps(make):
    params, grads = _problem(torch.float64, maximize=False, steps=5)
    runs = []
    for betas in ((0.8, 0.99), (torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.99, dtype=torch.float64))):
        tx = make(lr=1e-2, betas=betas)
        p, state = params, tx.init(params)
        for g in grads:
            p, state = fadam.step(tx, p, g, state)
        runs.append(p)
    err, where = max_rel_err(runs[1], runs[0])
    assert err <= TOL[torch.float64], where


@pytest.mark.parametrize(("make", "torch_cls", "kwargs"), _cases())
def test_step_dispatches_to_fused_kernel_for_plain_tensors(make, torch_cls, kwargs):
    """The parity test's ``fadam.step`` runs really went through torch's fused kernels, leaf by leaf: a param without a
    gradient is left out, tensors that autograd records run eagerly."""
    tx = make(**kwargs)
    params, grads = _problem(torch.float32, kwargs["maximize"], steps=1)
    # AdamW without weight decay is Adam: the same kernel's numbers
    decoupled = make is fadam.adamw and kwargs["weight_decay"]
    kernel = {fadam.adam: "torch._fused_adam_", fadam.adamw: "torch._fused_adam_", fadam.sgd: "torch._fused_sgd_"}
    kernel[fadam.adamw] = "torch._fused_adamw_" if decoupled else kernel[fadam.adamw]
    report = fadam.explain(tx, params, grads[0]).splitlines()
    assert len(report) == 1 and report[0].endswith(f": {kernel[make]}: ['b'], ['s'], ['w']"), report
    report = fadam.explain(tx, params, {**grads[0], "b": None})
    assert f"{kernel[make]}: ['s'], ['w']" in report and "eager: no gradient: ['b']" in report, report
    tracked = {k: v.clone().requires_grad_() for k, v in params.items()}
    assert "torch._fused" not in fadam.explain(tx, tracked, grads[0])
