"""fadam.step and update on the quantized Adam aliases run fused kernels; they must agree with the chain.

On the CPU, float32 and bfloat16 params take the C++ kernel (tests/test_quantized_native.py checks it bit for bit);
other params take the torch.compile kernels, which tests/conftest.py runs eagerly except in tests marked slow (compiling
costs tens of seconds on a busy 2-core machine; CI runs them too). benchmarks/bench_quantized.py times both kernels on
16.8M params and counts recompilations.
"""

import warnings

import optree
import pytest
import torch

import fadam
from fadam.quantization import QuantizedArray, _fused, _native, dequantize_blockwise


@pytest.fixture
def torch_kernels(monkeypatch) -> None:
    """CPU params take the torch.compile kernels, as float16 and GPU params do, instead of the C++ one."""
    monkeypatch.setattr(_native, "available", lambda: False)


@pytest.fixture(params=["native", "torch"])
def kernel(request) -> str:
    """Which kernel float32 CPU params take: the C++ one, or the torch.compile ones."""
    if request.param == "torch":
        request.getfixturevalue("torch_kernels")
    return request.param


def _quantized(state) -> fadam.QuantizedState:
    return next(s for s in state if isinstance(s, fadam.QuantizedState))


def dequantized_moments(state, params, bits, block):
    inner = next(s for s in state if isinstance(s, fadam.QuantizedState)).inner_state
    out = []
    for field in (inner.mu, inner.nu):
        for k, p in params.items():
            q = field[k]
            out.append(dequantize_blockwise(q, p.shape, bits, block) if isinstance(q, QuantizedArray) else q)
    return out


@pytest.mark.parametrize(
    ("make", "bits", "kwargs"),
    [
        (fadam.adamw8bit, 8, {"weight_decay": 0.1}),
        (fadam.adam4bit, 4, {"weight_decay": 0.01, "maximize": True}),
    ],
)
def test_fused_step_matches_chain(make, bits, kwargs, unfused, kernel):
    check_fused_step_matches_chain(make, bits, kwargs, unfused, exact=kernel == "native")


@pytest.mark.slow
def test_compiled_fused_step_matches_chain(unfused, torch_kernels):
    check_fused_step_matches_chain(fadam.adamw8bit, 8, {"weight_decay": 0.1}, unfused, exact=False)


def _problem(make, bits, kwargs, unfused, w_shape):
    """(params, fused alias, its unfused chain, block size): a leaf ``w`` of ``w_shape``, a small full-precision leaf
    (below min_size) and a leaf of whole blocks."""
    torch.manual_seed(0)
    block = 256 if bits == 8 else 128
    params = {"w": torch.randn(*w_shape), "b": torch.randn(10), "c": torch.randn(4 * block)}
    tx, chain = make(lr=1e-2, min_size=100, **kwargs), unfused(make, lr=1e-2, min_size=100, **kwargs)
    return params, tx, chain, block


def _assert_moments_close(state, chain_state, params, bits, block):
    for a, b in zip(
        dequantized_moments(state, params, bits, block), dequantized_moments(chain_state, params, bits, block)
    ):
        assert (a - b).norm() <= 0.02 * b.norm()


def check_fused_step_matches_chain(make, bits, kwargs, unfused, exact):
    # w ends in a ragged block (odd at 4 bits)
    params, tx, chain, block = _problem(make, bits, kwargs, unfused, (33, 31))
    fused_p, fused_s = params, tx.init(params)
    chain_p, chain_s = params, tx.init(params)
    originals = [t.clone() for t in optree.tree_leaves((params, fused_s))]
    for step in range(4):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        fused_p, fused_s = fadam.step(tx, fused_p, grads, fused_s, donate=step % 2 == 1)
        updates, chain_s = chain.update(grads, chain_s, chain_p)
        chain_p = fadam.apply_updates(chain_p, updates)
        if step == 0:  # donate=False left the inputs alone
            assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((params, tx.init(params))), originals))
    inner = next(s for s in fused_s if isinstance(s, fadam.QuantizedState)).inner_state
    assert isinstance(inner.mu["w"], QuantizedArray) and inner.count == 4
    if exact:  # the C++ kernel is the chain's arithmetic
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(fused_p), optree.tree_leaves(chain_p)))
    for k in params:  # compiled math rounds differently by an ulp, which can move a code by one step
        torch.testing.assert_close(fused_p[k], chain_p[k], rtol=0, atol=1e-4)
    _assert_moments_close(fused_s, chain_s, params, bits, block)


