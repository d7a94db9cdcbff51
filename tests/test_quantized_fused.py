"""fadam.step on the quantized Adam aliases runs a fused (compiled) kernel; it must agree with the chain."""

import optree
import pytest
import torch

import fadam
from fadam.quantization import QuantizedArray, _fused, dequantize_blockwise


@pytest.fixture
def eager_kernel(monkeypatch):
    # The same row kernel without torch.compile: compiling costs tens of seconds on a busy 2-core machine, so only
    # the slow test below compiles; benchmarks/bench_quantized.py checks the compiled kernel on every run.
    monkeypatch.setattr(_fused, "_kernel", lambda: _fused._rows_step_inplace)


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
def test_fused_step_matches_chain(make, bits, kwargs, eager_kernel):
    check_fused_step_matches_chain(make, bits, kwargs)


@pytest.mark.slow
def test_compiled_fused_step_matches_chain():
    check_fused_step_matches_chain(fadam.adamw8bit, 8, {"weight_decay": 0.1})


def check_fused_step_matches_chain(make, bits, kwargs):
    torch.manual_seed(0)
    block = 256 if bits == 8 else 128
    # a ragged last block (odd at 4 bits), a small full-precision leaf, a leaf that is whole blocks
    params = {"w": torch.randn(33, 31), "b": torch.randn(10), "c": torch.randn(4 * block)}
    tx = make(lr=1e-2, min_size=100, **kwargs)
    fused_p, fused_s = params, tx.init(params)
    chain_p, chain_s = params, tx.init(params)
    originals = [t.clone() for t in optree.tree_leaves((params, fused_s))]
    for step in range(4):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        fused_p, fused_s = fadam.step(tx, fused_p, grads, fused_s, donate=step % 2 == 1)
        updates, chain_s = tx.update(grads, chain_s, chain_p)
        chain_p = fadam.apply_updates(chain_p, updates)
        if step == 0:  # donate=False left the inputs alone
            assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((params, tx.init(params))), originals))
    inner = next(s for s in fused_s if isinstance(s, fadam.QuantizedState)).inner_state
    assert isinstance(inner.mu["w"], QuantizedArray) and inner.count == 4
    for k in params:  # compiled math rounds differently by an ulp, which can move a code by one step
        torch.testing.assert_close(fused_p[k], chain_p[k], rtol=0, atol=1e-4)
    for a, b in zip(
        dequantized_moments(fused_s, params, bits, block), dequantized_moments(chain_s, params, bits, block)
    ):
        assert (a - b).norm() <= 0.02 * b.norm()


def test_fused_step_bf16_params(eager_kernel):
    torch.manual_seed(0)
    params = {"w": torch.randn(40, 30).to(torch.bfloat16), "b": torch.randn(7).to(torch.bfloat16)}
    tx = fadam.adamw8bit(lr=1e-2, min_size=100)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    fused_p, _ = fadam.step(tx, params, grads, tx.init(params))
    updates, _ = tx.update(grads, tx.init(params), params)
    for k in params:
        assert fused_p[k].dtype == torch.bfloat16
        torch.testing.assert_close(fused_p[k], fadam.apply_updates(params, updates)[k], rtol=0, atol=0)


def test_fused_step_reads_a_state_written_by_the_chain(eager_kernel):
    # step 1 with all-positive gradients: the chain stores m with the non-negative map; the fused step must decode it
    params = {"w": torch.randn(1000)}
    tx = fadam.adam8bit(lr=1e-2, min_size=1)
    _, state = tx.update({"w": torch.rand(1000)}, tx.init(params), params)
    inner = state[0].inner_state
    assert int(inner.mu["w"].map_id) == 1
    grads = {"w": torch.randn(1000)}
    fused_p, fused_s = fadam.step(tx, params, grads, state)
    updates, _ = tx.update(grads, state, params)
    torch.testing.assert_close(fused_p["w"], fadam.apply_updates(params, updates)["w"], rtol=0, atol=1e-6)
    assert int(fused_s[0].inner_state.mu["w"].map_id) == 0


def test_fused_step_declines_what_it_cannot_run(eager_kernel):
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


@pytest.mark.parametrize(("make", "bits"), [(fadam.adamw8bit, 8), (fadam.adam4bit, 4)])
def test_fused_step_chunks_agree_with_one_chunk(make, bits, eager_kernel, monkeypatch):
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
