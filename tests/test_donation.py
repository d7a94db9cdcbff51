"""Donated steps write only their own params' elements and never mix two leaves' updates.

``fadam.step(..., donate=True)``, and ``fadam.Optimizer``, which always donates, may write results into the buffers of
params and state. The fused kernels walk a leaf's tensors as flat arrays of one layout, so a leaf with a
non-contiguous tensor takes the general path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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
