"""Chains composed at random from the declared transforms: the generated CPU kernel against the eager path.

``tests/test_program.py`` checks hand-picked programs; here hypothesis composes them (members, their hyperparameters,
masks, opaque transforms between them, quantized state, leaf shapes around the kernel's chunk and block sizes, float32
and float64) and every step must equal the eager path's bit for bit, params and state, where ``fadam.explain`` says
the kernel runs and where it does not. The examples are fixed (``derandomize``) so that a run of the suite is the
same on every machine; ``--hypothesis-profile=explore`` draws new ones, many more (``tests/conftest.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import find, given, note
from hypothesis import strategies as st

import fadam
from fadam import _cpu_kernel
from fadam._execute import explain
from tests.test_program import KERNEL, _clone, _double, _eager_step, _grads, _mismatches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # radam's and yogi's own notes on small steps

_rates = st.sampled_from([0.0, 0.5, 0.9, 0.99])
_eps = st.sampled_from([1e-8, 1e-3, 0.1])
_small = st.sampled_from([1e-3, 0.1, 1.0])
_lr = st.one_of(_small, st.just("schedule"))


def _schedule(value: float) -> Any:
    return fadam.schedules.cosine_decay_schedule(value, decay_steps=4)


# name -> strategy of its keyword arguments; a learning rate drawn as "schedule" becomes a cosine decay
MEMBERS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "scale_by_adam": st.fixed_dictionaries(
        {"b1": _rates, "b2": st.sampled_from([0.9, 0.999]), "eps": _eps},
        optional={"eps_root": _eps, "amsgrad": st.booleans(), "nesterov": st.booleans()},
    ),
    "scale_by_nadam": st.fixed_dictionaries({"b1": _rates, "eps": _eps}),
    "scale_by_radam": st.fixed_dictionaries({"b1": _rates, "threshold": st.sampled_from([0.0, 5.0])}),
    "scale_by_adamax": st.fixed_dictionaries({"b1": _rates, "eps": _eps}),
    "scale_by_adan": st.fixed_dictionaries({"b1": _rates, "eps": _eps}),
    "scale_by_amsgrad": st.fixed_dictionaries({"b1": _rates, "eps": _eps}),
    "scale_by_belief": st.fixed_dictionaries({"b1": _rates}, optional={"nesterov": st.booleans()}),
    "scale_by_yogi": st.fixed_dictionaries({"b1": _rates, "eps": _eps}),
    "scale_by_lion": st.fixed_dictionaries({"b1": _rates, "b2": st.sampled_from([0.9, 0.99])}),
    "scale_by_rms": st.fixed_dictionaries(
        {"decay": _rates, "eps": _eps}, optional={"initial_scale": _small, "eps_in_sqrt": st.booleans()}
    ),
    "scale_by_stddev": st.fixed_dictionaries({"decay": _rates, "eps": _eps}),
    "scale_by_rss": st.fixed_dictionaries({"eps": _eps}, optional={"eps_in_sqrt": st.booleans()}),
    "scale_by_adadelta": st.fixed_dictionaries({"rho": _rates, "eps": _eps}),
    "scale_by_sign": st.just({}),
    "scale_by_rprop": st.fixed_dictionaries({"lr": _small}),
    "scale_by_optimistic_gradient": st.fixed_dictionaries({"alpha": _small, "beta": _small}),
    "trace": st.one_of(
        st.fixed_dictionaries({"decay": _rates}, optional={"dampening": st.sampled_from([0.0, 0.3])}),
        st.fixed_dictionaries({"decay": st.sampled_from([0.5, 0.9]), "nesterov": st.just(True)}),
    ),
    "ema": st.fixed_dictionaries({"decay": _rates, "debias": st.booleans()}),
    "clip": st.fixed_dictionaries({"max_delta": _small}),
    "clip_by_global_norm": st.fixed_dictionaries({"max_norm": _small}),
    "clip_by_block_rms": st.fixed_dictionaries({"threshold": _small}),
    "scale_by_trust_ratio": st.just({}),
    "scale_by_param_block_rms": st.just({}),
    "normalize_by_update_norm": st.just({}),
    "add_decayed_weights": st.fixed_dictionaries({"weight_decay": _lr}),
    "add_decoupled_weight_decay": st.fixed_dictionaries({"learning_rate": _lr, "weight_decay": _small}),
    "scale": st.fixed_dictionaries({"step_size": st.sampled_from([-1e-2, 3.0])}),
    "scale_by_learning_rate": st.fixed_dictionaries({"learning_rate": _lr}, optional={"flip_sign": st.booleans()}),
    "keep_params_nonnegative": st.just({}),
    "opaque": st.just({}),  # a user transform without a declaration: it splits the program
    # the hyperparameters as tensors in the state, the inner transform built at each step; b1 is never 0 here: a
    # tensor weight of 1 keeps torch.lerp's signs of zeros (README, the numerics of the generated kernel)
    "inject_hyperparams(scale_by_adam)": st.fixed_dictionaries({"b1": st.sampled_from([0.5, 0.9]), "eps": _eps}),
    "inject_hyperparams(scale_by_lion)": st.fixed_dictionaries({"b1": st.sampled_from([0.5, 0.9])}),
    "inject_hyperparams(trace)": st.fixed_dictionaries({"decay": _rates}),
}

# the kernel's chunk (16384), a pass between square roots (512), a quantized block (256 at 8 bits, 128 at 4 bits)
SHAPES = [(), (1,), (3, 5), (255,), (513,), (4097,), (16_385,), (70_001,)]


@st.composite
def members(draw: st.DrawFn, leaves: list[str]) -> tuple:
    """One member as data: ``(name, kwargs, mask)``, its mask ``None`` or a bool per leaf (``fadam.masked``)."""
    name = draw(st.sampled_from(list(MEMBERS)))
    kwargs = draw(MEMBERS[name])
    mask = draw(st.none() | st.fixed_dictionaries({leaf: st.booleans() for leaf in leaves}))
    return name, kwargs, mask


@st.composite
def leaf_kinds(draw: st.DrawFn, dtype: str) -> dict[str, Any]:
    """A leaf as data: its shape, its dtype (mostly the tree's), whether it is a transposed view (which the kernel
    refuses: it goes eager beside the others) and whether it has a gradient."""
    shape = draw(st.sampled_from(SHAPES))
    return {
        "shape": shape,
        "dtype": draw(st.sampled_from([dtype] * 3 + ["float32", "float64"])),
        "transposed": len(shape) == 2 and draw(st.integers(0, 4)) == 0,
        "grad": draw(st.integers(0, 6)) > 0,
    }


@st.composite
def recipes(draw: st.DrawFn) -> dict[str, Any]:
    """A problem as data (hypothesis prints it on a failure): the leaves, the chain's members, how its state is stored,
    whether a second chain takes some leaves (``partition``), whether the middle step's gradients hold infinities and
    NaNs, and how the kernel's side steps: ``fadam.step``, donated or not, or ``tx.update`` and ``apply_updates``."""
    dtype = draw(st.sampled_from(["float32", "float64"]))
    kinds = draw(st.lists(leaf_kinds(dtype), min_size=1, max_size=4))
    leaves = [f"p{i}" for i in range(len(kinds))]
    labels = draw(st.none() | st.fixed_dictionaries({leaf: st.sampled_from("ab") for leaf in leaves}))
    return {
        "leaves": dict(zip(leaves, kinds)),
        "members": draw(st.lists(members(leaves), min_size=1, max_size=4)),
        "partition": None if labels is None else (labels, draw(st.lists(members(leaves), min_size=1, max_size=3))),
        "quantized": draw(st.sampled_from([None, 8, 4])),
        "specials": draw(st.integers(0, 3)) == 0,
        "mode": draw(st.sampled_from(["donated step", "kept step", "update"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _member(name: str, kwargs: dict[str, Any], mask: dict[str, bool] | None) -> fadam.GradientTransformation:
    kwargs = {key: _schedule(1e-2) if value == "schedule" else value for key, value in kwargs.items()}
    if name == "opaque":
        tx = _double()
    elif name.startswith("inject_hyperparams("):
        tx = fadam.inject_hyperparams(getattr(fadam, name.removeprefix("inject_hyperparams(")[:-1]))(**kwargs)
    else:
        tx = getattr(fadam, name)(**kwargs)
    return tx if mask is None else fadam.masked(tx, mask)


def _build(recipe: dict[str, Any]) -> tuple[fadam.GradientTransformation, dict[str, torch.Tensor]]:
    tx = fadam.chain(*(_member(*m) for m in recipe["members"]))
    if recipe["partition"] is not None:
        labels, others = recipe["partition"]
        tx = fadam.partition({"a": tx, "b": fadam.chain(*(_member(*m) for m in others))}, labels)
    if recipe["quantized"] is not None:  # every leaf of 256 elements or more keeps its slots quantized
        tx = fadam.quantize_state(tx, bits=recipe["quantized"], min_size=256)
    gen = torch.Generator().manual_seed(recipe["seed"])
    params = {}
    for leaf, kind in recipe["leaves"].items():
        shape, dtype = kind["shape"], getattr(torch, kind["dtype"])
        if kind["transposed"]:
            shape = shape[::-1]
        p = torch.randn(shape, generator=gen, dtype=dtype) * 10.0 ** torch.randint(-3, 3, shape, generator=gen)
        params[leaf] = p.t() if kind["transposed"] else p
    return tx, params


def _step_grads(recipe: dict[str, Any], params: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    grads = _grads(params, seed=recipe["seed"] + step)
    for leaf, kind in recipe["leaves"].items():
        if not kind["grad"]:
            grads[leaf] = None
        elif recipe["specials"] and step == 1 and grads[leaf].numel() > 1:
            flat = grads[leaf].view(-1)
            flat[1::97], flat[2::89], flat[3::83] = float("inf"), -float("inf"), float("nan")
    return grads


@pytest.fixture
def kernel_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    runs: list[int] = []
    run = _cpu_kernel.Kernel.run

    def counted(self: _cpu_kernel.Kernel, leaves: list, *args: Any) -> None:
        runs.append(len(leaves))
        return run(self, leaves, *args)

    monkeypatch.setattr(_cpu_kernel.Kernel, "run", counted)
    return runs


@pytest.mark.skipif(_cpu_kernel._compiler() is None, reason="the generated kernel needs a C++ compiler")
@given(recipe=recipes())
def test_a_composed_chain_steps_as_the_eager_path_bit_for_bit(recipe: dict[str, Any], kernel_runs: list[int]):
    tx, params = _build(recipe)
    with fadam.backend("kernel"):
        report = explain(tx, params, _step_grads(recipe, params, 0))
    note(report)
    kernel_runs.clear()  # hypothesis reuses the fixture across examples
    eager = (params, tx.init(params))
    kernel = _clone(eager)
    with fadam.backend("kernel"):
        for step in range(3):
            grads = _step_grads(recipe, eager[0], step)
            eager = _eager_step(tx, eager[0], grads, eager[1])
            if recipe["mode"] == "update":
                updates, state = tx.update(grads, kernel[1], kernel[0])
                kernel = fadam.apply_updates(kernel[0], updates), state
            else:
                kernel = fadam.step(tx, kernel[0], grads, kernel[1], donate=recipe["mode"] == "donated step")
            assert _mismatches(kernel, eager, equal_nan=True) == [], f"step {step}"
    # explain names the kernel where it runs; an opaque stage (its line says eager) may run fadam chains inside it,
    # as quantize_state of a chain with an opaque member runs that chain on the decoded state
    assert (KERNEL in report) <= bool(kernel_runs), "explain names a kernel that never ran"
    if "an opaque transform" not in report:
        assert (KERNEL in report) == bool(kernel_runs), "the kernel ran where explain does not name it"


def test_every_member_runs_as_declared():
    """Each member but the opaque one is a declaration: a composed chain of it takes the kernel, not an opaque stage."""
    params = {"p": torch.randn(300)}
    for name in MEMBERS:
        if name == "opaque":
            continue
        kwargs = find(MEMBERS[name], lambda _: True)  # the simplest arguments
        with fadam.backend("kernel"):
            report = explain(_member(name, kwargs, None), params)
        assert KERNEL in report, f"{name}: {report}"
