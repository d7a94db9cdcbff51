"""Chains composed at random from the declared transforms: the generated CPU kernel against the eager path.

``tests/test_program.py`` checks hand-picked programs; here hypothesis composes them (members, their hyperparameters,
masks, partitions, opaque transforms between them, quantized and paged state, leaf shapes around the kernel's chunk and
block sizes, strided leaves and views of one buffer, missing gradients, infinities and NaNs, float32 and float64), and
every step, donated, kept or as ``update`` + ``apply_updates``, must equal the eager path's bit for bit, params and
state, leaving what a kept step is given as it was, with the kernel running where ``fadam.explain`` says. The examples
are fixed (``derandomize``) so that a run of the suite is the same on every machine;
``--hypothesis-profile=explore`` draws new ones, many more (``tests/conftest.py``)."""

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
    "scale_by_factored_rms": st.fixed_dictionaries(
        {"min_dim_size_to_factor": st.sampled_from([2, 4, 128])},
        optional={"decay_rate": st.sampled_from([0.5, 0.8]), "factored": st.booleans()},
    ),
    "scale_by_adafactor_torch": st.fixed_dictionaries(
        {"lr": _lr}, optional={"beta2_decay": st.sampled_from([-0.8, -0.5]), "d": st.sampled_from([1.0, 1.5])}
    ),
    "opaque": st.just({}),  # a user transform without a declaration: it splits the program
    # the hyperparameters as tensors in the state, the inner transform built at each step; b1 is never 0 here: a
    # tensor weight of 1 keeps torch.lerp's signs of zeros (README, the numerics of the generated kernel)
    "inject_hyperparams(scale_by_adam)": st.fixed_dictionaries({"b1": st.sampled_from([0.5, 0.9]), "eps": _eps}),
    "inject_hyperparams(scale_by_lion)": st.fixed_dictionaries({"b1": st.sampled_from([0.5, 0.9])}),
    "inject_hyperparams(trace)": st.fixed_dictionaries({"decay": _rates}),
}

# the members whose scalars are sums over elements, which add up in the order of memory (a strided leaf's own order)
REDUCING = {
    "clip_by_global_norm",
    "clip_by_block_rms",
    "scale_by_trust_ratio",
    "scale_by_param_block_rms",
    "normalize_by_update_norm",
    "scale_by_factored_rms",  # row and column means
    "scale_by_adafactor_torch",  # row and column means, the update's and the params' norms
}

# the kernel's chunk (16384), a pass between square roots (512), a quantized block (256 at 8 bits, 128 at 4 bits),
# matrices and a 3-d leaf that factored statistics factor
SHAPES = [(), (1,), (3, 5), (255,), (513,), (4097,), (16_385,), (70_001,), (65, 257), (3, 4, 130)]


@st.composite
def members(draw: st.DrawFn, leaves: list[str]) -> tuple:
    """One member as data: ``(name, kwargs, mask)``, its mask ``None`` or a bool per leaf (``fadam.masked``)."""
    name = draw(st.sampled_from(list(MEMBERS)))
    kwargs = draw(MEMBERS[name])
    mask = draw(st.none() | st.fixed_dictionaries({leaf: st.booleans() for leaf in leaves}))
    return name, kwargs, mask


