"""Inputs that fadam refuses with a short error naming the leaf, and inputs it accepts as a torch.optim user expects:
params and gradients of the wrong dtype, another transform's state, non-tensor leaves and generators, trees that
differ only in their kind of mapping, large mismatched trees, and hyperparameters on the meta device."""

from __future__ import annotations

import collections
import time

import pytest
import torch

import fadam
from tests.conformance.table import ALL_ROWS

# one row per optimizer of the conformance table whose init reads the params
INIT_ROWS = [row for row in ALL_ROWS if row.value_state]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
@pytest.mark.parametrize("row", INIT_ROWS, ids=str)
def test_init_refuses_params_that_cannot_be_optimized(row, dtype):
    params = {"w": torch.ones(3), "steps": torch.zeros(3, dtype=dtype)}
    with pytest.raises(TypeError, match=rf"params leaf at \['steps'\]: dtype {dtype} cannot be optimized"):
        row.build().init(params)


@pytest.mark.parametrize(
    "make", [lambda: fadam.sgd(0.1), lambda: fadam.adam(0.1), lambda: fadam.lion(0.1)], ids=["sgd", "adam", "lion"]
)
def test_update_refuses_integer_gradients_and_integer_params(make):
    tx = make()
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"updates leaf at \['w'\]: dtype torch.int64 is not supported"):
        tx.update({"w": torch.ones(3, dtype=torch.int64)}, state, params)
    # a param that init never saw as an integer (the state came from float params) is refused at update too
    with pytest.raises(ValueError, match=r"updates leaf at \['w'\]: its leaf in params has dtype torch.int64"):
        tx.update({"w": torch.ones(3)}, state, {"w": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"grads leaf at \['w'\]|updates leaf at \['w'\]"):
        fadam.step(tx, {"w": torch.ones(3, dtype=torch.int64)}, {"w": torch.ones(3)}, state, donate=True)


@pytest.mark.parametrize("row", [row for row in INIT_ROWS if row.torch_cls is not None], ids=str)
def test_low_precision_grads_are_computed_in_the_params_dtype(row):
    """float16 gradients of float32 params give the update of the same gradients in float32: torch.optim computes in
    the param's dtype (a float16 Adam update of lr=1e-8 would round to 0)."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen).to(torch.float16) for k, v in params.items()}
    tx = row.build(lr=1e-8)
    updates, _ = tx.update(grads, tx.init(params), params)
    want, _ = tx.update({k: g.float() for k, g in grads.items()}, tx.init(params), params)
    for key in params:
        assert updates[key].dtype == torch.float32
        assert torch.equal(updates[key], want[key])
    assert torch.count_nonzero(updates["w"]) > 0


def test_wider_grads_keep_their_precision():
    """float32 gradients of bfloat16 params are not rounded to bfloat16 before the math (nothing is cast down)."""
    params = {"w": torch.ones(3, dtype=torch.bfloat16)}
    grads = {"w": torch.tensor([1e-3, 2e-3, 3e-3])}
    tx = fadam.sgd(1.0)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["w"].dtype == torch.float32 and torch.equal(updates["w"], -grads["w"])


STATE_MIXUPS = [
    ("lion", "adamw", "scale_by_lion was given a ScaleByAdamState"),
    ("adamax", "adam", "scale_by_adamax was given a ScaleByAdamState"),
    ("sgd_momentum", "adam", "trace was given a ScaleByAdamState"),
    ("adam", "sgd_momentum", "scale_by_adam was given a TraceState"),
    ("rmsprop", "adam", "scale_by_rms was given a ScaleByAdamState"),
    ("adam_amsgrad", "adam", "scale_by_adam was given a ScaleByAdamState as its state, expected a ScaleByAmsgradState"),
    ("nadam", "radam", "scale_by_nadam was given a ScaleByRadamState"),
    ("adagrad", "rmsprop", "scale_by_rss was given a ScaleByRmsState"),
    ("adafactor", "adam", "chain of 5 transforms got a state that is not a tuple of that length"),
    ("adam", "adam8bit", "chain of 2 transforms got a state that is not a tuple|scale_by_adam was given"),
    ("adam8bit", "adam", "quantize_state was given a ScaleByAdamState as its state, expected a QuantizedState"),
]
MAKERS = {
    "adam": lambda: fadam.adam(0.1),
    "adam_amsgrad": lambda: fadam.adam(0.1, amsgrad=True),
    "adamw": lambda: fadam.adamw(0.1),
    "adamax": lambda: fadam.adamax(0.1),
    "lion": lambda: fadam.lion(0.1),
    "sgd_momentum": lambda: fadam.sgd(0.1, momentum=0.9),
    "rmsprop": lambda: fadam.rmsprop(0.1),
    "nadam": lambda: fadam.nadam(0.1),
    "radam": lambda: fadam.radam(0.1),
    "adagrad": lambda: fadam.adagrad(0.1),
    "adafactor": lambda: fadam.adafactor(0.1, min_dim_size_to_factor=2),
    "adam8bit": lambda: fadam.adam8bit(0.1, min_size=0),
}


@pytest.mark.parametrize(("user", "owner", "message"), STATE_MIXUPS, ids=[f"{u}-on-{o}" for u, o, _ in STATE_MIXUPS])
def test_another_optimizers_state_is_refused(user, owner, message):
    params = {"w": torch.ones(4, 3)}
    state = MAKERS[owner]().init(params)
    with pytest.raises(ValueError, match=message):
        MAKERS[user]().update({"w": torch.ones(4, 3)}, state, params)
    with pytest.raises(ValueError, match=message):
        fadam.step(MAKERS[user](), params, {"w": torch.ones(4, 3)}, state, donate=True)
    assert torch.equal(params["w"], torch.ones(4, 3))


def test_wrappers_refuse_a_state_they_did_not_make():
    params = {"w": torch.ones(2)}
    plain = fadam.adam(0.1).init(params)
    for tx, name in [
        (fadam.masked(fadam.adam(0.1), {"w": True}), "masked"),
        (fadam.apply_if_finite(fadam.adam(0.1), 3), "apply_if_finite"),
        (fadam.MultiSteps(fadam.adam(0.1), 2), "MultiSteps"),
        (fadam.inject_hyperparams(fadam.adam)(lr=0.1), "inject_hyperparams"),
        (fadam.partition({"a": fadam.adam(0.1)}, {"w": "a"}), "partition"),
        (fadam.zero_nans(), "zero_nans"),
    ]:
        with pytest.raises(ValueError, match=rf"^{name} was given a tuple as its state"):
            tx.update({"w": torch.ones(2)}, plain, params)


@pytest.mark.parametrize("row", INIT_ROWS, ids=str)
def test_init_names_a_non_tensor_leaf(row):
    with pytest.raises(TypeError, match=r"params leaf at \['n_layers'\]: expected a torch.Tensor or None, got int"):
        row.build().init({"w": torch.ones(2), "n_layers": 3})


@pytest.mark.parametrize("row", INIT_ROWS, ids=str)
def test_init_refuses_a_generator_of_params(row):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"params is a generator.*list\(model.parameters\(\)\)"):
        row.build().init(model.parameters())


def test_state_dict_and_dict_of_the_same_params_are_one_tree():
    """An OrderedDict (``module.state_dict()``) and a dict with the same keys flatten in different orders; fadam
    matches their leaves by key, both ways, and gives the results laid out as the params."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    ordered = collections.OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    plain = dict(ordered)
    gen = torch.Generator().manual_seed(0)
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in plain.items()} for _ in range(3)]
    for tx in (fadam.adam(0.1), fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(0.1)), fadam.lion(0.1)):
        want, state = plain, tx.init(plain)
        for g in grads:
            want, state = fadam.step(tx, want, g, state)
        # params an OrderedDict, grads dicts, state from a dict
        got, state = ordered, tx.init(plain)
        for g in grads:
            got, state = fadam.step(tx, got, g, state)
        assert isinstance(got, collections.OrderedDict) and list(got) == list(ordered)
        for key in plain:
            assert torch.equal(got[key], want[key]), key
        # and the other way round: dict params, OrderedDict grads, state from an OrderedDict
        got, state = plain, tx.init(ordered)
        for g in grads:
            got, state = fadam.step(tx, got, collections.OrderedDict((k, g[k]) for k in ordered), state)
        for key in plain:
            assert torch.equal(got[key], want[key]), key


