"""Donated steps write only their own params' elements and never mix two leaves' updates.

``fadam.step(..., donate=True)``, and ``fadam.Optimizer``, which always donates, may write results into the buffers of
params and state. The fused kernels walk a leaf's tensors as flat arrays of one layout, so a leaf with a
non-contiguous tensor takes the general path; leaves that share memory get the results of the step without donation.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch

import fadam
from tests.tree_checks import tensor_leaves

SHAPE = (64, 128)  # 8192 elements: the quantized aliases quantize the state of params of at least 4096 (min_size)
STEPS = 3

DONATED: dict[str, Callable[[], fadam.GradientTransformation]] = {
    "adam": lambda: fadam.adam(1e-2),
    "adamw": lambda: fadam.adamw(1e-2, weight_decay=0.1),
    "sgd-momentum": lambda: fadam.sgd(1e-2, momentum=0.9),
    "sgd-nesterov": lambda: fadam.sgd(1e-2, momentum=0.9, nesterov=True),
    "adagrad": lambda: fadam.adagrad(1e-1),
    "adamw8bit": lambda: fadam.adamw8bit(1e-2),
    "adam4bit": lambda: fadam.adam4bit(1e-2),
    "paged_adamw": lambda: fadam.paged_adamw(1e-2),  # host storage
    "chain": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-2)),
    "lion": lambda: fadam.lion(1e-3),
}
PAGED = {"paged_adamw"}  # a state that is a handle to host buffers: its params are compared, not its state
QUANTIZED = {"adamw8bit", "adam4bit"}
LAYOUTS = ["strided param", "transposed param", "transposed grad", "transposed state"]


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _layout(layout: str, gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(param, grads, like, outside)``: a param of ``SHAPE``, a gradient for each step, the tensor the state is
    initialized from (its layout is the state's), and the part of the param's storage outside it."""
    grads = [_randn(gen, *SHAPE) for _ in range(STEPS)]
    if layout == "strided param":
        base = _randn(gen, SHAPE[0], 2 * SHAPE[1])
        return base[:, ::2], grads, base[:, ::2], base[:, 1::2]
    if layout == "transposed param":
        param = _randn(gen, SHAPE[1], SHAPE[0]).t()
        return param, grads, param, param[:0]
    param = _randn(gen, *SHAPE)
    if layout == "transposed grad":
        return param, [_randn(gen, SHAPE[1], SHAPE[0]).t() for _ in range(STEPS)], param, param[:0]
    return param, grads, _contiguous_copy(param.t()).t(), param[:0]  # "transposed state"


def _assert_states_equal(actual: Any, expected: Any, atol: float = 0.0) -> None:
    """Equal tensor leaves, within ``atol`` for floating ones."""
    actual_leaves, expected_leaves = tensor_leaves(actual), tensor_leaves(expected)
    assert [path for path, _ in actual_leaves] == [path for path, _ in expected_leaves]
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves):
        if atol and a.is_floating_point():
            torch.testing.assert_close(a, e, rtol=0, atol=atol, msg=path)
        else:
            assert torch.equal(a, e), path


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "pure"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", DONATED)
def test_a_non_contiguous_leaf_steps_as_its_contiguous_copy(name, layout, donate):
    """A leaf with a non-contiguous param, gradient or state moment gives the numbers of the same steps on contiguous
    copies, bit for bit those of ``tx.update`` and ``apply_updates`` where it takes that path at every step, and
    writes nothing outside its param: the fused kernels, which would read and write it as a flat array, do not run on
    it."""
    tx = DONATED[name]()
    param, grads, like, outside = _layout(layout, torch.Generator().manual_seed(0))
    param_before, outside_before = param.clone(), outside.clone()
    params, state = {"w": param}, tx.init({"w": like})
    general = {"w": _contiguous_copy(param)}
    general_state = tx.init(general)
    fused = {"w": _contiguous_copy(param)}
    fused_state = tx.init(fused)
    for g in grads:
        params, state = fadam.step(tx, params, {"w": g}, state, donate=donate)
        updates, general_state = tx.update({"w": _contiguous_copy(g)}, general_state, general)
        general = fadam.apply_updates(general, updates)
        fused, fused_state = fadam.step(tx, fused, {"w": _contiguous_copy(g)}, fused_state, donate=True)
    # a fused kernel rounds otherwise; a param stepped out of place, or a state moment, may come back contiguous and
    # take the fused kernel from then on
    for reference, reference_state in ((general, general_state), (fused, fused_state)):
        torch.testing.assert_close(params["w"], reference["w"], rtol=0, atol=1e-6)
        if name not in PAGED:
            _assert_states_equal(state, reference_state, atol=1e-6)
    if donate:
        assert params["w"] is param
    else:
        assert torch.equal(param, param_before)
    assert torch.equal(outside, outside_before)
    if donate and layout != "transposed state":  # a non-contiguous param or gradient at every step: the general path
        assert torch.equal(params["w"], general["w"])
        if name not in PAGED:
            _assert_states_equal(state, general_state)