@pytest.mark.parametrize(
    ("lr", "weight_decay"),
    [
        (1e-2, 1e-2),
        (0.1, 0.3),  # a decay factor (0.97) that bfloat16 cannot hold: p is multiplied by its float32 value
        (torch.tensor(0.1), 0.3),  # a tensor factor, which the chain rounds to bfloat16 first
    ],
)
def test_fused_step_bf16_params(unfused, lr, weight_decay):
    torch.manual_seed(0)
    params = {"w": torch.randn(40, 30).to(torch.bfloat16), "b": torch.randn(7).to(torch.bfloat16)}
    kwargs = {"lr": lr, "weight_decay": weight_decay, "min_size": 100}
    tx, chain = fadam.adamw8bit(**kwargs), unfused(fadam.adamw8bit, **kwargs)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    fused_p, _ = fadam.step(tx, params, grads, tx.init(params))
    updates, _ = chain.update(grads, tx.init(params), params)
    fused_updates, _ = tx.update(grads, tx.init(params), params)
    for k in params:
        assert fused_p[k].dtype == fused_updates[k].dtype == updates[k].dtype == torch.bfloat16
        torch.testing.assert_close(fused_p[k], fadam.apply_updates(params, updates)[k], rtol=0, atol=0)
        torch.testing.assert_close(fused_updates[k], updates[k], rtol=0, atol=0)


@pytest.mark.parametrize("make", [fadam.adamw8bit, fadam.adam8bit])
def test_fused_step_float64_params_with_full_precision_moments_equal_the_chain(make, unfused):
    # the eager math of a small float64 leaf divides by the bias corrections and scales by the lr in float64, as the
    # chain does (float32 scalars, as for the other dtypes, moved its last bits)
    torch.manual_seed(0)
    params = {"b": torch.randn(1000, dtype=torch.float64)}
    tx, chain = make(lr=1e-2, weight_decay=0.1), unfused(make, lr=1e-2, weight_decay=0.1)
    p, state, chain_p, chain_state = params, tx.init(params), params, chain.init(params)
    for _ in range(3):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        p, state = fadam.step(tx, p, grads, state)
        updates, chain_state = chain.update(grads, chain_state, chain_p)
        chain_p = fadam.apply_updates(chain_p, updates)
    assert torch.equal(p["b"], chain_p["b"])
    assert optree.tree_all(optree.tree_map(torch.equal, state, chain_state))


@pytest.mark.parametrize(
    ("dtype", "weight_decay"),
    [(torch.float32, 0.0), (torch.bfloat16, 0.1)],  # bfloat16 with L2 decay: the ragged block runs eagerly
)
def test_fused_step_reads_a_state_written_by_the_chain(unfused, dtype, weight_decay):
    # step 1 with all-positive gradients: the chain stores m with the non-negative map; the kernels must decode it,
    # the ragged last block (1000 = 3 * 256 + 232) included
    params = {"w": torch.rand(1000).to(dtype)}  # positive, as the first gradients: the decay keeps m positive
    kwargs = {"lr": 1e-2, "min_size": 1, "weight_decay": weight_decay}
    tx, chain = fadam.adam8bit(**kwargs), unfused(fadam.adam8bit, **kwargs)
    _, state = chain.update({"w": torch.rand(1000).to(dtype)}, tx.init(params), params)
    inner = _quantized(state).inner_state
    assert int(inner.mu["w"].map_id) == 1
    grads = {"w": torch.randn(1000).to(dtype)}
    fused_p, fused_s = fadam.step(tx, params, grads, state)
    fused_updates, update_s = tx.update(grads, state, params)
    updates, _ = chain.update(grads, state, params)
    torch.testing.assert_close(fused_p["w"], fadam.apply_updates(params, updates)["w"], rtol=0, atol=1e-6)
    torch.testing.assert_close(fused_updates["w"], updates["w"], rtol=0, atol=1e-6)
    assert int(_quantized(fused_s).inner_state.mu["w"].map_id) == int(_quantized(update_s).inner_state.mu["w"].map_id)
    assert int(_quantized(fused_s).inner_state.mu["w"].map_id) == 0


