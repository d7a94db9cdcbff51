"""PyTorch's own optimizer inputs (``optim_db`` of ``torch.testing._internal.common_optimizers``) run through
``fadam.Optimizer`` beside the torch.optim class they stand for, on the CPU.

For each class fadam has a drop-in for, each of torch's inputs (``optim_inputs_func(device="cpu")``) is taken as it
is and with each implementation flag the OptimizerInfo says the class has (``foreach``, ``fused`` where its fused
kernel runs on the CPU, ``differentiable``, ``capturable``). Each (class, input, check) is one test (with a flag, only
the checks of the numbers: ``steps``, ``state_dict`` and ``complex``):

- ``steps``: a few steps of a small float64 MLP give torch's params (within 1e-10 relative; bit for bit with
  ``fused``, where fadam runs torch's fused kernel);
- ``state_dict``: a ``state_dict`` saved after some steps (through ``torch.save`` and ``torch.load(weights_only=True)``)
  loads into a fresh drop-in that continues exactly as the uninterrupted one;
- ``from_torch``: torch's ``state_dict`` loads into a fresh drop-in that continues as torch does, and fadam's state
  converts back (``fadam.state_to_torch``) into a fresh torch optimizer that continues as torch does;
- ``deepcopy``: a copy of (params, optimizer) continues exactly as the original;
- ``param_groups``: the input's options in a second param group, torch's defaults in the first;
- ``complex``: the steps on complex params;
- ``sparse``, for the classes that take sparse gradients too (SGD, Adagrad): the steps with each gradient given as an
  uncoalesced sparse COO tensor over its first dim (a row absent, a row given twice), as ``nn.Embedding(sparse=True)``
  gives them. SparseAdam, which takes sparse gradients only, gets them in every check.

Each check runs the same code on both sides: where torch raises, fadam must raise the same exception type with
torch's message in its own; where torch does not, fadam must not. torch.optim refuses ``capturable=True`` for CPU
params, which fadam takes (its step counts live on the CPU): those runs are compared with torch's without the flag.
Each of torch's error inputs (``optim_error_inputs_func``) must raise in fadam as in torch (``errors``).
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fadam

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")

# torch.optim class -> the fadam factory of its drop-in
FACTORIES: dict[type[torch.optim.Optimizer], Callable[..., fadam.GradientTransformation]] = {
    torch.optim.Adadelta: fadam.adadelta,
    torch.optim.Adafactor: fadam.adafactor_torch,
    torch.optim.Adagrad: fadam.adagrad,
    torch.optim.Adam: fadam.adam,
    torch.optim.Adamax: fadam.adamax,
    torch.optim.AdamW: fadam.adamw,
    torch.optim.ASGD: fadam.asgd,
    torch.optim.LBFGS: fadam.lbfgs,
    torch.optim.Muon: fadam.muon,
    torch.optim.NAdam: fadam.nadam,
    torch.optim.RAdam: fadam.radam,
    torch.optim.RMSprop: fadam.rmsprop,
    torch.optim.Rprop: fadam.rprop,
    torch.optim.SGD: fadam.sgd,
    torch.optim.SparseAdam: fadam.sparse_adam,
}
# the drop-ins that are classes of their own (torch's constructor and its checks of the params), not
# fadam.Optimizer(params, factory, ...)
CLASSES: dict[type[torch.optim.Optimizer], type[torch.optim.Optimizer]] = {torch.optim.SparseAdam: fadam.SparseAdam}
INFOS = [info for info in common_optimizers.optim_db if info.optim_cls in FACTORIES]
CHECKS = ("steps", "state_dict", "from_torch", "deepcopy", "param_groups", "complex")
FLAGS = ("foreach", "fused", "capturable", "differentiable")
# an implementation flag changes how the steps are computed: the checks of the numbers run with each flag, those of
# the optimizer object (copies, groups, torch's state) once an input
FLAG_CHECKS = ("steps", "state_dict", "complex")
STEPS = 4  # steps compared with torch's
BEFORE, AFTER = 2, 1  # steps before a checkpoint (or a copy) and after it
SLOW = (torch.optim.LBFGS,)  # up to 25 loss evaluations a step: fewer steps
RTOL = 1e-10
GRADIENT = "d(params after the steps)/d(initial params)"

# where fadam and torch part ways: (class name, predicate on the input's kwargs, checks, why), strict xfails
_FLOAT32_SCALARS = (
    "its {} computes the step's scalars in float32 tensor arithmetic from its float32 step tensor (bias "
    "corrections 1 - beta**step{}), about 1e-8 relative on float64 params; fadam computes them in float64 for every "
    "flag, as torch's default for-loop does"
)
XFAILS: list[tuple[str, Callable[[dict[str, Any]], bool], tuple[str, ...], str]] = [
    (
        "ASGD",
        lambda kw: kw.get("foreach", False),
        CHECKS,
        "torch.optim.ASGD's foreach implementation computes eta = lr / (1 + lambd*lr*step)**alpha in float32 tensor "
        "arithmetic from its float32 step tensors, its for-loop in Python floats rounded once to float32: from step "
        "3 on the two differ by about 1e-8 relative; fadam follows the for-loop for every flag",
    ),
    *(
        (name, lambda kw: kw.get("differentiable", False), ("steps", "complex", "param_groups"), reason)
        for name, reason in (
            ("Adam", "torch.optim.Adam: " + _FLOAT32_SCALARS.format("differentiable path", "")),
            ("AdamW", "torch.optim.AdamW: " + _FLOAT32_SCALARS.format("differentiable path", "")),
            ("NAdam", "torch.optim.NAdam: " + _FLOAT32_SCALARS.format("differentiable path", ", mu_t and mu_product")),
        )
    ),
    (
        "SGD",
        lambda kw: kw.get("differentiable", False) and kw.get("momentum", 0) != 0 and kw.get("weight_decay", 0) != 0,
        ("steps", "complex"),
        "torch.optim.SGD starts its momentum buffer as clone(grad).detach(), which cuts the gradient through the "
        "first step's weight decay term (grad + weight_decay * param); fadam's buffer keeps it, so the gradients of "
        "the stepped params with respect to the initial ones differ (the params are equal)",
    ),
    (
        "Adagrad",
        lambda kw: "initial_accumulator_value" in kw,
        ("param_groups",),
        "torch.optim.Adagrad fills every group's sum with the constructor's initial_accumulator_value (its __init__ "
        "reads the argument, not the group's option); fadam fills each group's with the group's own",
    ),
    (
        "SparseAdam",
        lambda kw: isinstance(kw.get("lr"), torch.Tensor),
        ("steps", "state_dict", "deepcopy", "param_groups"),
        "torch.optim.SparseAdam with a tensor lr computes its step size lr * sqrt(1 - beta2**step) / (1 - beta1**step) "
        "as a float32 tensor (the lr's dtype), about 1e-8 relative on float64 params; fadam.Optimizer hands the "
        "factory the lr's value as a Python float, so the step size is float64",
    ),
    (
        "Muon",
        lambda kw: isinstance(kw.get("lr"), torch.Tensor),
        ("steps", "state_dict", "from_torch", "deepcopy", "param_groups"),
        "torch.optim.Muon with a tensor lr computes 1 - lr*weight_decay and the shape-adjusted lr as float32 tensors "
        "(the lr's dtype), about 1e-8 relative on float64 params; fadam.Optimizer hands the factory the lr's value as "
        "a Python float, so the products are float64",
    ),
]
# torch.optim's own failures on a check, not refusals of the input: fadam's side is checked alone
TORCH_BROKEN: dict[tuple[str, str], tuple[type[BaseException], str]] = {
    ("LBFGS", "deepcopy"): (AttributeError, "torch.optim.LBFGS's copy loses _params (Optimizer.__setstate__)"),
}


def _flag_variants(info: Any) -> list[str]:
    """The implementation flags the OptimizerInfo gives the class on the CPU."""
    flags = [f for f in info.supported_impls if f != "fused" or "cpu" in info.supports_fused_on]
    if info.has_capturable_arg:
        flags.append("capturable")
    return [f for f in FLAGS if f in flags]


def _inputs(info: Any) -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    """(description, kwargs, checks) of each of torch's CPU inputs for the class, as given and with each flag set."""
    sparse = ("sparse",) if info.supports_sparse else ()
    found = []
    for optim_input in info.optim_inputs_func(device="cpu"):
        found.append((optim_input.desc, optim_input.kwargs, CHECKS + sparse))
        for flag in _flag_variants(info):
            found.append((f"{optim_input.desc} & {flag}", {**optim_input.kwargs, flag: True}, FLAG_CHECKS + sparse))
    return found


