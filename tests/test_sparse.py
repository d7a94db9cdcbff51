"""Sparse COO gradients, as ``nn.Embedding(sparse=True)`` gives them: ``fadam.sgd``, ``fadam.adagrad`` and
``fadam.sparse_adam`` against torch.optim's for-loop over 60 float64 steps (uncoalesced gradients with repeated
indices, an empty one, a dense leaf beside), the elements they leave alone, the refusals of every other transform
(naming the leaf and the transform, nothing written), ``fadam.explain``, and ``fadam.SparseAdam``.

torch.optim's own inputs with sparse gradients (every flag, weight decay refused, ``fused=True`` refused) run through
the drop-ins in tests/test_optim_db.py."""

from __future__ import annotations

import io
import re
from typing import Any

import optree
import pytest
import torch

import fadam
from fadam._tree import UnsupportedGradientError
from tests.tree_checks import assert_unchanged, max_rel_err, snapshot

STEPS = 60
ROWS, DIM = 12, 3
EMPTY_STEP = 7  # a gradient that stores no element: torch.optim's SparseAdam skips it, its step still counts

# (id, fadam alias, torch.optim class, kwargs for both)
CASES = [
    ("sgd", fadam.sgd, torch.optim.SGD, {"lr": 0.05}),
    ("sgd-maximize", fadam.sgd, torch.optim.SGD, {"lr": 0.05, "maximize": True}),
    ("sgd-momentum", fadam.sgd, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    ("sgd-dampening", fadam.sgd, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.3}),
    ("sgd-nesterov-max", fadam.sgd, torch.optim.SGD, {"lr": 0.05, "momentum": 0.8, "nesterov": True, "maximize": True}),
    ("adagrad", fadam.adagrad, torch.optim.Adagrad, {"lr": 0.1}),
    (
        "adagrad-decay-max",
        fadam.adagrad,
        torch.optim.Adagrad,
        {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-6, "maximize": True},
    ),
    ("sparse_adam", fadam.sparse_adam, torch.optim.SparseAdam, {"lr": 0.01}),
    (
        "sparse_adam-max",
        fadam.sparse_adam,
        torch.optim.SparseAdam,
        {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "maximize": True},
    ),
]


def _sparse_grad(gen: torch.Generator, rows: int, step: int) -> torch.Tensor:
    """An uncoalesced COO gradient over ``rows`` rows of ``DIM`` (a 1-d one without ``DIM``), some rows twice."""
    count = 0 if step == EMPTY_STEP else 5
    index = torch.randint(0, rows, (count,), generator=gen)
    index = torch.cat([index, index[:2]])  # repeated indices, summed by coalescing
    shape = (rows, DIM) if rows == ROWS else (rows,)
    values = torch.randn(len(index), *shape[1:], generator=gen, dtype=torch.float64)
    return torch.sparse_coo_tensor(index[None], values, shape, check_invariants=True)


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64),
        "bias": torch.randn(4, generator=gen, dtype=torch.float64),
    }


def _grads(gen: torch.Generator, step: int, dense_bias: bool) -> dict[str, torch.Tensor]:
    bias = torch.randn(4, generator=gen, dtype=torch.float64) if dense_bias else _sparse_grad(gen, 4, step)
    return {"emb": _sparse_grad(gen, ROWS, step), "bias": bias}