def test_fused_step_declines_what_it_cannot_run():
    params = {"w": torch.randn(512)}
    grads = {"w": torch.randn(512)}
    for tx in (fadam.adam8bit(amsgrad=True, min_size=1), fadam.adam8bit(weight_decay=torch.tensor(0.1), min_size=1)):
        state = tx.init(params)
        new_p, _ = fadam.step(tx, params, grads, state)  # the chain runs instead
        updates, _ = tx.update(grads, state, params)
        assert torch.equal(new_p["w"], fadam.apply_updates(params, updates)["w"])
    tx = fadam.adam8bit(min_size=1)
    assert tx.update.fused_step({"w": params["w"].t()}, grads, tx.init(params), False) is not None
    strided = {"w": torch.randn(512, 2)[:, 0]}
    assert tx.update.fused_step(strided, grads, tx.init(strided), False) is None


@pytest.mark.parametrize(
    ("other", "error"),
    [
        (fadam.adamw8bit(min_size=1), "chain of 2 transforms got a state that is not a tuple of that length"),
        (fadam.adam8bit(min_size=1, amsgrad=True), "scale_by_adam was given a ScaleByAmsgradState"),
    ],
)
def test_a_state_laid_out_for_another_chain_is_left_to_the_chain(other, error):
    params, grads = {"w": torch.randn(1024)}, {"w": torch.randn(1024)}
    tx, state = fadam.adam8bit(min_size=1), other.init(params)
    assert tx.update.fused_step(params, grads, state, True) is None
    with pytest.raises(ValueError, match=error):
        tx.update(grads, state, params)


def _corrupt(q, name):
    """``q`` with one part malformed: what a hand-built or damaged checkpoint could hold."""
    if name == "short codes":
        return q._replace(codes=q.codes[:-1].clone())
    if name == "short absmax":
        return q._replace(absmax=q.absmax[:-1].clone())
    if name == "2-d codes":
        return q._replace(codes=q.codes.reshape(2, -1).clone())
    if name == "strided codes":
        return q._replace(codes=torch.stack([q.codes, q.codes], dim=1)[:, 0])
    if name == "int32 codes":
        return q._replace(codes=q.codes.to(torch.int32))
    if name == "float64 absmax":
        return q._replace(absmax=q.absmax.double())
    if name == "unknown map id":
        return q._replace(map_id=torch.tensor(9, dtype=torch.uint8))
    if name == "another shape":  # codes and absmax of the right sizes for it
        return q._replace(like=torch.empty(32, 32, 0, dtype=torch.uint8))
    assert name == "1-d map id"
    return q._replace(map_id=q.map_id.reshape(1))


@pytest.mark.parametrize("moment", ["mu", "nu"])
@pytest.mark.parametrize(
    "corruption",
    [
        "short codes",
        "short absmax",
        "2-d codes",
        "strided codes",
        "int32 codes",
        "float64 absmax",
        "unknown map id",
        "another shape",
        "1-d map id",
    ],
)
def test_fused_step_leaves_a_malformed_state_to_the_chain_before_writing_anything(moment, corruption):
    # The C++ kernel writes through the addresses of the codes and absmax: every leaf is checked before any is
    # written, and a malformed one sends the whole step to the chain (which raises the error that names it, or runs).
    params = {"a": torch.randn(1024), "b": torch.randn(1024)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = fadam.adamw8bit(lr=1e-2, min_size=1)
    state = tx.init(params)
    state = fadam.step(tx, params, grads, state)[1]  # nonzero moments
    quantized = _quantized(state)
    moments = getattr(quantized.inner_state, moment)
    bad_inner = quantized.inner_state._replace(**{moment: {**moments, "b": _corrupt(moments["b"], corruption)}})
    bad_state = tuple(quantized._replace(inner_state=bad_inner) if s is quantized else s for s in state)
    before = [t.clone() for t in optree.tree_leaves((params, bad_state))]
    assert tx.update.fused_step(params, grads, bad_state, True) is None
    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves((params, bad_state))))