def test_a_dict_mask_selects_leaves_of_an_ordereddict():
    ordered = collections.OrderedDict([("b", torch.ones(2)), ("a", torch.ones(2))])
    tx = fadam.masked(fadam.scale(0.0), {"a": True, "b": False})
    updates, _ = tx.update(ordered, tx.init(ordered))
    assert torch.equal(updates["a"], torch.zeros(2)) and torch.equal(updates["b"], torch.ones(2))


def test_a_dict_mask_of_quantize_state_selects_leaves_of_an_ordereddict():
    ordered = collections.OrderedDict([("b", torch.ones(64, 128)), ("a", torch.ones(64, 128))])
    tx = fadam.quantize_state(fadam.scale_by_adam(), mask={"a": True, "b": False})
    state = tx.init(ordered)
    quantized = {key: isinstance(leaf, fadam.QuantizedArray) for key, leaf in state.inner_state.mu.items()}
    assert quantized == {"a": True, "b": False}


def test_a_checkpoint_of_meta_tensors_is_refused_by_name():
    tx = fadam.adam(0.1)
    saved = fadam.state_to_dict(tx.init({"w": torch.zeros(3, device="meta")}))
    with pytest.raises(ValueError, match=r"state path \[0\]\['mu'\]\['w'\]: the checkpoint holds a meta tensor"):
        fadam.state_from_dict(tx.init({"w": torch.zeros(3)}), saved)