@pytest.mark.parametrize(("name", "make", "cls", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_steps_equal_torch_for_loop(name, make, cls, kwargs):
    """``fadam.step`` (donated: the dense leaf takes a kernel, the sparse one runs eagerly) and ``tx.update`` with
    ``apply_updates`` follow torch.optim's for-loop within 1e-12, step after step."""
    params = _params()
    refs = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    flags = {} if cls is torch.optim.SparseAdam else {"foreach": False}
    opt = cls(refs.values(), **flags, **kwargs)
    tx = make(**kwargs)
    runs = {mode: ({k: v.clone() for k, v in params.items()}, tx.init(params)) for mode in ("step", "update")}
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(STEPS):
        grads = _grads(gen, step, dense_bias=cls is not torch.optim.SparseAdam)
        for key, ref in refs.items():
            ref.grad = grads[key].clone()
        opt.step()
        p, s = runs["step"]
        runs["step"] = fadam.step(tx, p, grads, s, donate=True)
        p, s = runs["update"]
        updates, s = tx.update(grads, s, p)
        assert updates["emb"].is_sparse == (name.startswith(("adagrad", "sparse_adam")) or "momentum" not in kwargs)
        runs["update"] = (fadam.apply_updates(p, updates), s)
        expected = {k: ref.detach() for k, ref in refs.items()}
        worst = max(worst, *(max_rel_err(p, expected)[0] for p, _ in runs.values()))
    assert worst <= 1e-12
    moved = (runs["step"][0]["emb"] - params["emb"]).abs().max().item()
    assert moved > 1e-2  # the trajectories went somewhere


@pytest.mark.parametrize("make", [fadam.adagrad, fadam.sparse_adam], ids=["adagrad", "sparse_adam"])
def test_rows_without_gradient_are_left_as_they_are(make):
    """Adagrad's sums and SparseAdam's moments change at the stored rows only, as do the params; the update is sparse
    with the coalesced gradient's indices."""
    params = {"emb": torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)}
    tx = make(lr=0.1)
    state = tx.init(params)
    grad = torch.sparse_coo_tensor([[3, 1, 3]], torch.ones(3, 2, dtype=torch.float64), (5, 2))
    before = tx.init(params)
    updates, new_state = tx.update({"emb": grad}, state, params)
    assert torch.equal(updates["emb"].indices(), torch.tensor([[1, 3]])) and updates["emb"].is_coalesced()
    new_params = fadam.apply_updates(params, updates)
    untouched, touched = [0, 2, 4], [1, 3]
    assert torch.equal(new_params["emb"][untouched], params["emb"][untouched])
    assert (new_params["emb"][touched] - params["emb"][touched]).abs().min() > 1e-3
    slots = [leaf for leaf in optree.tree_leaves(new_state) if isinstance(leaf, torch.Tensor) and leaf.dim() == 2]
    olds = [leaf for leaf in optree.tree_leaves(before) if isinstance(leaf, torch.Tensor) and leaf.dim() == 2]
    assert slots and all(torch.equal(new[untouched], old[untouched]) for new, old in zip(slots, olds))
    assert all(not torch.equal(new[touched], old[touched]) for new, old in zip(slots, olds))


def test_partition_steps_the_sparse_leaf_by_sgd_and_the_dense_one_by_adam():
    params = _params()
    labels = {"emb": "sparse", "bias": "dense"}
    tx = fadam.partition({"sparse": fadam.sgd(0.1, momentum=0.9), "dense": fadam.adam(0.01)}, labels)
    alone = {"sparse": fadam.sgd(0.1, momentum=0.9), "dense": fadam.adam(0.01)}
    state = tx.init(params)
    states = {label: alone[label].init({key: params[key]}) for key, label in labels.items()}
    expected = dict(params)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        grads = _grads(gen, step, dense_bias=True)
        params, state = fadam.step(tx, params, grads, state)
        for key, label in labels.items():
            new, states[label] = fadam.step(alone[label], {key: expected[key]}, {key: grads[key]}, states[label])
            expected[key] = new[key]
    assert all(torch.equal(params[k], expected[k]) for k in params)


REFUSALS = [
    ("adam", lambda: fadam.adam(1e-2), "scale_by_adam"),
    ("adamw", lambda: fadam.adamw(1e-2), "scale_by_adam"),
    ("rmsprop", lambda: fadam.rmsprop(1e-2), "scale_by_rms"),
    ("user-chain", lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.scale(-0.1)), "clip_by_global_norm"),
    ("opaque-member", lambda: fadam.chain(fadam.scale(-1.0), fadam.add_noise(0.1, 0.5, 0)), "add_noise (state at [1])"),
    ("partition", lambda: fadam.partition({"a": fadam.adam(1e-2)}, {"emb": "a", "bias": "a"}), "scale_by_adam"),
    (
        "sgd-weight-decay",
        lambda: fadam.sgd(1e-2, momentum=0.9, weight_decay=0.1),
        "add_decayed_weights (weight_decay option is not compatible with sparse gradients",
    ),
    ("adagrad-weight-decay", lambda: fadam.adagrad(1e-2, weight_decay=0.1), "add_decayed_weights (weight_decay"),
]