def _with_moment(state, moment: str, key: str, value: torch.Tensor):
    quantized = _quantized(state)
    moments = getattr(quantized.inner_state, moment)
    inner = quantized.inner_state._replace(**{moment: {**moments, key: value}})
    return tuple(quantized._replace(inner_state=inner) if s is quantized else s for s in state)


@pytest.mark.parametrize("moment", ["mu", "nu"])
@pytest.mark.parametrize("corruption", ["short", "reshaped"])
def test_fused_step_leaves_a_malformed_full_precision_moment_to_the_chain(moment, corruption):
    # float32 moments below min_size also go to the C++ kernel, which writes through their addresses
    params = {"a": torch.randn(1024), "b": torch.randn(1024)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = fadam.adamw8bit(lr=1e-2, min_size=10**6)
    state = tx.init(params)
    state = fadam.step(tx, params, grads, state)[1]
    good = getattr(_quantized(state).inner_state, moment)["b"]
    bad_state = _with_moment(state, moment, "b", good[:-1].clone() if corruption == "short" else good.reshape(32, 32))
    before = [t.clone() for t in optree.tree_leaves((params, bad_state))]
    assert tx.update.fused_step(params, grads, bad_state, True) is None
    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves((params, bad_state))))


def test_the_chain_names_the_state_of_a_malformed_full_precision_moment():
    params = {"a": torch.randn(1024), "b": torch.randn(1024)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = fadam.adamw8bit(lr=1e-2, min_size=10**6)
    state = _with_moment(tx.init(params), "mu", "b", torch.zeros(1023))
    with pytest.raises(
        ValueError, match=r"\['b'\]: shape \(1024,\) does not match expected \(1023,\) in the scale_by_adam state"
    ):
        fadam.step(tx, params, grads, state)


def test_full_precision_moments_the_kernel_cannot_take_run_eagerly_as_the_chain(unfused):
    # float64 or strided float32 moments below min_size: the fused step's eager math, bit for bit the chain's
    params = {"a": torch.randn(1024), "b": torch.randn(1024), "c": torch.randn(1024)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx, chain = fadam.adamw8bit(lr=1e-2, min_size=10**6), unfused(fadam.adamw8bit, lr=1e-2, min_size=10**6)
    state = tx.init(params)
    state = fadam.step(tx, params, grads, state)[1]
    for moment in ("mu", "nu"):
        values = getattr(_quantized(state).inner_state, moment)
        state = _with_moment(state, moment, "a", values["a"].double())
        strided = torch.stack([values["b"], values["b"]], dim=1)[:, 0]
        state = _with_moment(state, moment, "b", strided)
    fused = fadam.step(tx, params, grads, state)
    updates, chain_state = chain.update(grads, state, params)
    assert optree.tree_all(optree.tree_map(torch.equal, fused, (fadam.apply_updates(params, updates), chain_state)))


@pytest.mark.parametrize(("make", "bits"), [(fadam.adamw8bit, 8), (fadam.adam4bit, 4)])
def test_fused_step_chunks_agree_with_one_chunk(make, bits, monkeypatch, torch_kernels):
    # Rows run in chunks through two kernels (moments and absmax, then param and codes); chunk boundaries, a short
    # last chunk and a ragged last block must not change a bit.
    torch.manual_seed(0)
    params = {"w": torch.randn(37 * 256 + 100)}
    grads = [{"w": torch.randn_like(params["w"])} for _ in range(3)]
    tx = make(lr=1e-2, min_size=1)
    results = []
    for chunk in (1 << 20, 5 * 256):  # one chunk; chunks of 5 (8-bit) or 10 (4-bit) rows, the last one shorter
        monkeypatch.setattr(_fused, "_CHUNK", chunk)
        p, s = params, tx.init(params)
        for g in grads:
            p, s = fadam.step(tx, p, g, s)
        results.append(optree.tree_leaves((p, s)))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_compile_failure_falls_back_to_eager_once():
    calls = []

    def failing(*args):
        calls.append("compiled")
        raise torch._dynamo.exc.BackendCompilerFailed(failing, RuntimeError("no compiler"), None)

    run = _fused._with_fallback(failing, lambda x: calls.append("eager") or x + 1)
    with pytest.warns(UserWarning, match="running it eagerly"):
        assert run(1) == 2
    assert run(2) == 3  # no second attempt, no second warning
    assert calls == ["compiled", "eager", "eager"]


@pytest.mark.parametrize(
    ("make", "bits", "kwargs"),
    [
        (fadam.adam8bit, 8, {"weight_decay": 0.01}),
        (fadam.adamw8bit, 8, {"weight_decay": 0.1}),
        (fadam.adam4bit, 4, {"maximize": True}),
        (fadam.adamw4bit, 4, {"weight_decay": 0.1}),
    ],
)
def test_update_matches_chain_and_step(make, bits, kwargs, unfused, monkeypatch, kernel):
    monkeypatch.setattr(_fused, "_CHUNK", 3 * 256)  # chunks of 3 (8-bit) or 6 (4-bit) rows, the last one shorter
    check_update_matches_chain_and_step(make, bits, kwargs, unfused, exact=kernel == "native")


@pytest.mark.slow
def test_compiled_update_matches_chain_and_step(unfused, torch_kernels):
    check_update_matches_chain_and_step(fadam.adamw8bit, 8, {"weight_decay": 0.1}, unfused, exact=False)


def check_update_matches_chain_and_step(make, bits, kwargs, unfused, exact):
    # w: 7 (8-bit) or 14 (4-bit) whole blocks and a ragged 100
    params, tx, chain, block = _problem(make, bits, kwargs, unfused, (43, 44))
    p, s = params, tx.init(params)
    chain_p, chain_s = params, tx.init(params)
    for _ in range(4):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        inputs = optree.tree_leaves((p, grads, s))
        copies, versions = [t.clone() for t in inputs], [t._version for t in inputs]
        step_p, step_s = fadam.step(tx, p, grads, s)
        chain_updates, _ = chain.update(grads, s, p)
        updates, new_s = tx.update(grads, s, p)
        assert all(torch.equal(a, b) for a, b in zip(inputs, copies))  # nothing passed in was written
        assert [t._version for t in inputs] == versions
        for k in params:  # the same inputs: the chain's update (up to the compiled kernels' rounding, see above)
            assert updates[k].dtype == chain_updates[k].dtype
            tolerance = 0 if exact else 1e-4
            torch.testing.assert_close(updates[k], chain_updates[k], rtol=0, atol=tolerance)
        p, s = fadam.apply_updates(p, updates), new_s
        # p + u is the fused step's param bit for bit, and the states are the same
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((p, s)), optree.tree_leaves((step_p, step_s))))
        chain_updates, chain_s = chain.update(grads, chain_s, chain_p)
        chain_p = fadam.apply_updates(chain_p, chain_updates)
    inner = next(x for x in s if isinstance(x, fadam.QuantizedState)).inner_state
    assert isinstance(inner.mu["w"], QuantizedArray) and isinstance(inner.mu["c"], QuantizedArray) and inner.count == 4
    for k in params:
        torch.testing.assert_close(p[k], chain_p[k], rtol=0, atol=1e-4)
    _assert_moments_close(s, chain_s, params, bits, block)


