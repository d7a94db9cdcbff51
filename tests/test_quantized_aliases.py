import optree
import pytest
import torch

import fadam
from fadam.quantization import QuantizedArray


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ALIASES = {
    "adam8bit": (fadam.adam8bit, fadam.adam, {"lr": 1e-2, "weight_decay": 0.01}),
    "adamw8bit": (fadam.adamw8bit, fadam.adamw, {"lr": 1e-2}),
    "adam4bit": (fadam.adam4bit, fadam.adam, {"lr": 1e-2, "amsgrad": True}),
    "adamw4bit": (fadam.adamw4bit, fadam.adamw, {"lr": 1e-2, "maximize": True}),
    "sgd8bit": (fadam.sgd8bit, fadam.sgd, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
}


@pytest.mark.parametrize("name", list(ALIASES))
def test_alias_first_step_matches_full_precision(name):
    make, reference, kwargs = ALIASES[name]
    torch.manual_seed(0)
    params = {"w": torch.randn(64, 128), "b": torch.randn(64)}
    grads = {"w": torch.randn(64, 128), "b": torch.randn(64)}
    tx, ref = make(**kwargs), reference(**kwargs)
    state = tx.init(params)
    assert isinstance(first_quantized(state), QuantizedArray)
    updates, state = tx.update(grads, state, params)
    ref_updates, _ = ref.update(grads, ref.init(params), params)
    # step 1 reads the zero state exactly, so the update is exactly the full-precision one
    for k in params:
        torch.testing.assert_close(updates[k], ref_updates[k], rtol=1e-6, atol=1e-8)


def first_quantized(state):
    nodes = optree.tree_leaves(state, is_leaf=lambda n: isinstance(n, QuantizedArray), none_is_leaf=True)
    return next(n for n in nodes if isinstance(n, QuantizedArray))


def test_lion8bit_matches_lion_equations_on_step_one_and_stays_close():
    torch.manual_seed(0)
    params = [torch.randn(8192)]
    tx = fadam.lion8bit(lr=1e-3, weight_decay=0.1)
    ref = fadam.chain(
        fadam.scale_by_lion(), fadam.scale_by_learning_rate(1e-3), fadam.add_decoupled_weight_decay(1e-3, 0.1)
    )
    state, ref_state = tx.init(params), ref.init(params)
    agree = []
    for _ in range(5):
        grads = [torch.randn(8192)]
        u, state = tx.update(grads, state, params)
        r, ref_state = ref.update(grads, ref_state, params)
        agree.append((torch.sign(u[0] + 1e-4 * params[0]) == torch.sign(r[0] + 1e-4 * params[0])).float().mean())
    assert agree[0] == 1.0 and min(agree) > 0.99


@pytest.mark.parametrize(("make", "limit"), [(fadam.adam8bit, 2.04), (fadam.adam4bit, 1.07)])
def test_bytes_per_param(make, limit):
    params = {"a": torch.zeros(1024, 1024), "b": torch.zeros(4096, 96), "bias": torch.zeros(1024)}
    tx = make()
    state = tx.init(params)
    n = sum(p.numel() for p in params.values())
    nbytes = sum(t.numel() * t.element_size() for t in optree.tree_leaves(state))
    assert nbytes / n <= limit


def test_sgd8bit_needs_momentum():
    with pytest.raises(ValueError, match="momentum"):
        fadam.sgd8bit(momentum=0.0)


def test_lion_complex_and_none():
    tx = fadam.scale_by_lion(0.5, 0.5)
    state = tx.init([torch.zeros(2, dtype=torch.complex64), torch.zeros(1)])
    u, state = tx.update([torch.tensor([1 - 2j, -3 + 0j]), None], state)
    assert torch.equal(u[0], torch.tensor([1 - 1j, -1 + 0j])) and u[1] is None
    assert torch.equal(state.mu[0], torch.tensor([0.5 - 1j, -1.5 + 0j])) and state.count == 1
