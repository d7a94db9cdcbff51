"""Schedules: optax's values for the same arguments, tensor-only control flow (vmap, one compilation), and
schedules accepted wherever a learning rate or weight decay is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fadam
from fadam import schedules

REFERENCE = json.loads((Path(__file__).parent / "data" / "optax_schedules.json").read_text())
STEPS = REFERENCE["steps"]


def _kwargs(case: dict) -> dict:
    kwargs = dict(case["kwargs"])
    if "boundaries_and_scales" in kwargs:
        kwargs["boundaries_and_scales"] = {int(step): scale for step, scale in kwargs["boundaries_and_scales"]}
    return kwargs


def _case_id(case: dict) -> str:
    return case["name"] + ":" + ",".join(f"{k}={v}" for k, v in case["kwargs"].items() if k != "cosine_kwargs")


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=_case_id)
def test_matches_optax_float64_values(case):
    # References were computed by optax 0.2.8 in float64 (scripts/optax_schedule_reference.py).
    schedule = getattr(schedules, case["name"])(**_kwargs(case))
    got = [schedule(torch.tensor(step, dtype=torch.int32)) for step in STEPS]
    assert all(value.dtype == torch.float64 and value.shape == () for value in got)
    torch.testing.assert_close(torch.stack(got), torch.tensor(case["values"], dtype=torch.float64), rtol=1e-13, atol=0)


def test_every_optax_schedule_name_is_covered_and_exported():
    names = {case["name"] for case in REFERENCE["cases"]}
    assert names == set(schedules.__all__) - {"join_schedules"}
    for name in schedules.__all__:
        assert getattr(fadam, name) is getattr(schedules, name)
        assert name in fadam.__all__


def test_join_schedules_counts_each_piece_from_its_boundary():
    schedule = fadam.join_schedules(
        [fadam.constant_schedule(1.0), fadam.linear_schedule(2.0, 0.0, 10), fadam.constant_schedule(5.0)], [3, 8]
    )
    got = [float(schedule(torch.tensor(t, dtype=torch.int32))) for t in range(10)]
    assert got == [1.0, 1.0, 1.0, 2.0, 1.8, 1.6, 1.4, 1.2, 5.0, 5.0]
    with pytest.raises(ValueError, match="one more schedule than boundaries"):
        fadam.join_schedules([fadam.constant_schedule(1.0)], [3])


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="decay_steps"):
        fadam.cosine_decay_schedule(1.0, 0)
    with pytest.raises(ValueError, match="non-negative"):
        fadam.piecewise_constant_schedule(1.0, {10: -0.5})
    with pytest.raises(ValueError, match="interpolate_type"):
        fadam.piecewise_interpolate_schedule("cubic", 1.0)
    with pytest.raises(ValueError, match="transition_steps"):
        fadam.linear_onecycle_schedule(0, 1.0)


def _all_schedules() -> list[tuple[str, fadam.Schedule]]:
    return [(_case_id(case), getattr(schedules, case["name"])(**_kwargs(case))) for case in REFERENCE["cases"]]


def test_under_vmap_a_batch_of_steps_gives_each_steps_value():
    steps = torch.tensor(STEPS, dtype=torch.int32)
    for name, schedule in _all_schedules():
        batched = torch.func.vmap(schedule)(steps)
        one_by_one = torch.stack([torch.as_tensor(schedule(s)) for s in steps])
        # vectorized pow/cos over a batch may round 1 ulp apart from the 0-d computation
        torch.testing.assert_close(batched, one_by_one, rtol=1e-15, atol=0, msg=name)


@pytest.mark.slow
def test_compiled_once_for_all_steps():
    # fullgraph=True fails on any graph break (a .item() or a Python branch on the step); the frame counter shows that
    # changing the step does not recompile.
    from torch._dynamo.testing import CompileCounter

    picks = {"warmup_cosine_decay_schedule", "piecewise_interpolate_schedule", "exponential_decay", "sgdr_schedule"}
    for name, schedule in _all_schedules():
        if name.split(":")[0] not in picks:
            continue
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(schedule, backend=counter, fullgraph=True, dynamic=False)
        for step in (0, 7, 60, 1000):
            step_tensor = torch.tensor(step, dtype=torch.int32)
            assert torch.equal(compiled(step_tensor), schedule(step_tensor)), name
        assert counter.frame_count == 1, name


def test_python_int_steps_and_tensor_values():
    init_value = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    value = fadam.linear_schedule(init_value, 0.0, 10)(5)
    value.backward()
    assert float(value.detach()) == 0.5
    assert float(init_value.grad) == 0.5


def test_weight_decay_schedules_in_transforms_and_aliases():
    params = {"w": torch.tensor([1.0, -2.0])}
    grads = {"w": torch.tensor([0.5, 0.5])}
    wd = fadam.linear_schedule(0.1, 0.0, 2)  # 0.1, 0.05, 0.0

    tx = fadam.add_decayed_weights(wd)
    state = tx.init(params)
    expected = [0.1, 0.05, 0.0]
    for decay in expected:
        updates, state = tx.update(grads, state, params)
        torch.testing.assert_close(updates["w"], grads["w"] + decay * params["w"], rtol=0, atol=0)
    assert int(state.count) == 3

    tx = fadam.add_decoupled_weight_decay(0.5, wd)
    state = tx.init(params)
    for decay in expected:
        updates, state = tx.update(grads, state, params)
        new = fadam.apply_updates(params, updates)["w"]
        torch.testing.assert_close(new, params["w"] * (1 - 0.5 * decay) + grads["w"], rtol=1e-7, atol=0)

    # The aliases take a weight decay schedule too: the first step decays by 0.1, the third by 0.
    for alias in (fadam.adam, fadam.adamw, fadam.sgd):
        scheduled = alias(lr=0.1, weight_decay=wd)
        state = scheduled.init(params)
        first, state = scheduled.update(grads, state, params)
        plain = alias(lr=0.1, weight_decay=0.1)
        want = plain.update(grads, plain.init(params), params)[0]
        torch.testing.assert_close(first["w"], want["w"], rtol=1e-7, atol=0)
        # fadam.step cannot use the fused kernel with a scheduled decay; it falls back to the same update.
        stepped, _ = fadam.step(scheduled, params, grads, scheduled.init(params))
        assert torch.equal(stepped["w"], fadam.apply_updates(params, first)["w"])


def test_scheduled_updates_keep_the_dtype_of_zero_dim_params():
    # a schedule's value is a 0-d float64 tensor; a 0-d float32 update must not be promoted by it
    params = {"scalar": torch.tensor(2.0), "w": torch.ones(3, dtype=torch.bfloat16)}
    grads = {"scalar": torch.tensor(0.5), "w": torch.ones(3, dtype=torch.bfloat16)}
    wd = fadam.constant_schedule(0.1)
    for tx in (fadam.adam(lr=fadam.constant_schedule(0.1), weight_decay=wd), fadam.adamw(lr=wd, weight_decay=wd)):
        updates, _ = tx.update(grads, tx.init(params), params)
        assert {k: u.dtype for k, u in updates.items()} == {"scalar": torch.float32, "w": torch.bfloat16}