def test_update_falls_back_to_the_chain_for_graphs_and_vmap(unfused, monkeypatch):
    calls = []
    monkeypatch.setattr(_fused, "_kernel", lambda: calls.append(1) or _fused._rows_step_inplace)
    run = _native._run
    monkeypatch.setattr(_native, "_run", lambda shared, fields: calls.append(1) or run(shared, fields))
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "min_size": 100}
    tx, chain = fadam.adamw8bit(**kwargs), unfused(fadam.adamw8bit, **kwargs)
    params = {"w": torch.randn(600)}
    state = tx.init(params)
    g = torch.randn(600, requires_grad=True)
    updates, _ = tx.update({"w": g}, state, params)
    assert updates["w"].requires_grad and not calls  # a grad that needs a graph: the chain keeps it
    assert torch.equal(updates["w"], chain.update({"w": g}, state, params)[0]["w"])
    stacked, grads = {"w": torch.randn(3, 600)}, {"w": torch.randn(3, 600)}
    state = torch.func.vmap(tx.init)(stacked)
    updates, _ = torch.func.vmap(tx.update)(grads, state, stacked)
    assert not calls
    assert torch.equal(updates["w"], torch.func.vmap(chain.update)(grads, state, stacked)[0]["w"])
    with pytest.raises(ValueError, match="got a state that is not a tuple"):  # the chain's error for a wrong state
        tx.update({"w": g.detach()}, ("wrong",), params)
    assert not calls
    tx.update({"w": g.detach()}, tx.init(params), params)
    assert calls  # plain tensors run the kernel