TIES = ["one tensor", "state_dict", "overlapping slices"]


def _tied_params(tie: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    if tie == "one tensor":
        w = _randn(gen, *SHAPE)
        return {"a": w, "b": w}
    if tie == "state_dict":  # tied weights: a module's state_dict holds one detached tensor per name, on one storage
        embedding = torch.nn.Embedding(*SHAPE)
        head = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)
        head.weight = embedding.weight
        with torch.no_grad():
            embedding.weight.copy_(_randn(gen, *SHAPE))
        tensors = torch.nn.ModuleDict({"embedding": embedding, "head": head}).state_dict()
        return {"a": tensors["embedding.weight"], "b": tensors["head.weight"]}
    big = _randn(gen, SHAPE[0] + SHAPE[0] // 2, SHAPE[1])  # "overlapping slices": rows 32 to 63 in both
    return {"a": big[: SHAPE[0]], "b": big[SHAPE[0] // 2 :]}


Grads = Callable[[int, Any], Any]  # grads(step, params): the gradients of a step


def _pair_grads(gen: torch.Generator) -> Grads:
    """A gradient for each of params "a" and "b" at each step."""
    grads = [{"a": _randn(gen, *SHAPE), "b": _randn(gen, *SHAPE)} for _ in range(STEPS)]
    return lambda i, params: grads[i]


def _run(tx, params, state, grads: Grads, donate: bool, aliased_steps: set[int]) -> tuple[Any, Any]:
    """``STEPS`` steps; a donated step in ``aliased_steps`` must warn that its leaves share memory."""
    for i in range(STEPS):
        g = grads(i, params)
        if donate and i in aliased_steps:
            with pytest.warns(UserWarning, match="share memory"):
                params, state = fadam.step(tx, params, g, state, donate=True)
        else:
            params, state = fadam.step(tx, params, g, state, donate=donate)
    return params, state


def _assert_runs_equal(name: str, donated: tuple[Any, Any], pure: tuple[Any, Any]) -> None:
    for key in ("a", "b"):
        assert torch.equal(donated[0][key], pure[0][key]), key
    if name not in PAGED:
        _assert_states_equal(donated[1], pure[1])


@pytest.mark.parametrize("tie", TIES)
@pytest.mark.parametrize("name", DONATED)
def test_tied_params_get_the_pure_steps_results(name, tie):
    """Two params on one buffer (one tensor at two leaves, a tied module's state_dict, slices that overlap) are stepped
    as the pure step steps them, each with its own gradient and state, and the shared buffer is left as it was. The
    state has run a few steps first, so momentum and second moments differ between the two leaves."""
    tx = DONATED[name]()
    runs = []
    for donate in (True, False):  # each run from its own init: a paged state is a handle to its own buffers
        gen = torch.Generator().manual_seed(0)
        tied = _tied_params(tie, gen)
        separate = {k: p.clone() for k, p in tied.items()}
        state = _run(tx, {k: p.clone() for k, p in tied.items()}, tx.init(separate), _pair_grads(gen), False, set())[1]
        params = tied if donate else separate
        before = {k: p.clone() for k, p in tied.items()}
        runs.append(_run(tx, params, state, _pair_grads(gen), donate, aliased_steps={0}))
        for key in tied:
            assert torch.equal(tied[key], before[key]), key
    _assert_runs_equal(name, *runs)


@pytest.mark.parametrize("name", DONATED)
def test_a_gradient_that_is_a_param_is_read_as_it_was(name):
    """A gradient that is another leaf's param is read with that param's value before the step, as the pure step reads
    it, not after a kernel has written the param."""
    tx = DONATED[name]()
    runs = []
    for donate in (True, False):
        gen = torch.Generator().manual_seed(0)
        params = {"a": _randn(gen, *SHAPE), "b": _randn(gen, *SHAPE)}
        state = tx.init(params)
        pair = _pair_grads(gen)

        def grads(i: int, params: Any, pair: Grads = pair) -> Any:
            return {"a": pair(i, params)["a"], "b": params["a"]}

        runs.append(_run(tx, params, state, grads, donate, set(range(STEPS))))
    _assert_runs_equal(name, *runs)


def test_the_aliasing_warning_names_gradients_given_as_another_kind_of_mapping():
    # the step checks the trees once: the gradients, a dict, are paired with OrderedDict params by key, and the
    # warning names the leaf by its key, not by its position in either tree
    params = collections.OrderedDict([("b", torch.randn(3)), ("a", torch.randn(3))])
    grads = {"a": torch.randn(3), "b": params["a"]}
    tx = fadam.sgd(0.1, momentum=0.9)
    expected, _ = fadam.step(tx, params, grads, tx.init(params))
    with pytest.warns(UserWarning, match=r"params\['a'\] and grads\['b'\] share memory"):
        stepped, _ = fadam.step(tx, params, grads, tx.init(params), donate=True)
    assert list(stepped) == ["b", "a"] and all(torch.equal(stepped[k], expected[k]) for k in params)


def _share_b_with_a(state: Any) -> Any:
    """``state`` with each tensor of param "b" replaced by the equal one of param "a" (one tensor at both leaves)."""
    paths, leaves, spec = optree.tree_flatten_with_path(state, none_is_leaf=True)
    index = {path: i for i, path in enumerate(paths)}
    shared = 0
    for i, path in enumerate(paths):
        twin = index.get(tuple("a" if key == "b" else key for key in path))
        if "b" in path and twin is not None and isinstance(leaves[i], torch.Tensor) and leaves[i].numel() > 1:
            assert torch.equal(leaves[i], leaves[twin])
            leaves[i] = leaves[twin]
            shared += 1
    assert shared
    return spec.unflatten(leaves)


@pytest.mark.parametrize("name", sorted(set(DONATED) - PAGED))
def test_a_state_leaf_shared_by_two_params_gets_both_updates_apart(name):
    """Init state where one tensor holds both params' moments (equal at init): each param's moments are updated apart,
    as the pure step updates them."""
    tx = DONATED[name]()
    runs = []
    for donate in (True, False):
        gen = torch.Generator().manual_seed(0)
        params = {"a": _randn(gen, *SHAPE), "b": _randn(gen, *SHAPE)}
        runs.append(_run(tx, params, _share_b_with_a(tx.init(params)), _pair_grads(gen), donate, {0}))
    _assert_runs_equal(name, *runs)


@pytest.mark.parametrize("name", sorted(set(DONATED) - PAGED - QUANTIZED))  # their moments are codes, not param-sized
def test_a_state_leaf_that_is_a_param_is_not_written_as_the_param(name):
    """A state tensor of param "a" that is param "b" itself: the step reads it as state and as a param, each with the
    value it had, and writes neither into the other."""
    tx = DONATED[name]()
    runs = []
    for donate in (True, False):
        gen = torch.Generator().manual_seed(0)
        params = {"a": _randn(gen, *SHAPE), "b": torch.rand(SHAPE, generator=gen)}  # >= 0: a valid second moment
        paths, leaves, spec = optree.tree_flatten_with_path(tx.init(params), none_is_leaf=True)
        first = next(
            i
            for i, (path, leaf) in enumerate(zip(paths, leaves))
            if "a" in path and isinstance(leaf, torch.Tensor) and leaf.shape == SHAPE
        )
        leaves[first] = params["b"]
        runs.append(_run(tx, params, spec.unflatten(leaves), _pair_grads(gen), donate, {0}))
    _assert_runs_equal(name, *runs)


TORCH_EQUIVALENTS = {
    "adam": (fadam.adam, torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (fadam.adamw, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd-momentum": (fadam.sgd, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "sgd-nesterov": (fadam.sgd, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "adagrad": (fadam.adagrad, torch.optim.Adagrad, {"lr": 1e-1}),
}


@pytest.mark.parametrize("layout", ["strided param", "transposed param"])
@pytest.mark.parametrize("name", TORCH_EQUIVALENTS)
def test_optimizer_steps_a_non_contiguous_param_as_torch_optim(name, layout):
    """``fadam.Optimizer`` on a param that is a strided view or a transpose, with contiguous gradients, follows
    torch.optim's trajectory for the same param, and leaves the rest of the param's storage as it was."""
    make, torch_cls, kwargs = TORCH_EQUIVALENTS[name]
    gen = torch.Generator().manual_seed(0)
    param, grads, _, outside = _layout(layout, gen)
    outside_before = outside.clone()
    ours = torch.nn.Parameter(param)  # the view itself: a Parameter shares its data's storage
    theirs = torch.nn.Parameter(param.detach().clone())
    factory = functools.partial(make, **{k: v for k, v in kwargs.items() if k != "lr"})
    optimizer = fadam.Optimizer([ours], factory, lr=kwargs["lr"])
    reference = torch_cls([theirs], foreach=False, **kwargs)
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    torch.testing.assert_close(ours.detach(), theirs.detach())
    assert torch.equal(outside, outside_before)


@pytest.mark.slow
def test_a_compiled_donated_step_writes_a_strided_param_in_its_own_elements():
    """Compiled, the step copies its results into the donated buffers (``_write_into``), which inductor writes through
    a strided param's own strides."""
    tx = fadam.sgd(1e-2, momentum=0.9)
    param, grads, _, outside = _layout("strided param", torch.Generator().manual_seed(0))
    outside_before = outside.clone()
    expected = {"w": _contiguous_copy(param)}
    expected_state = tx.init(expected)
    compiled = torch.compile(lambda p, g, s: fadam.step(tx, p, g, s, donate=True))
    params, state = {"w": param}, tx.init({"w": param})
    for g in grads:
        params, state = compiled(params, {"w": g}, state)
        expected, expected_state = fadam.step(tx, expected, {"w": g}, expected_state)
    assert params["w"].data_ptr() == param.data_ptr()
    torch.testing.assert_close(params["w"], expected["w"], rtol=0, atol=1e-6)
    assert torch.equal(outside, outside_before)
