"""Robustness wrappers: apply_if_finite, MultiSteps (+ skip functions), zero_nans, freeze, selective_transform."""

from __future__ import annotations

import functools

import optree
import pytest
import torch

import fadam

NAN = float("nan")


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}


def _grads(step: int, bad: float | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    grads = {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}
    if bad is not None:
        grads["b"][2] = bad
    return grads


def _leaves_equal(a, b) -> bool:
    fa, fb = optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)
    return len(fa) == len(fb) and all(torch.equal(x, y) for x, y in zip(fa, fb))


@pytest.mark.parametrize("bad", [NAN, float("inf"), -float("inf")])
def test_apply_if_finite_skips_and_counts(bad):
    params = _params()
    inner = fadam.adam(lr=0.1)
    tx = fadam.apply_if_finite(inner, max_consecutive_errors=2)
    state, inner_state = tx.init(params), inner.init(params)
    # a finite step is the inner step, bit for bit
    updates, state = tx.update(_grads(0), state, params)
    want, inner_state = inner.update(_grads(0), inner_state, params)
    assert _leaves_equal(updates, want) and _leaves_equal(state.inner_state, inner_state)
    # two non-finite steps are skipped: zero updates, inner state as it was, counted
    for expected in (1, 2):
        updates, state = tx.update(_grads(1, bad), state, params)
        assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
        assert _leaves_equal(state.inner_state, inner_state)
        assert (int(state.notfinite_count), int(state.total_notfinite), bool(state.last_finite)) == (
            expected,
            expected,
            False,
        )
    # the third in a row exceeds max_consecutive_errors=2 and goes through
    updates, state = tx.update(_grads(1, bad), state, params)
    assert not torch.isfinite(updates["b"]).all()
    assert int(state.inner_state[0].count) == 2
    # a finite step resets the consecutive count, not the total
    _, state = tx.update(_grads(2), state, params)
    assert (int(state.notfinite_count), int(state.total_notfinite), bool(state.last_finite)) == (0, 3, True)
    assert state.notfinite_count.dtype == torch.int32 and state.last_finite.dtype == torch.bool