@pytest.mark.parametrize("mode", ["update", "step", "step-donate"])
@pytest.mark.parametrize(("name", "make", "transform"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_transforms_that_take_no_sparse_gradient_refuse_it_before_anything_changes(name, make, transform, mode):
    tx = make()
    params = _params()
    state = tx.init(params)
    gen = torch.Generator().manual_seed(3)
    params, state = fadam.step(tx, params, _grads(gen, 0, dense_bias=True) | {"emb": torch.ones(ROWS, DIM)}, state)
    grads = _grads(gen, 1, dense_bias=True)
    before = snapshot(params), snapshot(state)
    what = "updates" if mode == "update" else "grads"
    message = f"{what} leaf at ['emb']: sparse gradients are not supported by {transform}"
    with pytest.raises(UnsupportedGradientError, match=re.escape(message)) as raised:
        if mode == "update":
            tx.update(grads, state, params)
        else:
            fadam.step(tx, params, grads, state, donate=mode == "step-donate")
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, RuntimeError)  # fadam's and torch's
    assert_unchanged(before[0], "params")
    assert_unchanged(before[1], "state")


@pytest.mark.parametrize("mode", ["update", "step"])
def test_sparse_adam_refuses_dense_gradients_in_torchs_words(mode):
    tx = fadam.sparse_adam()
    params = _params()
    state = tx.init(params)
    grads = {"emb": _sparse_grad(torch.Generator().manual_seed(0), ROWS, 0), "bias": torch.ones(4)}
    message = (
        "leaf at ['bias']: scale_by_sparse_adam takes sparse gradients only (SparseAdam does not support dense "
        "gradients, please consider Adam instead)"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        if mode == "update":
            tx.update(grads, state, params)
        else:
            fadam.step(tx, params, grads, state, donate=True)


@pytest.mark.parametrize(
    ("param", "grad", "message"),
    [
        (
            torch.zeros(3, 2),
            torch.ones(3, 2, dtype=torch.complex64).to_sparse(),
            "complex sparse gradients are not supported",
        ),
        (torch.zeros(3, 2), torch.ones(3, 2).to_sparse_csr(), "sparse or non-strided tensors (torch.sparse_csr)"),
        (torch.zeros(3, 2), torch.ones(2, 2).to_sparse(), "shape (2, 2) does not match expected (3, 2)"),
    ],
    ids=["complex", "csr", "shape"],
)
def test_sparse_gradients_fadam_cannot_step_are_named(param, grad, message):
    tx = fadam.sgd(0.1)
    with pytest.raises(ValueError, match=re.escape("updates leaf at ['w']: ") + ".*" + re.escape(message)):
        tx.update({"w": grad}, tx.init({"w": param}), {"w": param})


def test_explain_names_the_sparse_leaf_eager_and_the_dense_one_on_torchs_kernel():
    tx = fadam.sgd(0.1, momentum=0.9)
    params = _params()
    grads = _grads(torch.Generator().manual_seed(0), 0, dense_bias=True)
    assert fadam.explain(tx, params, grads).split("\n") == [
        "trace -> scale_by_learning_rate: eager: a torch.sparse_coo tensor: ['emb']",
        "trace -> scale_by_learning_rate: torch._fused_sgd_: ['bias']",
    ]
    with pytest.raises(UnsupportedGradientError, match=re.escape("['emb']: sparse gradients are not supported")):
        fadam.explain(fadam.adam(), params, grads)


def _embedding_run(opt_cls: Any, **kwargs: Any) -> tuple[torch.nn.Embedding, torch.optim.Optimizer]:
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(_params()["emb"])
    return emb, opt_cls(emb.parameters(), **kwargs)


def _embedding_steps(emb: torch.nn.Embedding, opt: torch.optim.Optimizer, start: int, count: int) -> None:
    for step in range(start, start + count):
        gen = torch.Generator().manual_seed(10 + step)
        index = torch.randint(0, ROWS, (2, 5), generator=gen)  # rows looked up twice give repeated indices
        opt.zero_grad()
        (emb(index) ** 2).sum().backward()
        opt.step()


def test_sparse_adam_class_steps_an_embedding_as_torch_and_resumes_from_its_state_dict():
    theirs, torch_opt = _embedding_run(torch.optim.SparseAdam, lr=0.05)
    ours, opt = _embedding_run(fadam.SparseAdam, lr=0.05)
    _embedding_steps(theirs, torch_opt, 0, 6)
    _embedding_steps(ours, opt, 0, 6)
    assert (ours.weight - theirs.weight).abs().max().item() <= 1e-12
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed, resumed_opt = _embedding_run(fadam.SparseAdam, lr=0.05)
    with torch.no_grad():
        resumed.weight.copy_(ours.weight)
    resumed_opt.load_state_dict(torch.load(buffer, weights_only=True))
    _embedding_steps(ours, opt, 6, 3)
    _embedding_steps(resumed, resumed_opt, 6, 3)
    assert torch.equal(resumed.weight, ours.weight)


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": -0.1}, {"lr": torch.tensor([0.1, 0.2])}, {"eps": 0.0}, {"betas": (1.0, 0.9)}, {"betas": (0.9, -0.1)}],
    ids=["lr", "tensor-lr", "eps", "beta1", "beta2"],
)
def test_sparse_adam_class_checks_its_arguments_as_torch(kwargs):
    errors = []
    for cls in (torch.optim.SparseAdam, fadam.SparseAdam):
        with pytest.raises(ValueError) as raised:
            cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_torchs_sparse_momentum_buffer_loads_densified_and_continues_as_torch():
    """torch.optim.SGD keeps a sparse momentum buffer for sparse gradients; fadam.Optimizer loads it dense."""
    theirs, torch_opt = _embedding_run(torch.optim.SGD, lr=0.05, momentum=0.9, foreach=False)
    _embedding_steps(theirs, torch_opt, 0, 3)
    assert torch_opt.state[theirs.weight]["momentum_buffer"].is_sparse
    ours, opt = _embedding_run(fadam.Optimizer, tx=fadam.sgd, lr=0.05, momentum=0.9)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
    opt.load_state_dict(torch_opt.state_dict())
    _embedding_steps(theirs, torch_opt, 3, 3)
    _embedding_steps(ours, opt, 3, 3)
    assert (ours.weight - theirs.weight).abs().max().item() <= 1e-12
