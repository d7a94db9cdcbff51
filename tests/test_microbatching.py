"""microbatch against optax's outputs (tests/data/optax_catalogue.json, "microbatch": computed by optax 0.2.8 in
float64 by scripts/optax_catalogue_reference.py on the inputs stored beside them), and its contracts for torch:
errors, autograd and torch.func."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fadam

REFERENCE = json.loads((Path(__file__).parent / "data" / "optax_catalogue.json").read_text())["microbatch"]
INPUTS = {name: torch.tensor(v, dtype=torch.float64) for name, v in REFERENCE["inputs"].items()}
RTOL, ATOL = 1e-10, 1e-14


def _loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The reference's weighted squared error of a tanh layer; ``s`` has its batch axis second."""
    return 0.5 * (s.T * (torch.tanh(x @ w) - y) ** 2).sum()


def _outputs(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *, s: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": _loss(w, x, y, s), "pred": torch.tanh(x @ w), "rows": torch.tensor(x.shape[0])}


def _gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *, s: torch.Tensor) -> torch.Tensor:
    return torch.func.grad(_loss)(w, x, y, s)


LARGEST = fadam.Accumulator(
    init=lambda value: torch.full_like(value, -torch.inf),
    update=lambda carry, value, _: torch.maximum(carry, value),
    finalize=lambda carry: carry,
)


def _accumulator(spec: Any) -> Any:
    if isinstance(spec, dict):
        return {key: _accumulator(value) for key, value in spec.items()}
    return LARGEST if spec == "LARGEST" else getattr(fadam.AccumulationType, spec)


def _run(case: dict) -> Any:
    fun = fadam.microbatch(
        {"outputs": _outputs, "gradient": _gradient}[case["function"]],
        (1, 2),
        case["microbatch_size"],
        _accumulator(case["accumulator"]),
        argnames="s",
        in_axes=(0, 0, 1),
        num_real_microbatches=case.get("num_real_microbatches"),
    )
    return fun(INPUTS["w"], INPUTS["x"], INPUTS["y"], s=INPUTS["s"])


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda case: case["name"])
def test_microbatch_matches_optax(case):
    got, want = _run(case), case["result"]
    if case["function"] == "gradient":
        got, want = {"grad": got}, {"grad": want}
    assert set(got) == set(want)
    for name, value in got.items():
        expected = torch.tensor(want[name], dtype=value.dtype)
        torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL, msg=f"{case['name']}: {name}")


def test_the_reference_comparison_can_fail():
    case = next(case for case in REFERENCE["cases"] if case["name"] == "mean-concat-sum")
    changed = {**case, "accumulator": {"loss": "SUM", "pred": "CONCAT", "rows": "SUM"}}
    assert not torch.allclose(_run(changed)["loss"], torch.tensor(case["result"]["loss"], dtype=torch.float64))


def test_microbatches_take_strided_rows_and_concat_restores_the_order():
    x = torch.arange(12.0).reshape(6, 2)
    assert fadam.reshape_batch_axis(x, 2)[1].tolist() == [[2.0, 3.0], [8.0, 9.0]]  # rows 1 and 1 + 3
    assert fadam.reshape_batch_axis(x.T, 2, axis=1).shape == (2, 3, 2)
    first_rows = fadam.microbatch(lambda b: b[0], 0, 2, fadam.AccumulationType.CONCAT)(x)
    assert first_rows.tolist() == [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]  # the first row of each microbatch: 0, 1, 2
    whole = fadam.microbatch(lambda b: b * 10, 0, 3, fadam.AccumulationType.CONCAT)(x)
    assert torch.equal(whole, x * 10)
    skipped = fadam.microbatch(lambda b: b, 0, 2, fadam.AccumulationType.CONCAT, num_real_microbatches=2)(x)
    assert skipped[[2, 5]].eq(0).all() and torch.equal(skipped[[0, 1, 3, 4]], x[[0, 1, 3, 4]])


def test_microbatch_keeps_none_outputs_and_returns_fun_without_a_size():
    fun = fadam.microbatch(lambda b: (b.sum(), None), 0, 1)
    total, nothing = fun(torch.arange(4.0))
    assert float(total) == 6.0 and nothing is None

    def f(b):
        return b

    assert fadam.microbatch(f, 0, None) is f


def test_microbatch_refuses_bad_input_before_evaluating():
    calls = []

    def fun(a, b=None):
        calls.append(a.shape)
        return a.sum()

    with pytest.raises(ValueError, match="equal-size batch axes"):
        fadam.microbatch(fun, (0, 1), 2)(torch.ones(4), torch.ones(6))
    with pytest.raises(ValueError, match="divisible"):
        fadam.microbatch(fun, 0, 3)(torch.ones(4))
    with pytest.raises(ValueError, match="num_real_microbatches"):
        fadam.microbatch(fun, 0, 2, num_real_microbatches=3)(torch.ones(4))
    with pytest.raises(ValueError, match="not given"):
        fadam.microbatch(fun, 0, 2, argnames="b")(torch.ones(4))
    with pytest.raises(ValueError, match="in_axes"):
        fadam.microbatch(fun, 0, 2, in_axes=-1)
    with pytest.raises(ValueError, match="microbatch_size"):
        fadam.microbatch(fun, 0, 0)
    assert calls == []
    with pytest.raises(ValueError, match="floating-point"):
        fadam.microbatch(lambda a: a.sum(), 0, 2, fadam.AccumulationType.MEAN)(torch.arange(4))
    with pytest.raises(ValueError, match="Unknown accumulator"):
        fadam.microbatch(lambda a: a.sum(), 0, 2, "SUM")(torch.ones(4))


def test_microbatched_loss_is_differentiable_and_vmappable():
    w, x, y, s = (INPUTS[k] for k in ("w", "x", "y", "s"))

    def loss(w: torch.Tensor) -> torch.Tensor:
        return fadam.microbatch(_loss, (1, 2, 3), 2, in_axes=(0, 0, 1))(w, x, y, s)

    torch.testing.assert_close(torch.func.grad(loss)(w), torch.func.grad(_loss)(w, x, y, s), rtol=1e-12, atol=0)
    ws = torch.stack([w, 2 * w, -w])
    torch.testing.assert_close(torch.func.vmap(loss)(ws), torch.stack([_loss(v, x, y, s) for v in ws]))
    concat = fadam.microbatch(lambda b, v: torch.tanh(b @ v), 0, 3, fadam.AccumulationType.CONCAT)
    torch.testing.assert_close(torch.func.vmap(lambda v: concat(x, v))(ws), torch.tanh(x @ ws))
    leaf = w.clone().requires_grad_(True)
    loss(leaf).backward()  # autograd through the Python loop: the sum of the microbatches' graphs
    torch.testing.assert_close(leaf.grad, torch.func.grad(_loss)(w, x, y, s), rtol=1e-12, atol=0)