def test_recompile_limit_runs_new_hyperparameters_eagerly():
    calls = []

    def full(*args):
        calls.append("compiled")
        raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    run = _fused._with_fallback(full, lambda x: calls.append("eager") or x + 1)
    with pytest.warns(UserWarning, match="recompile_limit"):
        assert run(1) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning
        assert run(2) == 3
    assert calls == ["compiled", "eager", "compiled", "eager"]  # kernels compiled before still serve their calls


# Each way a step reaches the quantized state: the chain (quantize_state's own update), the alias' update (the fused
# kernels, writing the update out of place) and a donated fadam.step (the fused kernels in place), each fused way with
# the C++ kernel and with the torch.compile kernels (run eagerly here, see tests/conftest.py).
PATHS = [("chain", "native"), ("update", "native"), ("update", "torch"), ("step", "native"), ("step", "torch")]


def _steps(make, kwargs, params, grads, path, kernel, unfused, request):
    """The params after each step of ``make(**kwargs)`` along ``path`` on the gradients ``grads``."""
    if kernel == "torch":
        request.getfixturevalue("torch_kernels")
    tx = unfused(make, **kwargs) if path == "chain" else make(**kwargs)
    p, s = {k: v.clone() for k, v in params.items()}, tx.init(params)
    out = []
    for g in grads:
        if path == "update":
            updates, s = tx.update(g, s, p)
            p = fadam.apply_updates(p, updates)
        else:
            p, s = fadam.step(tx, p, g, s, donate=True)
        out.append({k: v.clone() for k, v in p.items()})
    return out


def _torch_adam_steps(make, kwargs, params, grads):
    """The same steps with torch.optim in float32: its params after each step and its last second moments."""
    weights = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    decoupled = "adamw" in make.__name__
    options = {"lr": kwargs["lr"], "weight_decay": kwargs.get("weight_decay", 0.0)}
    optimizer = (torch.optim.AdamW if decoupled else torch.optim.Adam)(weights.values(), **options)
    out = []
    for g in grads:
        for k, w in weights.items():
            w.grad = g[k].clone()
        optimizer.step()
        out.append({k: w.detach().clone() for k, w in weights.items()})
    return out, {k: optimizer.state[w]["exp_avg_sq"] for k, w in weights.items()}


def _params_and_shapes():
    torch.manual_seed(0)
    # w: whole blocks; c: a ragged last block (odd: at 4 bits the eager path's); b: full precision (below min_size)
    return {"w": torch.randn(64, 128), "c": torch.randn(301), "b": torch.randn(10)}


@pytest.mark.parametrize("make", [fadam.adam8bit, fadam.adam4bit, fadam.adamw8bit, fadam.adamw4bit])
@pytest.mark.parametrize(("path", "kernel"), PATHS)
def test_huge_gradients_keep_params_finite_as_fp32_adam_does(make, path, kernel, unfused, request):
    check_huge_gradients(make, path, kernel, unfused, request)


@pytest.mark.slow
@pytest.mark.parametrize("make", [fadam.adamw8bit, fadam.adam4bit])
def test_compiled_kernels_keep_params_finite_under_huge_gradients(make, unfused, request):
    check_huge_gradients(make, "step", "torch", unfused, request)