def _cases() -> list[Any]:
    cases = []
    for info in INFOS:
        name = info.optim_cls.__name__
        for desc, kwargs, checks in _inputs(info):
            for check in checks:
                reason = next(
                    (r for n, rule, checks, r in XFAILS if n == name and check in checks and rule(kwargs)), None
                )
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                cases.append(pytest.param(info, kwargs, check, id=f"{name}-{desc}-{check}", marks=marks))
    return cases


def _error_cases() -> list[Any]:
    cases = []
    for info in INFOS:
        if info.optim_error_inputs_func is None:
            continue
        for index, error_input in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float64)):
            desc = error_input.optimizer_error_input.desc
            cases.append(pytest.param(info, index, id=f"{info.optim_cls.__name__}-{index}-{desc}-errors"))
    return cases


# --- the problem: a 2-layer MLP written over a list of tensors --------------------------------------------------------


def _leaves(cls: type, dtype: torch.dtype) -> list[torch.Tensor]:
    """The MLP's weights (and biases, but for Muon, which takes matrices only), float64 or complex128."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (2, 4)] if cls is torch.optim.Muon else [(4, 3), (4,), (2, 4), (2,)]
    return [(torch.randn(s, generator=gen, dtype=dtype) * 0.5).requires_grad_() for s in shapes]


def _loss(params: list[torch.Tensor], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    dtype = params[0].dtype
    x, y = torch.randn(5, 3, generator=gen, dtype=dtype), torch.randn(5, 2, generator=gen, dtype=dtype)
    if len(params) == 4:
        w1, b1, w2, b2 = params
        out = torch.tanh(x @ w1.T + b1) @ w2.T + b2
    else:
        w1, w2 = params
        out = torch.tanh(x @ w1.T) @ w2.T
    return (out - y).abs().pow(2).mean()


def _sparse(g: torch.Tensor, step: int) -> torch.Tensor:
    """``g`` as an uncoalesced sparse COO tensor over its first dim: a row absent (which one changes with the step),
    the first row present given in two halves (a repeated index)."""
    rows = [i for i in range(g.shape[0]) if i != step % g.shape[0]]
    values = torch.cat([g[rows[:1]] * 0.5, g[rows[1:]], g[rows[:1]] * 0.5])
    return torch.sparse_coo_tensor(torch.tensor([rows + rows[:1]]), values, g.shape, check_invariants=True)


class _Run:
    """One side of a check: the optimizer class (torch's, or fadam's drop-in for it) and its inputs."""

    def __init__(
        self, info: Any, kwargs: dict[str, Any], ours: bool, complex_params: bool = False, sparse: bool = False
    ):
        self.cls = info.optim_cls
        self.ours = ours
        self.kwargs = kwargs
        self.dtype = torch.complex128 if complex_params else torch.float64
        self.closure = info.step_requires_closure
        self.sparse = sparse or info.only_supports_sparse_grads  # the gradients as sparse COO tensors
        self.steps_compared, self.before, self.after = (2, 1, 1) if self.cls in SLOW else (STEPS, BEFORE, AFTER)

    def make(self, params: Any, kwargs: dict[str, Any] | None = None) -> torch.optim.Optimizer:
        """The optimizer over ``params`` with ``kwargs`` (by default the input's)."""
        kwargs = copy.deepcopy(self.kwargs if kwargs is None else kwargs)  # a tensor lr of each optimizer its own
        if not self.ours:
            if kwargs.get("capturable"):  # torch refuses CPU params with it; its numbers are those without it
                kwargs.pop("capturable")
            return self.cls(params, **kwargs)
        return _drop_in(self.cls, params, **kwargs)

    def params(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the leaves, the params stepped): non-leaf clones for ``differentiable``, as torch.optim needs."""
        leaves = _leaves(self.cls, self.dtype)
        if self.kwargs.get("differentiable"):
            return leaves, [p.clone() for p in leaves]
        return leaves, leaves

    def step(self, opt: torch.optim.Optimizer, params: list[torch.Tensor], step: int) -> torch.Tensor:
        def closure() -> torch.Tensor:
            loss = _loss(params, step)
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = _sparse(g, step) if self.sparse else g
            return loss.detach()

        if self.closure:
            return opt.step(closure)
        loss = closure()
        opt.step()
        return loss

    def steps(self, opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, count: int) -> list[Any]:
        return [self.step(opt, params, s) for s in range(start, start + count)]


def _drop_in(cls: type[torch.optim.Optimizer], params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """fadam's drop-in for ``cls`` over ``params``."""
    if cls in CLASSES:
        return CLASSES[cls](params, **kwargs)
    return fadam.Optimizer(params, FACTORIES[cls], **kwargs)


def _values(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _saved(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --- the checks: each returns named lists of tensors, compared between the sides -------------------------------------


def _check_steps(run: _Run) -> dict[str, list[torch.Tensor]]:
    leaves, params = run.params()
    opt = run.make(params)
    out: dict[str, list[torch.Tensor]] = {}
    for s in range(run.steps_compared):
        out[f"loss {s}"] = [run.step(opt, params, s)]
        out[f"params after step {s + 1}"] = _values(params)
    if run.kwargs.get("differentiable"):  # gradients through the steps reach the initial params
        try:
            grads = torch.autograd.grad(sum((p.abs() ** 2).sum() for p in params), leaves)
        except RuntimeError:  # torch.optim's graph of some steps has its saved tensors overwritten in place
            pass
        else:
            out[GRADIENT] = list(grads)
    return out


def _check_state_dict(run: _Run) -> dict[str, list[torch.Tensor]]:
    _, params = run.params()
    opt = run.make(params)
    run.steps(opt, params, 0, run.before)
    state_dict = opt.state_dict()
    if not run.kwargs.get("differentiable"):  # a differentiable run's state is in the graph: it does not pickle
        state_dict = _saved(state_dict)
    copied = [p.detach().clone().requires_grad_(p.requires_grad) for p in params]
    resumed = run.make(copied)
    resumed.load_state_dict(state_dict)
    run.steps(opt, params, run.before, run.after)
    run.steps(resumed, copied, run.before, run.after)
    return {"uninterrupted": _values(params), "resumed": _values(copied)}


def _check_deepcopy(run: _Run) -> dict[str, list[torch.Tensor]]:
    _, params = run.params()
    opt = run.make(params)
    run.steps(opt, params, 0, run.before)
    copied, opt_copy = copy.deepcopy((params, opt))
    run.steps(opt, params, run.before, run.after)
    run.steps(opt_copy, copied, run.before, run.after)
    return {"original": _values(params), "copy": _values(copied)}


def _check_param_groups(run: _Run) -> dict[str, list[torch.Tensor]]:
    _, params = run.params()
    flags = {k: v for k, v in run.kwargs.items() if k in FLAGS}
    options = {k: v for k, v in run.kwargs.items() if k not in FLAGS}
    half = len(params) // 2
    opt = run.make([{"params": params[:half]}, {"params": params[half:], **copy.deepcopy(options)}], flags)
    run.steps(opt, params, 0, run.steps_compared)
    return {"params": _values(params)}


def _check_complex(run: _Run) -> dict[str, list[torch.Tensor]]:
    return _check_steps(run)


def _outcome(check: str, run: _Run) -> tuple[dict[str, list[torch.Tensor]] | None, BaseException | None]:
    fn = {
        "steps": _check_steps,
        "state_dict": _check_state_dict,
        "deepcopy": _check_deepcopy,
        "param_groups": _check_param_groups,
        "complex": _check_complex,
        "sparse": _check_steps,
    }[check]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(run), None
    except Exception as error:
        return None, error


def _assert_same_error(ours: BaseException | None, theirs: BaseException) -> None:
    assert ours is not None, f"torch.optim raises {type(theirs).__name__}: {theirs}; fadam does not"
    assert isinstance(ours, type(theirs)), (
        f"torch.optim raises {type(theirs).__name__}: {theirs}; fadam raises {type(ours).__name__}: {ours}"
    )
    assert str(theirs) in str(ours), f"fadam's message {str(ours)!r} lacks torch's {str(theirs)!r}"


def _assert_close(ours: dict[str, list[torch.Tensor]], theirs: dict[str, list[torch.Tensor]], exact: bool) -> None:
    assert ours.keys() - {GRADIENT} == theirs.keys() - {GRADIENT} and (GRADIENT not in theirs or GRADIENT in ours)
    for name in theirs.keys() & ours.keys():
        for index, (a, b) in enumerate(zip(ours[name], theirs[name])):
            if exact:
                assert torch.equal(a, b), f"{name}, tensor {index}: not bit for bit torch's"
            else:
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=RTOL,
                    atol=RTOL * float(b.abs().max()),
                    msg=lambda m, where=f"{name} {index}": f"{where}: {m}",
                )


def _check_from_torch(info: Any, kwargs: dict[str, Any]) -> None:
    """torch's state_dict into a fresh drop-in, and fadam's state back into a fresh torch optimizer."""
    theirs, ours = _Run(info, kwargs, ours=False), _Run(info, kwargs, ours=True)
    _, params = theirs.params()
    torch_opt = theirs.make(params)
    before, after = theirs.before, theirs.after
    theirs.steps(torch_opt, params, 0, before)
    copied = [p.detach().clone().requires_grad_(p.requires_grad) for p in params]
    opt = ours.make(copied)
    opt.load_state_dict(_saved(torch_opt.state_dict()))
    theirs.steps(torch_opt, params, before, after)
    ours.steps(opt, copied, before, after)
    exact = bool(kwargs.get("fused"))
    _assert_close({"continued": _values(copied)}, {"continued": _values(params)}, exact)
    back = [p.detach().clone().requires_grad_(p.requires_grad) for p in copied]
    torch_again = theirs.make(back)
    count = before + after if info.optim_cls in (torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop) else None
    if info.optim_cls is torch.optim.Adagrad and not kwargs.get("lr_decay"):
        count = before + after
    torch_again.load_state_dict(fadam.state_to_torch(opt.tx_states[0], copied, torch_again, count=count))
    theirs.steps(torch_opt, params, before + after, after)
    theirs.steps(torch_again, back, before + after, after)
    _assert_close({"back in torch": _values(back)}, {"back in torch": _values(params)}, exact)


@pytest.mark.parametrize(("info", "kwargs", "check"), _cases())
def test_optim_db_input(info: Any, kwargs: dict[str, Any], check: str) -> None:
    if check == "from_torch":
        _check_from_torch(info, kwargs)
        return
    if check == "param_groups" and not info.supports_param_groups:
        with pytest.raises(ValueError, match=r"doesn't support per-parameter options \(parameter groups\)"):
            _check_param_groups(_Run(info, kwargs, ours=True))
        return
    options = {"complex_params": check == "complex", "sparse": check == "sparse"}
    theirs, their_error = _outcome(check, _Run(info, kwargs, ours=False, **options))
    ours, our_error = _outcome(check, _Run(info, kwargs, ours=True, **options))
    broken = TORCH_BROKEN.get((info.optim_cls.__name__, check))
    if their_error is not None and not (broken and isinstance(their_error, broken[0])):
        _assert_same_error(our_error, their_error)
        return
    if our_error is not None:
        raise our_error
    assert ours is not None
    if theirs is not None:
        _assert_close(ours, theirs, exact=bool(kwargs.get("fused")))
    if check == "state_dict":
        _assert_close({"": ours["resumed"]}, {"": ours["uninterrupted"]}, exact=True)
    if check == "deepcopy":
        _assert_close({"": ours["copy"]}, {"": ours["original"]}, exact=True)


def _default_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(2, 2, dtype=torch.float64))]