def test_apply_if_finite_under_vmap_selects_without_reading_the_flag():
    # Batched flags cannot be read: the traced path (torch.where) must give what the eager branch gives.
    tx = fadam.apply_if_finite(fadam.adam(lr=0.1), max_consecutive_errors=5)
    batch = torch.randn(3, 6)
    grads = torch.randn(4, 3, 6)
    grads[1, 0, 2] = NAN  # example 0 has a NaN at step 1
    grads[2, 2, 0] = float("inf")  # example 2 at step 2

    def run(p: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = tx.init({"w": p})
        for g in gs:
            updates, state = tx.update({"w": g}, state, {"w": p})
            p = fadam.apply_updates({"w": p}, updates)["w"]
        return p, state.total_notfinite

    got_p, got_total = torch.func.vmap(run, in_dims=(0, 1))(batch, grads)
    for i in range(3):
        want_p, want_total = run(batch[i], grads[:, i])
        torch.testing.assert_close(got_p[i], want_p, rtol=1e-6, atol=1e-7)
        assert int(got_total[i]) == int(want_total)
    assert got_total.tolist() == [1, 0, 1]


def test_multisteps_means_k_gradients_then_steps_once():
    params = _params()
    inner = fadam.adam(lr=0.1)
    opt = fadam.MultiSteps(inner, every_k_schedule=3)
    state, inner_state = opt.init(params), inner.init(params)
    p, p_ref = params, params
    flags = []
    for outer in range(3):
        grads = [_grads(3 * outer + i) for i in range(3)]
        for g in grads:
            updates, state = opt.update(g, state, p)
            p = fadam.apply_updates(p, updates)
            flags.append(bool(opt.has_updated(state)))
        mean = {k: sum(g[k] for g in grads) / 3 for k in params}
        ref_updates, inner_state = inner.update(mean, inner_state, p_ref)
        p_ref = fadam.apply_updates(p_ref, ref_updates)
        for k in params:
            torch.testing.assert_close(p[k], p_ref[k], rtol=1e-6, atol=1e-6)
    assert flags == [False, False, True] * 3
    assert int(state.gradient_step) == 3 and int(state.mini_step) == 0
    assert all(torch.equal(a, torch.zeros_like(a)) for a in state.acc_grads.values())


def test_multisteps_sum_mode_is_exact_and_keeps_one_accumulator():
    params = _params()
    opt = fadam.MultiSteps(fadam.sgd(lr=1.0), every_k_schedule=2, use_grad_mean=False)
    state = opt.init(params)
    # sgd without momentum keeps no param-sized state: the accumulator is the only buffer
    sizes = [x.numel() for x in optree.tree_leaves(state, none_is_leaf=True)]
    assert sum(sizes) == sum(x.numel() for x in params.values()) + 2  # + mini_step and gradient_step
    u0, state = opt.update(_grads(0), state, params)
    u1, state = opt.update(_grads(1), state, params)
    for k in params:
        assert torch.equal(u0[k], torch.zeros_like(u0[k]))
        assert torch.equal(u1[k], -(_grads(0)[k] + _grads(1)[k]))


def test_multisteps_schedule_dtype_and_gradient_transformation():
    params = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    opt = fadam.MultiSteps(
        fadam.sgd(lr=1.0), every_k_schedule=lambda step: 1 if step == 0 else 2, accumulator_dtype=torch.float32
    )
    tx = opt.gradient_transformation()
    state = tx.init(params)
    assert state.acc_grads["w"].dtype == torch.float32
    emitted = []
    for i in range(5):
        updates, state = tx.update({"w": torch.full((4,), float(i + 1), dtype=torch.bfloat16)}, state, params)
        emitted.append(bool(opt.has_updated(state)))
        assert updates["w"].dtype == torch.bfloat16
    assert emitted == [True, False, True, False, True]  # k=1 for the first inner step, then 2
    assert float(updates["w"][0]) == -4.5  # mean of 4 and 5


def test_multisteps_skip_functions_leave_the_state_as_it_was():
    params = _params()
    opt = fadam.MultiSteps(fadam.adam(lr=0.1), 2, should_skip_update_fn=fadam.skip_not_finite)
    state = opt.init(params)
    _, state = opt.update(_grads(0), state, params)
    before = state
    updates, state = opt.update(_grads(1, NAN), state, params)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    assert _leaves_equal(
        (state.mini_step, state.inner_opt_state, state.acc_grads),
        (before.mini_step, before.inner_opt_state, before.acc_grads),
    )
    assert int(state.skip_state["num_not_finite"]) == 1 and bool(state.skip_state["should_skip"])

    skip = functools.partial(fadam.skip_large_updates, max_squared_norm=1.0)
    opt = fadam.MultiSteps(fadam.sgd(lr=1.0), 1, should_skip_update_fn=skip)
    state = opt.init(params)
    small = {k: torch.full_like(v, 0.01) for k, v in params.items()}
    updates, state = opt.update(small, state, params)
    assert torch.equal(updates["w"], -small["w"]) and not bool(state.skip_state["should_skip"])
    updates, state = opt.update(_grads(0), state, params)
    assert torch.equal(updates["w"], torch.zeros_like(updates["w"])) and int(state.gradient_step) == 1
    torch.testing.assert_close(state.skip_state["norm_squared"], sum((g**2).sum() for g in _grads(0).values()))


def test_multisteps_under_vmap_with_batched_skip_decisions():
    opt = fadam.MultiSteps(fadam.sgd(lr=1.0, momentum=0.5), 2, should_skip_update_fn=fadam.skip_not_finite)
    batch = torch.randn(2, 3)
    grads = torch.randn(4, 2, 3)
    grads[1, 1, 0] = NAN

    def run(p: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
        state = opt.init({"w": p})
        for g in gs:
            updates, state = opt.update({"w": g}, state, {"w": p})
            p = fadam.apply_updates({"w": p}, updates)["w"]
        return p

    got = torch.func.vmap(run, in_dims=(0, 1))(batch, grads)
    for i in range(2):
        torch.testing.assert_close(got[i], run(batch[i], grads[:, i]), rtol=1e-6, atol=1e-7)


def test_multisteps_rejects_bad_arguments():
    with pytest.raises(ValueError, match="every_k_schedule"):
        fadam.MultiSteps(fadam.sgd(), 0)
    opt = fadam.MultiSteps(fadam.sgd(), 2, should_skip_update_fn=lambda u, s, p: (1.0, ()))
    with pytest.raises(ValueError, match="0-d bool tensor"):
        opt.update({"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}), {"w": torch.ones(1)})
    with pytest.raises(ValueError, match="shape"):
        opt.update({"w": torch.ones(2)}, opt.init({"w": torch.ones(1)}), {"w": torch.ones(1)})


def test_zero_nans_records_per_leaf():
    tx = fadam.zero_nans()
    params = {"a": torch.zeros(3), "b": torch.zeros(2)}
    state = tx.init(params)
    updates, state = tx.update({"a": torch.tensor([1.0, NAN, float("inf")]), "b": torch.ones(2)}, state)
    assert torch.equal(updates["a"], torch.tensor([1.0, 0.0, float("inf")]))
    assert bool(state.found_nan["a"]) and not bool(state.found_nan["b"])
    _, state = tx.update({"a": torch.ones(3), "b": None}, state)
    assert not bool(state.found_nan["a"]) and not bool(state.found_nan["b"])


def test_freeze_and_selective_transform():
    params = {"encoder": {"w": torch.ones(4, 4)}, "head": {"w": torch.ones(4), "b": torch.ones(1)}}
    grads = fadam.tree_map(lambda p: torch.full_like(p, 0.5), params)
    mask = {"encoder": True, "head": False}
    updates, _ = fadam.freeze(mask).update(grads, fadam.freeze(mask).init(params))
    assert torch.equal(updates["encoder"]["w"], torch.zeros(4, 4)) and torch.equal(
        updates["head"]["b"], grads["head"]["b"]
    )

    tx = fadam.selective_transform(fadam.adam(lr=0.1), freeze_mask=mask)
    state = tx.init(params)
    adam_state = state.inner_states["train"].inner_state[0]
    assert adam_state.mu["encoder"]["w"] == fadam.MaskedNode()  # no state for the frozen leaf
    state_numel = sum(x.numel() for x in fadam.tree_map(lambda x: x, adam_state.mu["head"]).values())
    assert state_numel == 5
    updates, state = tx.update(grads, state, params)
    assert torch.equal(updates["encoder"]["w"], torch.zeros(4, 4))
    head = {"w": params["head"]["w"], "b": params["head"]["b"]}
    want = fadam.adam(lr=0.1).update(grads["head"], fadam.adam(lr=0.1).init(head), head)[0]
    assert torch.equal(updates["head"]["w"], want["w"]) and torch.equal(updates["head"]["b"], want["b"])
    # a callable mask works too
    tx = fadam.selective_transform(fadam.sgd(0.1), freeze_mask=lambda p: {"encoder": True, "head": False})
    assert torch.equal(tx.update(grads, tx.init(params), params)[0]["encoder"]["w"], torch.zeros(4, 4))


def test_fadam_step_keeps_the_inner_fused_kernel():
    params = _params()
    plain, guarded = fadam.adamw(lr=0.1), fadam.apply_if_finite(fadam.adamw(lr=0.1), 3)
    p_plain, s_plain = params, plain.init(params)
    p_guard, s_guard = params, guarded.init(params)
    for step in range(4):
        bad = NAN if step == 2 else None
        p_guard, s_guard = fadam.step(guarded, p_guard, _grads(step, bad), s_guard)
        if bad is None:
            p_plain, s_plain = fadam.step(plain, p_plain, _grads(step), s_plain)
        assert _leaves_equal(p_guard, p_plain) and _leaves_equal(s_guard.inner_state, s_plain)
    assert int(s_guard.total_notfinite) == 1

    opt = fadam.MultiSteps(fadam.adam(lr=0.1), 2).gradient_transformation()
    state = opt.init(params)
    p, mid_state = fadam.step(opt, params, _grads(0), state)
    assert p is params and int(mid_state.mini_step) == 1  # a mini-step returns the params as they are


def test_skip_large_updates_norm_is_accurate_for_bfloat16():
    updates = {"w": torch.full((10_000,), 3.0, dtype=torch.bfloat16), "b": torch.tensor([1.0 + 2.0j])}
    skip, info = fadam.skip_large_updates(updates, torch.tensor(0), None, max_squared_norm=90_006.0)
    assert info["norm_squared"].dtype == torch.float32
    torch.testing.assert_close(info["norm_squared"], torch.tensor(90_005.0), rtol=1e-6, atol=0)
    assert not bool(skip)
    skip, _ = fadam.skip_large_updates(updates, torch.tensor(0), None, max_squared_norm=90_005.0)
    assert bool(skip)  # not strictly below the bound


@pytest.mark.slow
@pytest.mark.parametrize("which", ["multisteps", "apply_if_finite"])
def test_compiled_wrappers_select_without_host_reads(which):
    # Under torch.compile the skip/emit decisions are traced as torch.where selections; the compiled run equals the
    # eager one (which branches in Python), NaN step included, and stops compiling after the first steps.
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    if which == "multisteps":
        tx = fadam.MultiSteps(
            fadam.adam(lr=0.1), 2, should_skip_update_fn=fadam.skip_not_finite
        ).gradient_transformation()
    else:
        tx = fadam.apply_if_finite(fadam.adam(lr=0.1), 2)
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def compiled_step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return fadam.apply_updates(params, updates), state

    params = _params()
    state, eager_params, eager_state = tx.init(params), params, tx.init(params)
    for step in range(6):
        grads = _grads(step, NAN if step == 3 else None)
        params, state = compiled_step(params, grads, state)
        updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = fadam.apply_updates(eager_params, updates)
        assert _leaves_equal(params, eager_params) and _leaves_equal(state, eager_state), step
        if step == 1:
            frames = counter.frame_count
    assert counter.frame_count == frames