@st.composite
def leaf_kinds(draw: st.DrawFn, dtype: str) -> dict[str, Any]:
    """A leaf as data: its shape, its dtype (mostly the tree's), its layout (dense, or a view of every other element
    or a transposed one, which the kernel refuses: they go eager beside the others) and whether it has a
    gradient."""
    shape = draw(st.sampled_from(SHAPES))
    return {
        "shape": shape,
        "dtype": draw(st.sampled_from([dtype] * 3 + ["float32", "float64"])),
        "layout": draw(st.sampled_from(["dense"] * 4 + ["strided"] + (["transposed"] if len(shape) == 2 else []))),
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
        # the dense params, or their gradients, as views of one buffer per dtype (flat parameters, DDP's buckets)
        "one buffer": draw(st.sampled_from([(), ("params",), ("grads",), ("params", "grads")])),
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


def _build(recipe: dict[str, Any]) -> fadam.GradientTransformation:
    tx = fadam.chain(*(_member(*m) for m in recipe["members"]))
    if recipe["partition"] is not None:
        labels, others = recipe["partition"]
        tx = fadam.partition({"a": tx, "b": fadam.chain(*(_member(*m) for m in others))}, labels)
    if recipe["quantized"] is not None:  # every leaf of 256 elements or more keeps its slots quantized
        tx = fadam.quantize_state(tx, bits=recipe["quantized"], min_size=256)
    return tx


def _params(recipe: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The params, laid out as the recipe says (the same values at every call)."""
    gen = torch.Generator().manual_seed(recipe["seed"])
    values = {}
    for leaf, kind in recipe["leaves"].items():
        shape = kind["shape"]
        scale = 10.0 ** torch.randint(-3, 3, shape, generator=gen)
        values[leaf] = torch.randn(shape, generator=gen, dtype=getattr(torch, kind["dtype"])) * scale
    return _laid_out(recipe, values, "params" in recipe["one buffer"])


def _laid_out(recipe: dict[str, Any], values: dict[str, Any], one_buffer: bool) -> dict[str, Any]:
    """``values`` in their leaves' layouts; the dense ones in one buffer per dtype where ``one_buffer``."""
    dense = [leaf for leaf, v in values.items() if v is not None and recipe["leaves"][leaf]["layout"] == "dense"]
    placed = dict(values)
    if one_buffer:
        for dtype in {values[leaf].dtype for leaf in dense}:
            members = [leaf for leaf in dense if values[leaf].dtype == dtype]
            buffer = torch.cat([values[leaf].reshape(-1) for leaf in members])
            for leaf, view in zip(members, buffer.split([values[leaf].numel() for leaf in members])):
                placed[leaf] = view.view(values[leaf].shape)
    for leaf, v in values.items():
        layout = recipe["leaves"][leaf]["layout"]
        if v is not None and layout == "strided":
            placed[leaf] = torch.stack([v, torch.full_like(v, 7.0)], dim=-1)[..., 0]
        elif v is not None and layout == "transposed":
            placed[leaf] = v.t().contiguous().t()
    return placed


def _step_grads(recipe: dict[str, Any], params: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    grads = _grads(params, seed=recipe["seed"] + step)
    for leaf, kind in recipe["leaves"].items():
        if not kind["grad"]:
            grads[leaf] = None
        elif recipe["specials"] and step == 1 and grads[leaf].numel() > 1:
            flat = grads[leaf].view(-1)
            flat[1::97], flat[2::89], flat[3::83] = float("inf"), -float("inf"), float("nan")
    return _laid_out(recipe, grads, "grads" in recipe["one buffer"])


def _strided_like(params: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with the strides of the kernel side's params (a donated step keeps a strided param strided, where
    the eager step's results are dense): torch's reductions (a trust ratio's norms) add up in the order of memory."""
    return {
        leaf: p
        if p.stride() == like[leaf].stride()
        else torch.empty_strided(p.shape, like[leaf].stride(), dtype=p.dtype).copy_(p)
        for leaf, p in params.items()
    }


@pytest.mark.skipif(_cpu_kernel._compiler() is None, reason="the generated kernel needs a C++ compiler")
@given(recipe=recipes())
def test_a_composed_chain_steps_as_the_eager_path_bit_for_bit(recipe: dict[str, Any], kernel_runs: list[int]):
    tx, params = _build(recipe), _params(recipe)
    with fadam.backend("kernel"):
        report = explain(tx, params, _step_grads(recipe, params, 0))
    note(report)
    kernel_runs.clear()  # hypothesis reuses the fixture across examples
    eager = (params, tx.init(params))
    kernel_params = _params(recipe)  # not _clone(params), which would lay every leaf out densely
    kernel = (kernel_params, tx.init(kernel_params))
    with fadam.backend("kernel"):
        for step in range(3):
            grads = _step_grads(recipe, eager[0], step)
            eager = _eager_step(tx, _strided_like(eager[0], kernel[0]), grads, eager[1])
            given = _clone((kernel, grads))
            if recipe["mode"] == "update":
                updates, state = tx.update(grads, kernel[1], kernel[0])
                new = fadam.apply_updates(kernel[0], updates), state
            else:
                new = fadam.step(tx, kernel[0], grads, kernel[1], donate=recipe["mode"] == "donated step")
            if recipe["mode"] != "donated step":  # nothing passed in is written
                assert _mismatches((kernel, grads), given, equal_nan=True) == [], f"step {step} wrote its inputs"
            kernel = new
            assert _mismatches(kernel, eager, equal_nan=True) == [], f"step {step}"
            if step == 0:  # what explain describes (a kept step's new params are dense, whatever the given layout)
                first_runs = list(kernel_runs)
    # explain names the kernel where it runs; an opaque stage (its line says eager) may run fadam chains inside it,
    # as quantize_state of a chain with an opaque member runs that chain on the decoded state
    assert (KERNEL in report) <= bool(first_runs), "explain names a kernel that did not run"
    if "an opaque transform" not in report:
        assert (KERNEL in report) == bool(first_runs), "the kernel ran where explain does not name it"


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


@st.composite
def paged_recipes(draw: st.DrawFn) -> dict[str, Any]:
    """A recipe whose chain keeps its state in ``page_state``: where, in chunks of how many bytes, by leaf or whole
    (its leaves dense where a member reduces: paged state comes back dense, ``page_state`` says why that counts)."""
    recipe = draw(recipes())
    members = recipe["members"] + (recipe["partition"][1] if recipe["partition"] else [])
    if any(name in REDUCING for name, _, _ in members):  # page_state's one exception: dense leaves only
        for kind in recipe["leaves"].values():
            kind["layout"] = "dense"
    recipe["storage"] = draw(st.sampled_from(["host", "disk"]))
    recipe["chunk_bytes"] = draw(st.sampled_from([1, 4096, 1 << 26]))
    recipe["per_leaf"] = draw(st.sampled_from([None, False]))
    return recipe


@pytest.mark.skipif(_cpu_kernel._compiler() is None, reason="the generated kernel needs a C++ compiler")
@given(recipe=paged_recipes())
def test_a_paged_chain_steps_as_its_chain_in_memory_bit_for_bit(recipe: dict[str, Any], tmp_path_factory):
    """``page_state`` of a composed chain, on the generated kernel, gives the params of the chain's eager path."""
    inner = _build(recipe)
    path = tmp_path_factory.mktemp("paged") / "state" if recipe["storage"] == "disk" else None
    tx = fadam.page_state(
        inner, storage=recipe["storage"], path=path, chunk_bytes=recipe["chunk_bytes"], per_leaf=recipe["per_leaf"]
    )
    params = _params(recipe)
    eager = (params, inner.init(params))
    kernel_params = _params(recipe)
    paged = (kernel_params, tx.init(kernel_params))
    with fadam.backend("kernel"):
        for step in range(3):
            grads = _step_grads(recipe, eager[0], step)
            eager = _eager_step(inner, _strided_like(eager[0], paged[0]), grads, eager[1])
            if recipe["mode"] == "update":
                updates, state = tx.update(grads, paged[1], paged[0])
                paged = fadam.apply_updates(paged[0], updates), state
            else:
                paged = fadam.step(tx, paged[0], grads, paged[1], donate=recipe["mode"] == "donated step")
            assert _mismatches(paged[0], eager[0], equal_nan=True) == [], f"step {step}"