@pytest.mark.parametrize(("info", "index"), _error_cases())
def test_optim_db_error_input(info: Any, index: int) -> None:
    """Each of torch's error inputs raises (or warns) in fadam as in torch, with torch's message in fadam's."""
    error_input = info.optim_error_inputs_func(device="cpu", dtype=torch.float64)[index]
    optim_input = error_input.optimizer_error_input
    construction = error_input.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR

    def attempt(make: Callable[..., torch.optim.Optimizer]) -> BaseException | None:
        params = optim_input.params if optim_input.params is not None else _default_params()
        kwargs = copy.deepcopy(optim_input.kwargs)
        try:
            if construction:
                make(params, **kwargs)
            else:
                opt = make(params, **kwargs)
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = torch.ones_like(p)
                opt.step()
        except Exception as error:
            return error
        return None

    def ours(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return _drop_in(info.optim_cls, params, **kwargs)

    if issubclass(error_input.error_type, Warning):
        for make in (info.optim_cls, ours):
            with pytest.warns(error_input.error_type, match=error_input.error_regex):
                assert attempt(make) is None
        return
    theirs = attempt(info.optim_cls)
    assert isinstance(theirs, error_input.error_type), f"torch.optim raised {theirs!r}"
    _assert_same_error(attempt(ours), theirs)