def check_huge_gradients(make, path, kernel, unfused, request):
    # Gradients of up to 1e38 overflow g * g: fp32 Adam's v turns inf there and its updates 0, for good. The quantized
    # state must keep that inf (a block of them, or one among finite entries) rather than store a finite number.
    params = _params_and_shapes()
    huge = []
    for step in range(2):
        g = {k: (torch.rand(v.shape, generator=torch.Generator().manual_seed(step)) * 2 - 1) for k, v in params.items()}
        g = {k: v * 1e38 for k, v in g.items()}  # every entry of every leaf
        g["c"][1::7] /= 1e38  # and some left small among the huge ones
        huge.append(g)
    grads = huge + [{k: torch.randn(v.shape) for k, v in params.items()} for _ in range(4)]
    kwargs = {"lr": 1e-2, "min_size": 64, "weight_decay": 0.0 if "adamw" not in make.__name__ else 0.1}
    ours = _steps(make, kwargs, params, grads, path, kernel, unfused, request)
    theirs, v = _torch_adam_steps(make, kwargs, params, grads)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for k in params:
            assert bool(b[k].isfinite().all())
            assert bool(a[k].isfinite().all()), (step, k)
            assert (a[k] - b[k]).abs().max() < 0.05, (step, k)  # lr * steps is 0.06: no step ran away
    for k in params:
        frozen = v[k].isinf()  # updates 0 since the first step, as fp32 Adam's
        assert bool(frozen.any())
        if "adamw" not in make.__name__:
            assert torch.equal(ours[-1][k][frozen], params[k][frozen])


@pytest.mark.parametrize("make", [fadam.adamw8bit, fadam.adam4bit])
@pytest.mark.parametrize(("path", "kernel"), PATHS)
def test_a_nan_gradient_makes_the_param_nan_exactly_where_fp32_adam_does(make, path, kernel, unfused, request):
    params = _params_and_shapes()
    grads = [{k: torch.randn(v.shape) for k, v in params.items()} for _ in range(4)]
    grads[1]["w"][3, 5] = grads[1]["c"][300] = grads[1]["b"][2] = float("nan")
    kwargs = {"lr": 1e-2, "min_size": 64, "weight_decay": 0.1}
    ours = _steps(make, kwargs, params, grads, path, kernel, unfused, request)
    theirs, _ = _torch_adam_steps(make, kwargs, params, grads)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for k in params:
            assert torch.equal(a[k].isnan(), b[k].isnan()), (step, k)
            assert int(a[k].isnan().sum()) == (step >= 1)


def _layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(param, gradient, the tensor the param is a view of) of each non-contiguous layout."""
    torch.manual_seed(0)
    base = torch.randn(1000, 3)
    return {
        "strided param": (base[:, 0], torch.randn(1000), base),
        "transposed param": (torch.randn(40, 33).t(), torch.randn(33, 40), None),
        "transposed gradient": (torch.randn(33, 40), torch.randn(40, 33).t(), None),
    }


@pytest.mark.parametrize("layout", ["strided param", "transposed param", "transposed gradient"])
@pytest.mark.parametrize("make", [fadam.adamw8bit, fadam.adam4bit])
@pytest.mark.parametrize("path", ["update", "step"])
def test_non_contiguous_params_and_gradients_give_the_results_of_contiguous_ones(layout, make, path, kernel):
    p, g, base = _layouts()[layout]
    untouched = None if base is None else base[:, 1:].clone()
    tx = make(lr=1e-2, weight_decay=0.1, min_size=64)
    results = []
    for param, grad in ((p.contiguous().clone(), g.contiguous()), (p, g)):
        params, state = {"w": param}, tx.init({"w": param})
        for _ in range(3):
            if path == "update":
                updates, state = tx.update({"w": grad}, state, params)
                params = fadam.apply_updates(params, updates)
            else:
                params, state = fadam.step(tx, params, {"w": grad}, state, donate=True)
        results.append((params["w"], state))
    (p_contiguous, s_contiguous), (p_strided, s_strided) = results
    exact = kernel == "native" or layout == "transposed gradient"  # else the chain against the torch kernels
    torch.testing.assert_close(p_strided, p_contiguous, rtol=0, atol=0 if exact else 1e-4)
    if exact:
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(s_strided), optree.tree_leaves(s_contiguous)))
    if base is not None:
        assert torch.equal(base[:, 1:], untouched)  # nothing written past the view's elements