def _large(n: int = 10_000) -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.zeros(2) for i in range(n)}


@pytest.mark.parametrize(
    ("grads_of", "message"),
    [
        (lambda p: list(p.values()), r"no leaf at \['layer0'\] in grads, but params has one"),
        (lambda p: {**p, "extra": torch.zeros(2)}, r"extra leaf at \['extra'\] in grads, not in params"),
        (lambda p: {**p, "layer7": [p["layer7"]]}, r"extra leaf at \['layer7'\]\[0\] in grads, not in params"),
    ],
    ids=["list-for-dict", "extra-key", "nested"],
)
def test_mismatch_of_a_large_tree_is_named_in_a_short_message(grads_of, message):
    params = _large()
    tx = fadam.sgd(0.1)
    state = tx.init(params)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message) as err:
        fadam.step(tx, params, grads_of(params), state)
    assert len(str(err.value)) < 300
    assert time.perf_counter() - start < 5.0  # the whole tree spec was once printed, taking seconds


def test_list_for_tuple_in_a_large_tree_is_named_in_a_short_message():
    params = list(_large().values())
    tx = fadam.sgd(0.1)
    with pytest.raises(ValueError, match=r"at <root>, grads has a tuple of 10000 where params has a list of 10000"):
        fadam.step(tx, params, tuple(params), tx.init(params))
    nested = {"blocks": params}
    with pytest.raises(ValueError, match=r"at \['blocks'\], updates has a tuple of 10000 where params has a list") as e:
        tx.update({"blocks": tuple(params)}, tx.init(nested), nested)
    assert len(str(e.value)) < 300


def test_a_mask_that_is_not_a_prefix_of_a_large_tree_is_named_in_a_short_message():
    params = _large()
    mask = {f"layer{i}": True for i in range(1, 10_000)}
    with pytest.raises(ValueError, match=r"mask is not a prefix of the params tree: at \['layer0'\] it has no entry"):
        fadam.masked(fadam.adam(0.1), mask).init(params)
    with pytest.raises(ValueError, match=r"at <root> it has a list of 10000 where the params have a dict") as e:
        fadam.masked(fadam.adam(0.1), [True] * 10_000).init(params)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize(
    "build",
    [
        lambda lr: fadam.adam(lr=lr),
        lambda lr: fadam.sgd(lr=lr, momentum=0.9),
        lambda lr: fadam.inject_hyperparams(fadam.adamw)(lr=lr),
    ],
    ids=["adam", "sgd", "inject"],
)
def test_a_hyperparameter_on_the_meta_device_is_named(build):
    with pytest.raises(ValueError, match=r"^lr is a tensor on the meta device"):
        build(torch.tensor(0.1, device="meta")).init({"w": torch.zeros(2)})
